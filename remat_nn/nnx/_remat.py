"""``nnx.remat``: ``flax.nnx.remat`` with policies by name, aliases and validated plans.

Every argument ``flax.nnx.remat`` accepts behaves exactly as in flax (the call is forwarded to
it); what is added is policy resolution (:func:`remat_nn.policy`), plan validation against the
traced body at first use, argument checks at wrap time, and a Module class as target (its
``__call__``, or the ``methods`` given, rematerialized). ``nnx.checkpoint`` is ``nnx.remat``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from flax import nnx
from flax.nnx.transforms.autodiff import remat as flax_remat  # the original, even if patched

from remat_nn._checkpoint import (
    RematPolicy,
    check_bool,
    check_policy,
    check_static_argnums,
    resolve_remat,
)
from remat_nn._policies import NO_REMAT

__all__ = ["checkpoint", "remat"]

F = TypeVar("F")


def _check_methods(target: type[nnx.Module], methods: Any) -> list[str]:
    names = ["__call__"] if methods is None else methods
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(
            f"nnx.remat: argument `methods` must be a list of method names of "
            f"{target.__name__}, got {type(methods).__name__} {methods!r}. Fix: "
            "methods=['__call__']."
        )
    missing = [m for m in names if not callable(getattr(target, m, None))]
    if missing:
        raise ValueError(
            f"nnx.remat: argument `methods` names {missing}, which are not methods of "
            f"{target.__name__}. Fix: name methods it defines, e.g. methods=['__call__']."
        )
    return list(names)


def remat(
    f: Any = None,
    *,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
    policy: Any = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
    methods: Sequence[str] | None = None,
) -> Any:
    """Rematerializes a function of NNX modules, an unbound Module method, or a Module class.

    A strict superset of ``flax.nnx.remat``: the same arguments with the same meaning (the call
    is forwarded to flax, so graph / tree mode, state updates and ``static_argnums`` are
    flax's), and ``policy`` also accepts a policy name or alias (``"dots"``, ``"full"``, ...), a
    :class:`remat_nn.Plan`, a plan mapping or a plan string. A plan is checked against the body
    when it is first traced: a plan name that never occurs there raises
    :class:`remat_nn.PlanError` naming the names that do, so a typo never silently saves
    nothing. Also accepted (not by flax): an ``nnx.Module`` class, returned as a same-named
    subclass whose ``__call__`` (or ``methods``) is rematerialized.

    Args:
      f: the function (its arguments may be NNX modules), an unbound method (decorator use in
        a class body), or an ``nnx.Module`` class. Omitted: returns a decorator.
      prevent_cse: prevent common-subexpression elimination of the recomputation.
      static_argnums: positional arguments to specialize on (as ``jax.checkpoint``).
      policy: what to save; see :func:`remat_nn.policy` and :func:`remat_nn.plan`;
        ``"none"``: no remat, ``f`` returned unchanged.
      graph: flax's graph mode (``None``: flax's current default).
      graph_updates: flax's propagation of graph-structure updates (``None``: flax's default).
      methods: for a Module class only, the methods to rematerialize (default ``__call__``).

    Returns:
      The rematerialized function, or Module subclass.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import remat_nn as rn
    >>> from remat_nn import nnx as rnnx
    >>> class MLP(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.up, self.down = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.down(rn.name(jax.nn.relu(self.up(x)), "mlp_hidden"))
    >>> model = MLP(nnx.Rngs(0))
    >>> run = rnnx.remat(lambda m, x: m(x), policy={"save": ["mlp_hidden"]})
    >>> run(model, jnp.ones((2, 4))).shape
    (2, 4)
    >>> typo = rnnx.remat(lambda m, x: m(x), policy={"save": ["mlp_hiden"]})
    >>> typo(model, jnp.ones((2, 4)))
    Traceback (most recent call last):
    ...
    remat_nn.errors.PlanError: plan names ['mlp_hiden'] never occur in <lambda>, ...
    """
    check_policy(policy, "nnx.remat")
    check_bool(prevent_cse, "prevent_cse", "nnx.remat")
    for arg, value in (("graph", graph), ("graph_updates", graph_updates)):
        if value is not None:
            check_bool(value, arg, "nnx.remat")
    if f is None:
        return functools.partial(
            remat,
            prevent_cse=prevent_cse,
            static_argnums=static_argnums,
            policy=policy,
            graph=graph,
            graph_updates=graph_updates,
            methods=methods,
        )
    if policy == NO_REMAT:
        return f
    resolved = resolve_remat(policy, "nnx.remat")
    to_flax = functools.partial(
        flax_remat,
        prevent_cse=prevent_cse,
        static_argnums=static_argnums,
        policy=resolved.policy,
        graph=graph,
        graph_updates=graph_updates,
    )
    if isinstance(f, type) and issubclass(f, nnx.Module):
        names = _check_methods(f, methods)
        check_static_argnums(
            static_argnums,
            "nnx.remat",
            {f"{f.__name__}.{m}": getattr(f, m) for m in names},
            module=False,
        )
        attrs: dict[str, Any] = {"__module__": f.__module__, "__qualname__": f.__qualname__}
        for m in names:
            attrs[m] = _wrap(getattr(f, m), to_flax, resolved, f"{f.__name__}.{m}")
        return type(f.__name__, (f,), attrs)
    if methods is not None:
        raise TypeError(
            f"nnx.remat: argument `methods` applies to a Module class, but the target is "
            f"{type(f).__name__} {f!r}. Fix: drop methods=, or pass the class."
        )
    if isinstance(f, nnx.Module) or not callable(f):
        raise TypeError(
            f"nnx.remat: the target must be a function, an unbound method or an nnx.Module "
            f"class, got {'an instance of ' if isinstance(f, nnx.Module) else ''}"
            f"{type(f).__name__}. Fix: rnnx.remat(lambda m, x: m(x))(module, x), or "
            "rnnx.remat(type(module))."
        )
    where = getattr(f, "__qualname__", getattr(f, "__name__", repr(f)))
    check_static_argnums(static_argnums, "nnx.remat", {where: f}, module=False)
    return _wrap(f, to_flax, resolved, getattr(f, "__name__", repr(f)))


def _wrap(
    fn: Callable[..., Any], to_flax: Callable[..., Any], resolved: RematPolicy, where: str
) -> Callable[..., Any]:
    return to_flax(resolved.checked(fn, where))


#: ``flax.nnx`` has no ``checkpoint`` alias; ``remat_nn.nnx.checkpoint`` is ``remat``, as in
#: ``remat_nn.nn``.
checkpoint = remat
