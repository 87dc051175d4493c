"""``nn.remat``: ``flax.linen.remat`` with policies by name, aliases and validated plans.

Every argument flax accepts behaves exactly as in flax (the call is forwarded to it); what is
added is policy resolution (:func:`remat_nn.policy`), plan validation against the traced body at
first use, and plain functions (then it is :func:`remat_nn.checkpoint`). ``nn.checkpoint`` is
``nn.remat``, as ``flax.linen.checkpoint`` is ``flax.linen.remat``.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any, TypeVar

import flax.linen as fnn
from flax import errors as flax_errors
from flax.linen.transforms import checkpoint as flax_remat  # the original, even if patched

from remat_nn._checkpoint import (
    RematPolicy,
    check_bool,
    check_policy,
    check_static_argnums,
    resolve_remat,
)
from remat_nn._checkpoint import checkpoint as rn_checkpoint
from remat_nn._policies import NO_REMAT

__all__ = ["checkpoint", "remat"]

Target = TypeVar("Target")


def _checked_module_class(
    target: type[fnn.Module], resolved: RematPolicy, methods: Any
) -> type[fnn.Module]:
    # A same-named subclass whose lifted methods check the plan inside the remat body; the
    # parameter tree is unchanged (the class name, and so auto-names, stay the same).
    names = ["__call__"] if methods is None else list(methods)
    attrs: dict[str, Any] = {"__module__": target.__module__, "__qualname__": target.__qualname__}
    for m in names:
        attrs[m] = resolved.checked(getattr(target, m), f"{target.__name__}.{m}")
    return type(target.__name__, (target,), attrs)


def remat(
    target: Target,
    variables: bool | str | Collection[str] = True,
    rngs: bool | str | Collection[str] = True,
    concrete: bool = False,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
    policy: Any = None,
    methods: Any = None,
) -> Target:
    """Rematerializes a flax Module, a Module method, or a plain function.

    A superset of ``flax.linen.remat``: the same arguments with the same meaning, and
    ``policy`` also accepts a policy name or alias (``"dots"``, ``"full"``, ...), a
    :class:`remat_nn.Plan`, a plan mapping or a plan string; ``policy="none"`` returns
    ``target`` unchanged (no remat). One difference: a wrapped Module class keeps its own name
    (flax's is ``"Checkpoint" + name``), so its auto-named parameters (``MLP_0``) are the same
    with remat or without, and a checkpoint moves between the two. A plan is checked against the
    body when it is first traced: a plan name that never occurs there raises
    :class:`remat_nn.PlanError` naming the names that do. Dropout inside the body recomputes its
    mask from the same key; random bits are never saved unless the policy saves everything.

    Args:
      target: a ``flax.linen.Module`` subclass, a method of one (used as a decorator), or a
        plain function (then this is :func:`remat_nn.checkpoint`).
      variables: variable collections lifted (flax).
      rngs: PRNG sequences lifted (flax).
      concrete: value-dependent Python control flow allowed (flax; Modules only).
      prevent_cse: prevent common-subexpression elimination of the recomputation.
      static_argnums: arguments to specialize on (as in flax: for a Module, counted with
        ``self`` as 0, so ``__call__(self, x, train)`` makes ``train`` static with ``(2,)``).
        Checked against the signature here: a non-int or out-of-range index raises at once.
      policy: what to save; see :func:`remat_nn.policy` and :func:`remat_nn.plan`;
        ``"none"``: no remat, ``target`` returned unchanged.
      methods: Module methods to lift (flax; default ``__call__``).

    Returns:
      The rematerialized Module class, method or function.

    >>> import jax, jax.numpy as jnp, flax.linen as fnn
    >>> from remat_nn import nn
    >>> class MLP(fnn.Module):
    ...   @fnn.compact
    ...   def __call__(self, x):
    ...     return fnn.Dense(4)(jax.nn.relu(fnn.Dense(8)(x)))
    >>> Block = nn.remat(MLP, policy="dots_with_no_batch_dims_saveable")
    >>> variables = Block().init(jax.random.key(0), jnp.ones((2, 4)))
    >>> jax.tree.map(jnp.shape, variables["params"]["Dense_0"])
    {'bias': (4,), 'kernel': (8, 4)}
    """
    check_policy(policy, "nn.remat")
    check_bool(prevent_cse, "prevent_cse", "nn.remat")
    check_bool(concrete, "concrete", "nn.remat")
    if policy == NO_REMAT:
        return target
    resolved = resolve_remat(policy, "nn.remat")
    # Forwarded to flax unchanged: flax's own semantics for every argument it accepts.
    to_flax = functools.partial(
        flax_remat,
        variables=variables,
        rngs=rngs,
        concrete=concrete,
        prevent_cse=prevent_cse,
        static_argnums=static_argnums,
        policy=resolved.policy,
        methods=methods,
    )
    if isinstance(target, type) and issubclass(target, fnn.Module):
        lifted = ["__call__"] if methods is None else list(methods)
        check_static_argnums(
            static_argnums,
            "nn.remat",
            {f"{target.__name__}.{m}": getattr(target, m) for m in lifted if hasattr(target, m)},
            module=True,
        )
        module_cls: type[fnn.Module] = target
        if resolved.checks:
            module_cls = _checked_module_class(target, resolved, methods)
        lifted_cls = to_flax(module_cls)
        # flax names its subclass "Checkpoint" + name, and a module's auto-name (its parameters'
        # key in the parent) comes from its class name: keep the target's, so that wrapping a
        # class or not never changes the parameter tree.
        lifted_cls.__name__, lifted_cls.__qualname__ = target.__name__, target.__qualname__
        # flax returns a subclass of the class it is given, built at run time: the type system
        # cannot say it is a Target (flax's own signature claims as much).
        return lifted_cls  # pyright: ignore[reportReturnType]
    if not callable(target) or isinstance(target, fnn.Module):
        # flax's own error (a Module instance is the usual mistake: pass the class instead).
        raise flax_errors.TransformTargetError(target)
    fn = target
    check_static_argnums(
        static_argnums, "nn.remat", {getattr(fn, "__name__", repr(fn)): fn}, module=False
    )
    as_method = to_flax(resolved.checked(fn, getattr(target, "__name__", repr(target))))
    # rn.checkpoint reads and checks the policy itself (a body checked twice would warn twice).
    as_function = rn_checkpoint(
        fn, policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums
    )

    @functools.wraps(as_method)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        # Used as a method decorator the first argument is the Module; else a plain function.
        if args and isinstance(args[0], fnn.Module):
            return as_method(*args, **kwargs)
        return as_function(*args, **kwargs)

    return dispatch  # pyright: ignore[reportReturnType]  (a function that acts as Target)


#: ``flax.linen.checkpoint`` is ``flax.linen.remat``; so in remat_nn.nn. (The pure-JAX
#: ``jax.checkpoint`` counterpart is :func:`remat_nn.checkpoint`.)
checkpoint = remat
