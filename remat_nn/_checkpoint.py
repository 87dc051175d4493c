"""``rn.checkpoint``: ``jax.checkpoint`` with policies by name, aliases and validated plans.

A drop-in for ``jax.checkpoint``: the same parameters, in the same order, with the same meaning
(a test compares the signatures, so a keyword a new JAX adds shows up as a failure). What is
added is policy resolution (:func:`remat_nn.policy`), plan validation against the traced body at
first use, argument checks at wrap time, and static arguments that work however they are passed
(as in ``jax.jit``). Pure JAX: this module, like the rest of the core, imports no flax.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from remat_nn._jax_internals import DeprecatedArg
from remat_nn._plan import Plan, as_plan, checked_body
from remat_nn._policies import NO_REMAT, for_remat3, is_custom, watched_body
from remat_nn._policies import policy as resolve_policy
from remat_nn.errors import closest, did_you_mean

__all__ = ["checkpoint"]


# --- argument checks, at wrap time (not deep in tracing); nn.remat shares them ------------------


def check_policy(policy: Any, where: str) -> None:
    """Raises TypeError unless ``policy`` is None, a name, a plan or a callable."""
    if policy is None or isinstance(policy, str | Plan | Mapping) or callable(policy):
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


def check_bool(value: Any, arg: str, where: str) -> None:
    """Raises TypeError unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{where}: argument `{arg}` must be True or False, got {type(value).__name__} "
            f"{value!r}. Fix: {where}(..., {arg}=True) (or False)."
        )


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """A remat front-end's ``policy`` argument, read once (``rn.checkpoint``, ``nn.remat`` and
    ``rnnx.remat`` share it): what to hand ``jax.checkpoint`` (or flax's remat), and what the
    body is checked against at first trace."""

    policy: Any  # for jax.checkpoint(..., policy=...)
    plan: Plan | None  # the plan the spec denotes (a JAX name policy's too), else None
    where: str  # the front end, for messages
    custom: bool  # a callable of the user's own: watched for saving nothing

    @property
    def checks(self) -> bool:
        """Whether :meth:`checked` wraps the body."""
        return self.custom or (self.plan is not None and bool(self.plan.names))

    def checked(self, fn: Callable[..., Any], body: str) -> Callable[..., Any]:
        """``fn``, raising a PlanError at first trace when a plan name never occurs in it, or
        warning then when a policy of the user's own saves nothing in it."""
        if self.plan is not None and self.plan.names:
            return checked_body(fn, self.plan, body)
        if self.custom:
            return watched_body(fn, self.policy, self.where, body)
        return fn


def resolve_remat(policy: Any, where: str) -> RematPolicy:
    """Resolves ``policy`` (checked by :func:`check_policy`, not ``"none"``) for ``where``.

    Raises:
      PolicyError / PlanError: an unknown policy name, a malformed plan, or a policy the
        ``jax_remat3`` flag cannot honour (see :func:`remat_nn._policies.for_remat3`).
    """
    the_plan = as_plan(policy)
    resolved = for_remat3(policy, resolve_policy(policy), where)
    return RematPolicy(resolved, the_plan, where, the_plan is None and is_custom(policy))


def _check_prevent_cse(value: Any, where: str) -> bool | tuple[Any, ...]:
    # jax.checkpoint takes a bool, or a sequence it turns into a tuple and broadcasts as a pytree
    # prefix over the dynamic arguments at call time. A string is a sequence to JAX ('yes' would
    # become ('y', 'e', 's')): rejected here, as is any leaf that is not a bool.
    if isinstance(value, bool):
        return value
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        leaves = jax.tree.leaves(tuple(value), is_leaf=lambda x: x is None)
        if all(isinstance(x, bool) for x in leaves):
            return tuple(value)
    raise TypeError(
        f"{where}: argument `prevent_cse` must be True or False, or a sequence of them per "
        f"dynamic argument (a pytree prefix of the arguments, as in jax.checkpoint), got "
        f"{type(value).__name__} {value!r}. Fix: {where}(..., prevent_cse=True) (or False, or "
        "e.g. (True, False) for two arguments)."
    )


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # no signature to check against (some builtins); JAX checks at call time


def _positional_names(params: list[inspect.Parameter]) -> list[str]:
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def check_static_argnums(
    static_argnums: Any, where: str, fns: Mapping[str, Callable[..., Any]], *, module: bool
) -> tuple[int, ...]:
    """Checks ``static_argnums`` is an int or a sequence of ints in range of every ``fns``
    signature, and returns it as a tuple.

    ``module``: counted with ``self`` as 0 as in flax, where negative indices are not supported.
    """
    seq = isinstance(static_argnums, Sequence) and not isinstance(static_argnums, str | bytes)
    given = tuple(static_argnums) if seq else (static_argnums,)
    nums = tuple(i for i in given if isinstance(i, int) and not isinstance(i, bool))
    if len(nums) != len(given):
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
        params = _parameters(fn)
        if params is None or any(p.kind is p.VAR_POSITIONAL for p in params):
            continue
        positional = _positional_names(params)
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
    return nums


def _check_static_argnames(static_argnames: Any, fun: Callable[..., Any]) -> tuple[str, ...]:
    names = (static_argnames,) if isinstance(static_argnames, str) else static_argnames
    if isinstance(names, Iterable) and not isinstance(names, bytes | Mapping):
        names = tuple(names)
        if all(isinstance(n, str) for n in names):
            params = _parameters(fun)
            if params is None or any(p.kind is p.VAR_KEYWORD for p in params):
                return names
            known = [p.name for p in params if p.kind is not p.VAR_POSITIONAL]
            unknown = [n for n in names if n not in known]
            if unknown:
                hint = did_you_mean(unknown[0], known)
                fix = closest(unknown[0], known) or (known or ["train"])[0]
                raise ValueError(
                    f"rn.checkpoint: argument `static_argnames` names {unknown}, which are not "
                    f"parameters of {getattr(fun, '__name__', repr(fun))} (it takes {known}).{hint}"
                    f" Fix: rn.checkpoint(..., static_argnames=({fix!r},))."
                )
            return names
    raise TypeError(
        "rn.checkpoint: argument `static_argnames` must be a parameter name or a tuple of names "
        f"(strings), got {type(static_argnames).__name__} {static_argnames!r}. "
        "Fix: rn.checkpoint(..., static_argnames=('train',))."
    )


# --- static arguments, by position or by name -----------------------------------------------------


def _with_static_args(
    fun: Callable[..., Any],
    body: Callable[..., Any],
    remat: Callable[..., Callable[..., Any]],
    nums: tuple[int, ...],
    names: tuple[str, ...],
) -> Callable[..., Any]:
    """``remat(body)`` where the arguments ``nums`` / ``names`` denote are static, by position
    or by keyword alike (as in ``jax.jit``: a static name makes its position static and vice
    versa).

    jax.checkpoint 0.10.2 takes ``static_argnames`` but applies it only under the ``jax_remat3``
    flag, and ``static_argnums`` only to arguments passed by position (jax#18405). So each call
    hands JAX the static values by position: keyword ones appended after the positional
    arguments, with ``static_argnums`` covering them; the body puts them back by name. One
    ``remat(...)`` per call pattern (arity, which keywords), kept by this wrapper only.
    """
    params = _parameters(fun) or []
    positional = _positional_names(params)
    positions = frozenset(nums) | {positional.index(n) for n in names if n in positional}
    keyword = {i: p.name for i, p in enumerate(params) if p.kind is p.POSITIONAL_OR_KEYWORD}
    by_name = frozenset(names) | {keyword[i] for i in nums if i in keyword}
    rematted: dict[tuple[int, tuple[int, ...], tuple[str, ...]], Callable[..., Any]] = {}

    def make(n: int, pos: tuple[int, ...], kw: tuple[str, ...]) -> Callable[..., Any]:
        if not kw:
            return remat(body, static_argnums=pos)

        @functools.wraps(body)  # JAX's messages name fun and its source line
        def rebound(*args: Any, **kwargs: Any) -> Any:
            return body(*args[:n], **dict(zip(kw, args[n:], strict=True)), **kwargs)

        return remat(rebound, static_argnums=pos + tuple(range(n, n + len(kw))))

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        n = len(args)
        pos = []
        for i in positions:
            if -n <= i < n:
                pos.append(i % n)
            elif not 0 <= i < len(positional):  # not a named parameter passed by keyword / default
                raise ValueError(
                    f"rn.checkpoint: argument `static_argnums` {nums!r} is out of range for this "
                    f"call of {getattr(fun, '__name__', repr(fun))} with {n} positional arguments "
                    f"(indices 0..{n - 1} or {-n}..-1). Fix: pass the static argument "
                    "positionally, or give its index in this call."
                )
        kw = tuple(sorted(k for k in kwargs if k in by_name))
        key = (n, tuple(sorted(set(pos))), kw)
        if key not in rematted:
            rematted[key] = make(*key)
        dynamic = {k: v for k, v in kwargs.items() if k not in kw}
        return rematted[key](*args, *(kwargs[k] for k in kw), **dynamic)

    return call


# --- the transform --------------------------------------------------------------------------------


def checkpoint(
    fun: Callable[..., Any],
    *,
    prevent_cse: bool | Sequence[bool] = True,
    policy: Any = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Iterable[str] = (),
    concrete: Any = DeprecatedArg(),  # noqa: B008 (JAX's own sentinel, as in its signature)
) -> Callable[..., Any]:
    """``jax.checkpoint`` with remat_nn's policy resolution and plan validation.

    Every parameter of ``jax.checkpoint`` (JAX 0.10), in its order and with its meaning;
    ``policy`` also accepts a name, an alias or a plan. Use it as ``jax.checkpoint`` is used:
    ``rn.checkpoint(f, ...)``, ``@rn.checkpoint``, ``@functools.partial(rn.checkpoint, ...)``
    (like ``jax.checkpoint``, ``@rn.checkpoint(policy=...)`` without ``fun`` is an error).

    Args:
      fun: the function to rematerialize.
      prevent_cse: True (default) or False, or one bool per dynamic argument (a pytree prefix of
        the non-static arguments, as in ``jax.checkpoint``); False suits a body inside
        ``lax.scan``. Ignored by JAX under its ``jax_remat3`` flag.
      policy: what to save: a policy name or alias, a plan, or a callable (see
        :func:`remat_nn.policy` and :func:`remat_nn.plan`); None recomputes everything (JAX's
        default); ``"none"`` is no remat: ``fun`` is returned unchanged.
      static_argnums: positions of arguments to specialize on (Python values such as
        ``train=True``; hashable ones are cached by value), negative counted from the end.
      static_argnames: names of such arguments. Unlike ``jax.checkpoint`` 0.10, which applies
        ``static_argnames`` only under ``jax_remat3`` and ``static_argnums`` only to arguments
        passed by position, a static argument here is static however it is passed.
      concrete: removed from JAX (0.10); passing it raises JAX's NotImplementedError.

    Returns:
      The rematerialized function.

    Raises:
      TypeError: ``fun`` is not callable, or an argument has the wrong type.
      ValueError: a static argument index or name ``fun`` does not have.
      PolicyError / PlanError: an unknown policy name, a malformed plan; a plan name that never
        occurs in ``fun`` (when first traced).

    >>> import functools, jax, jax.numpy as jnp, remat_nn as rn
    >>> f = rn.checkpoint(lambda x: jnp.sin(rn.name(x * 2, "h")).sum(), policy="save=h")
    >>> jax.grad(f)(jnp.zeros(2))
    Array([2., 2.], dtype=float32)
    >>> @functools.partial(rn.checkpoint, policy="dots", static_argnames="train")
    ... def layer(w, x, train=False):
    ...     return jnp.tanh(x @ w) * (0.5 if train else 1.0)
    >>> jax.grad(lambda w: layer(w, jnp.ones(2), train=True).sum())(jnp.zeros((2, 2)))
    Array([[0.5, 0.5],
           [0.5, 0.5]], dtype=float32)
    """
    if not isinstance(concrete, DeprecatedArg):
        return jax.checkpoint(fun, concrete=concrete)  # JAX's own NotImplementedError
    if not callable(fun):
        raise TypeError(
            f"rn.checkpoint: argument `fun` must be a callable, got {type(fun).__name__} "
            f"{fun!r}. Fix: rn.checkpoint(my_function, policy=...)."
        )
    where = "rn.checkpoint"
    check_policy(policy, where)
    prevent_cse = _check_prevent_cse(prevent_cse, where)
    fun_name = getattr(fun, "__name__", repr(fun))
    nums = check_static_argnums(static_argnums, where, {fun_name: fun}, module=False)
    names = _check_static_argnames(static_argnames, fun)
    if policy == NO_REMAT:
        return fun
    resolved = resolve_remat(policy, where)
    body = resolved.checked(fun, fun_name)
    remat = functools.partial(jax.checkpoint, policy=resolved.policy, prevent_cse=prevent_cse)
    if nums or names:
        return _with_static_args(fun, body, remat, nums, names)
    rematted = remat(body)
    # jax_remat3 returns a bare partial: keep fun's name and signature (reports name arguments).
    return functools.wraps(fun)(rematted) if isinstance(rematted, functools.partial) else rematted
