"""Evaluation: reading, evaluating and differentiating single jaxpr equations."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from remat_nn._jax_internals import (
    core,
    custom_vjp_bwd,
    hi_kind,
    pe,
    scan_p,
    source_info_util,
)

# Equations traced from this package (a custom_ivjp call, a rule) are attributed to the user's line.
source_info_util.register_exclusion(os.path.dirname(__file__) + os.sep)


def is_var(a: Any) -> TypeGuard[core.Var]:
    """A real variable (not a literal, not a dropped output)."""
    # An exact type test: DropVar is Var's only subclass, and the analysis asks this of every
    # operand of every equation several times.
    return type(a) is core.Var


@functools.cache
def _inexact(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def is_float(aval: Any) -> bool:
    """Whether values of ``aval`` carry cotangents (typed PRNG keys and ints do not)."""
    return _inexact(aval.dtype)


def where(eqn: core.JaxprEqn) -> str:
    """The user's source line of ``eqn``: ``file.py:12 (fn)``."""
    return source_info_util.summarize(eqn.source_info)


def display(eqn: core.JaxprEqn) -> str:
    """The primitive's name, with the function or activation name: ``jit[_flip]``."""
    name = eqn.primitive.name
    kind = hi_kind(eqn)
    owner = getattr(custom_vjp_bwd(eqn), "owner", None)
    if owner is not None:  # a custom_ivjp call
        return f"custom_ivjp[{getattr(owner.fun, '__name__', '?')}]"
    if kind is not None:
        return {"remat": "checkpoint", "name": "name", "custom_vjp": "custom_vjp_call"}[kind]
    if isinstance(eqn.params.get("name"), str):
        return f"{name}[{eqn.params['name']}]"
    call = eqn.params.get("call_jaxpr")
    if isinstance(call, core.ClosedJaxpr) and call.jaxpr.debug_info is not None:
        return f"{name}[{call.jaxpr.debug_info.func_name}]"
    return name


def nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize  # typed keys too


def aval_str(aval: Any) -> str:
    return aval.str_short(short_dtypes=True)


def read(env: dict, a: Any) -> Any:
    return a.val if isinstance(a, core.Literal) else env[a]


def eval_eqn(eqn: core.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Binds one equation, with its source location and context, as ``core.eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def eval_jaxpr(
    jaxpr: core.Jaxpr,
    args: Sequence[Any],
    keep: Sequence[core.Var] = (),
    run: Mapping[int, Callable[[list], list]] | None = None,
    tap: Callable[[int, Any], Any] | None = None,
):
    """Evaluates ``jaxpr`` (no constvars); returns its outputs and the values of ``keep``.
    ``run``: equation index -> a function evaluating that equation in its place. ``tap(k, x)``:
    called with each value of ``keep`` (its position, the value) as soon as it is made; what it
    returns stands for the value from there on."""
    position = {v: k for k, v in enumerate(keep)}

    def made(v: core.Var, x: Any) -> Any:
        return tap(position[v], x) if tap is not None and v in position else x

    env = {v: made(v, x) for v, x in zip(jaxpr.invars, args, strict=True)}
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [read(env, a) for a in eqn.invars]
        outs = run[i](ins) if run and i in run else eval_eqn(eqn, ins)
        env.update((v, made(v, o)) for v, o in zip(eqn.outvars, outs, strict=True) if is_var(v))
    return [read(env, a) for a in jaxpr.outvars], [env[v] for v in keep]


def dce(jaxpr: core.Jaxpr, used_outputs: Sequence[bool]) -> core.Jaxpr:
    """Drops equations whose outputs are never used (keeping the rest as they are).

    Unlike ``pe.dce_jaxpr`` this leaves ``custom_vjp_call`` equations untouched (so a
    ``custom_ivjp`` stays recognisable); a ``scan`` with unused outputs is pruned by JAX's own
    rule, so its inverse never needs a value nobody computed.
    """
    live = {v for v, u in zip(jaxpr.outvars, used_outputs, strict=True) if u and is_var(v)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        used = [is_var(v) and v in live for v in eqn.outvars]
        if not any(used) and not eqn.effects:
            continue
        if eqn.primitive is scan_p and not all(used) and not eqn.effects:
            _, pruned = pe.dce_rules[scan_p](used, eqn)
            assert pruned is not None  # some output is used, so the rule keeps the equation
            eqn = pruned
        live.update(a for a in eqn.invars if is_var(a))
        kept.append(eqn)
    return jaxpr.replace(eqns=kept[::-1])


def open_jaxpr(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> tuple[core.Jaxpr, list[Any]]:
    """A jaxpr with its constvars turned into leading invars, and the const values."""
    if isinstance(jaxpr, core.ClosedJaxpr):
        return pe.convert_constvars_jaxpr(jaxpr.jaxpr), list(jaxpr.consts)
    return jaxpr, []


def zeros_ct(aval: Any) -> Any:
    """A zero cotangent for ``aval``: zeros for floats, float0 for ints and keys."""
    if is_float(aval):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def eqn_vjp(
    eqn: core.JaxprEqn,
    ins: Sequence[Any],
    couts: Sequence[Any],
    cache: dict | None = None,
    active: Sequence[int] | None = None,
) -> list[Any]:
    """Cotangents of ``eqn``'s float operands given its output cotangents (None = zero).

    ``active``: the operand positions to differentiate (default: every float variable); the
    others (a closed-over constant, ``stop_gradient(x)``) are held constant, so a ``while_loop``
    over them runs without reverse-mode differentiation.

    ``cache`` maps an equation's full signature to its traced VJP, so the 64 identical layers
    of a stack are linearized once. The key holds everything the traced VJP depends on: the
    primitive, its params, every operand's type, which operands are differentiated variables
    (a literal operand is a constant: ``1.0 - a`` and ``a - 0.25`` differ) and which output
    cotangents are zero.
    """
    diff = tuple(
        p
        for p, a in enumerate(eqn.invars)
        if is_var(a) and is_float(a.aval) and (active is None or p in active)
    )
    in_cts: list[Any] = [None] * len(ins)
    if not diff:
        return in_cts
    out_avals = [v.aval for v in eqn.outvars]
    zero = tuple(c is None for c in couts)

    def vjp(ins, cts):
        def f(*xs):
            args = list(ins)
            for p, x in zip(diff, xs, strict=True):
                args[p] = x
            return eval_eqn(eqn, args)

        _, pullback = jax.vjp(f, *[ins[p] for p in diff])
        it = iter(cts)
        full = [zeros_ct(a) if z else next(it) for a, z in zip(out_avals, zero, strict=True)]
        return list(pullback(full))

    cts = [c for c in couts if c is not None]
    key = None
    if cache is not None and not eqn.effects:
        try:
            key = (
                eqn.primitive,
                tuple(sorted(eqn.params.items())),
                diff,
                zero,
                tuple(map(core.typeof, ins)),
            )
            hash(key)
        except TypeError:  # unhashable params: trace this one directly
            key = None
    if cache is None or key is None:
        res = vjp(ins, cts)
    else:
        if key not in cache:
            cache[key] = jax.make_jaxpr(vjp)(list(ins), cts)
        closed = cache[key]
        res = core.eval_jaxpr(closed.jaxpr, closed.consts, *ins, *cts)
    for p, c in zip(diff, res, strict=True):
        in_cts[p] = c
    return in_cts
