"""``nn.remat``: ``flax.linen.remat`` with policies by name, aliases and validated plans.

Every argument flax accepts behaves exactly as in flax (the call is forwarded to it); what is
added is policy resolution (:func:`remat_nn.policy`), plan validation against the traced body at
first use, and plain functions (then it is ``jax.checkpoint`` with the same resolution).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import flax.linen as fnn
import jax
from flax import errors as flax_errors
from flax.linen.transforms import checkpoint as flax_remat  # the original, even if patched

from remat_nn._plan import Plan, as_plan, checked_body
from remat_nn._policies import for_remat3
from remat_nn._policies import policy as resolve_policy

__all__ = ["checkpoint", "remat"]

Target = TypeVar("Target")


# --- argument checks, at wrap time (not deep in tracing) -----------------------------------------


def _check_policy(policy: Any, where: str) -> None:
    if policy is None or isinstance(policy, str | Plan | Mapping):
        return
    if callable(policy):
        return
    hint = ""
    if isinstance(policy, list | tuple):
        hint = (
            " A list is not a plan: write a mapping such as {'save': [...], 'offload': [...]}, "
            "or rn.plan(save=[...])."
        )
    raise TypeError(
        f"{where}: argument `policy` must be a policy name (e.g. 'dots_saveable'), a plan "
        f"(rn.plan(...), a mapping or a string such as 'save=query_proj;offload=mlp_hidden') or "
        f"a callable policy, got {type(policy).__name__} {policy!r}.{hint} "
        f"Fix: {where}(..., policy='dots_saveable')."
    )


def _check_bool(value: Any, arg: str, where: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"{where}: argument `{arg}` must be True or False, got {type(value).__name__} "
            f"{value!r}. Fix: {where}(..., {arg}=True) (or False)."
        )


def _check_static_argnums(
    static_argnums: Any, where: str, fns: Mapping[str, Callable[..., Any]], *, module: bool
) -> None:
    """Checks ``static_argnums`` is an int or a tuple of ints in range of every ``fns`` signature.

    ``module``: counted with ``self`` as 0 as in flax, where negative indices are not supported.
    """
    nums = static_argnums if isinstance(static_argnums, tuple | list) else (static_argnums,)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise TypeError(
            f"{where}: argument `static_argnums` must be an int or a tuple of ints (positions of "
            f"positional arguments), got {type(static_argnums).__name__} {static_argnums!r}. "
            f"Fix: {where}(..., static_argnums=(1,))."
        )
    if module and any(i < 1 for i in nums):
        raise ValueError(
            f"{where}: argument `static_argnums` {static_argnums!r} for a Module counts "
            "positional arguments with `self` as 0, so each must be >= 1 (negative indices are "
            "not supported for Modules). Fix: for `__call__(self, x, train)` use "
            "static_argnums=(2,) to make `train` static."
        )
    for name, fn in fns.items():
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            continue  # no signature to check against; JAX checks at call time
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            continue
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
        n = len(positional)
        bad = [i for i in nums if not -n <= i < n]
        if bad:
            raise ValueError(
                f"{where}: argument `static_argnums` {static_argnums!r} is out of range for "
                f"{name}, whose positional arguments are {positional} (indices 0..{n - 1}"
                f"{'' if module else f' or {-n}..-1'}). Fix: give the index of the argument to "
                "treat as static, e.g. static_argnums="
                f"({max(n - 1, 0)},) for {positional[-1] if positional else 'it'!r}."
            )


def _checked_module_class(target: type[fnn.Module], the_plan: Plan, methods: Any) -> type:
    # A same-named subclass whose lifted methods check the plan inside the remat body; the
    # parameter tree is unchanged (the class name, and so auto-names, stay the same).
    names = ["__call__"] if methods is None else list(methods)
    attrs: dict[str, Any] = {"__module__": target.__module__, "__qualname__": target.__qualname__}
    for m in names:
        attrs[m] = checked_body(getattr(target, m), the_plan, f"{target.__name__}.{m}")
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

    A strict superset of ``flax.linen.remat``: the same arguments with the same meaning, and
    ``policy`` also accepts a policy name or alias (``"dots"``, ``"full"``, ...), a
    :class:`remat_nn.Plan`, a plan mapping or a plan string. A plan is checked against the body
    when it is first traced: a plan name that never occurs there raises
    :class:`remat_nn.PlanError` naming the names that do. Dropout inside the body recomputes its
    mask from the same key; random bits are never saved unless the policy saves everything.

    Args:
      target: a ``flax.linen.Module`` subclass, a method of one (used as a decorator), or a
        plain function (then this is ``jax.checkpoint`` with policy resolution).
      variables: variable collections lifted (flax).
      rngs: PRNG sequences lifted (flax).
      concrete: value-dependent Python control flow allowed (flax; Modules only).
      prevent_cse: prevent common-subexpression elimination of the recomputation.
      static_argnums: arguments to specialize on (as in flax: for a Module, counted with
        ``self`` as 0, so ``__call__(self, x, train)`` makes ``train`` static with ``(2,)``).
        Checked against the signature here: a non-int or out-of-range index raises at once.
      policy: what to save; see :func:`remat_nn.policy` and :func:`remat_nn.plan`.
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
    _check_policy(policy, "nn.remat")
    _check_bool(prevent_cse, "prevent_cse", "nn.remat")
    _check_bool(concrete, "concrete", "nn.remat")
    resolved = for_remat3(policy, resolve_policy(policy), "nn.remat")
    # Forwarded to flax unchanged: flax's own semantics for every argument it accepts.
    flax_kwargs = dict(variables=variables, rngs=rngs, concrete=concrete, prevent_cse=prevent_cse,
                       static_argnums=static_argnums, policy=resolved, methods=methods)  # fmt: skip
    the_plan = as_plan(policy)
    if isinstance(target, type) and issubclass(target, fnn.Module):
        lifted = ["__call__"] if methods is None else list(methods)
        _check_static_argnums(
            static_argnums,
            "nn.remat",
            {f"{target.__name__}.{m}": getattr(target, m) for m in lifted if hasattr(target, m)},
            module=True,
        )
        if the_plan is not None and the_plan.names:
            target = _checked_module_class(target, the_plan, methods)
        return flax_remat(target, **flax_kwargs)
    if not callable(target) or isinstance(target, fnn.Module):
        # flax's own error (a Module instance is the usual mistake: pass the class instead).
        raise flax_errors.TransformTargetError(target)
    fn = target
    _check_static_argnums(
        static_argnums, "nn.remat", {getattr(fn, "__name__", repr(fn)): fn}, module=False
    )
    if the_plan is not None and the_plan.names:
        fn = checked_body(fn, the_plan, getattr(target, "__name__", repr(target)))
    as_method = flax_remat(fn, **flax_kwargs)
    as_function = checkpoint(
        fn, policy=resolved, prevent_cse=prevent_cse, static_argnums=static_argnums
    )

    @functools.wraps(as_method)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        # Used as a method decorator the first argument is the Module; else a plain function.
        if args and isinstance(args[0], fnn.Module):
            return as_method(*args, **kwargs)
        return as_function(*args, **kwargs)

    return dispatch  # type: ignore[return-value]


def checkpoint(
    fn: Callable[..., Any],
    *,
    policy: Any = None,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
) -> Callable[..., Any]:
    """``jax.checkpoint`` with remat_nn's policy resolution and plan validation.

    Args:
      fn: the function to rematerialize.
      policy: a policy name, alias, plan or callable (see :func:`remat_nn.policy`).
      prevent_cse: as in ``jax.checkpoint``.
      static_argnums: as in ``jax.checkpoint``.

    Returns:
      The rematerialized function.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> f = rn.checkpoint(lambda x: jnp.sin(rn.name(x * 2, "h")).sum(), policy="save=h")
    >>> jax.grad(f)(jnp.zeros(2))
    Array([2., 2.], dtype=float32)
    """
    if not callable(fn):
        raise TypeError(
            f"rn.checkpoint: argument `fn` must be a callable, got {type(fn).__name__} {fn!r}. "
            "Fix: rn.checkpoint(my_function, policy=...)."
        )
    _check_policy(policy, "rn.checkpoint")
    _check_bool(prevent_cse, "prevent_cse", "rn.checkpoint")
    _check_static_argnums(
        static_argnums, "rn.checkpoint", {getattr(fn, "__name__", repr(fn)): fn}, module=False
    )
    the_plan = as_plan(policy)
    if the_plan is not None and the_plan.names:
        fn = checked_body(fn, the_plan, getattr(fn, "__name__", repr(fn)))
    resolved = for_remat3(policy, resolve_policy(policy), "rn.checkpoint")
    rematted = jax.checkpoint(
        fn, policy=resolved, prevent_cse=prevent_cse, static_argnums=static_argnums
    )
    # jax_remat3 returns a bare partial: keep fn's name and signature (reports name arguments).
    return functools.wraps(fn)(rematted) if isinstance(rematted, functools.partial) else rematted
