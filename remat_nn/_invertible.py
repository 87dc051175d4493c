"""``rn.invertible``: a memory-free VJP that reconstructs inputs from outputs, at the jaxpr level.

The forward pass of ``rn.invertible(f)`` keeps only ``f``'s outputs, plus the inputs the reverse
walk needs and cannot reconstruct (weights, constants: they are alive anyway). The backward pass
walks ``f``'s jaxpr from the last equation to the first. At each equation it

1. evaluates forward, from values already known, the operands that do not need inverting
   (``F(x2)`` inside ``y1 = x1 + F(x2)``, once ``x2`` is known),
2. reconstructs the remaining operand(s) from the equation's outputs with an inverse rule
   (``x1 = y1 - F(x2)``), and
3. takes that equation's VJP with the reconstructed values,

so reconstruction and gradient advance in lock-step and only one equation's working set is live.

Which values are known is decided once, at trace time, by a dataflow analysis (``_Analysis``):
a value is known in the reverse walk if it is an output, an input the walk stores (only inputs
whose every use is as a known operand of an inverted equation, e.g. the weights of ``F``), a
value already reconstructed, or computable forward from known values. An equation whose unknown
operand cannot be reconstructed raises ``NotInvertibleError`` naming it and its source line, or,
with ``fallback="recompute"``, has that operand stored in the forward pass (like a remat
checkpoint) and everything computable from it recomputed.

Call-like equations recurse: ``jit`` / ``closed_call`` / ``checkpoint`` and ``scan`` bodies are
walked the same way (a scan's backward is a reverse scan of its body's walk, so memory stays flat
in its length); ``custom_jvp_call`` / ``custom_vjp_call`` bodies are inverted, then differentiated
with their own rules; a ``custom_ivjp`` function uses its rule for both.

References:
  Gomez et al. 2017, "The Reversible Residual Network: Backpropagation Without Storing
  Activations" (arXiv:1707.04585). JAX's removed ``jax.invertible`` / ``jax.custom_ivjp``
  (``jax/interpreters/invertible_ad.py``), and jax#8686 (it could not be jitted).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core, source_info_util
from jax._src.ad_checkpoint import remat_p
from jax._src.custom_derivatives import custom_jvp_call_p, custom_vjp_call_p
from jax._src.interpreters import partial_eval as pe
from jax._src.lax.control_flow.loops import scan_p
from jax._src.pjit import jit_p

from remat_nn import _inverse_rules
from remat_nn.errors import NotInvertibleError

__all__ = [
    "InversionEntry",
    "InversionReport",
    "Invertible",
    "custom_ivjp",
    "inversion_report",
    "invertible",
]

_FALLBACKS = ("error", "recompute")

# Equations traced from this file (a custom_ivjp call) are attributed to the user's line.
source_info_util.register_exclusion(__file__)

_NOT_INVERTIBLE = """\
rn.invertible: cannot reconstruct the input of `{prim}` at {where} from its output: {reason}.
Fix: give this computation an explicit inverse with `g = rn.custom_ivjp(fn); g.defivjp(ivjp)`
(ivjp(xs, ys, dys) -> (xs, dxs)), register one with `rn.register_inverse(primitive, rule)`, or
use `rn.invertible(f, fallback="recompute")`, which stores the operand it cannot reconstruct
(as a remat checkpoint would) and recomputes what depends on it; or jax.checkpoint this part."""


# --- jaxpr helpers ------------------------------------------------------------------------------


def _is_var(a: Any) -> bool:
    return isinstance(a, core.Var) and not isinstance(a, core.DropVar)


def _is_float(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _where(eqn: core.JaxprEqn) -> str:
    return source_info_util.summarize(eqn.source_info)


def _display(eqn: core.JaxprEqn) -> str:
    """The primitive's name, with the function name for calls: ``jit[_flip]``."""
    name = eqn.primitive.name
    if _is_custom_ivjp(eqn):
        fun = eqn.params["bwd"].f.owner.fun
        return f"custom_ivjp[{getattr(fun, '__name__', '?')}]"
    if "name" in eqn.params and isinstance(eqn.params["name"], str):
        return f"{name}[{eqn.params['name']}]"
    call = eqn.params.get("call_jaxpr")
    if isinstance(call, core.ClosedJaxpr) and call.jaxpr.debug_info is not None:
        return f"{name}[{call.jaxpr.debug_info.func_name}]"
    return name


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _aval_str(aval: Any) -> str:
    return aval.str_short(short_dtypes=True)


def _eval_eqn(eqn: core.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Binds one equation, with its source location and context, as ``core.eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _read(env: dict, a: Any) -> Any:
    return a.val if isinstance(a, core.Literal) else env[a]


def _eval_jaxpr(jaxpr: core.Jaxpr, args: Sequence[Any], keep: Sequence[core.Var] = ()):
    """Evaluates ``jaxpr`` (no constvars); returns its outputs and the values of ``keep``."""
    env = dict(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        outs = _eval_eqn(eqn, [_read(env, a) for a in eqn.invars])
        env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True) if _is_var(v))
    return [_read(env, a) for a in jaxpr.outvars], [env[v] for v in keep]


def _dce(jaxpr: core.Jaxpr, used_outputs: Sequence[bool]) -> core.Jaxpr:
    """Drops equations whose outputs are never used (keeping the rest as they are).

    Unlike ``pe.dce_jaxpr`` this leaves ``custom_vjp_call`` equations untouched (so a
    ``custom_ivjp`` stays recognisable); a ``scan`` with unused outputs is pruned by JAX's own
    rule, so its inverse never needs a value nobody computed.
    """
    live = {v for v, u in zip(jaxpr.outvars, used_outputs, strict=True) if u and _is_var(v)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        used = [_is_var(v) and v in live for v in eqn.outvars]
        if not any(used) and not eqn.effects:
            continue
        if eqn.primitive is scan_p and not all(used) and not eqn.effects:
            _, eqn = pe.dce_rules[scan_p](used, eqn)
        live.update(a for a in eqn.invars if _is_var(a))
        kept.append(eqn)
    return jaxpr.replace(eqns=kept[::-1])


def _open(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> tuple[core.Jaxpr, list[Any]]:
    """A jaxpr with its constvars turned into leading invars, and the const values."""
    if isinstance(jaxpr, core.ClosedJaxpr):
        return pe.convert_constvars_jaxpr(jaxpr.jaxpr), list(jaxpr.consts)
    return jaxpr, []


def _zeros_ct(aval: Any) -> Any:
    if _is_float(aval):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _eqn_vjp(
    eqn: core.JaxprEqn, ins: Sequence[Any], couts: Sequence[Any], cache: dict | None = None
) -> list[Any]:
    """Cotangents of ``eqn``'s float operands given its output cotangents (None = zero).

    ``cache`` maps an equation's signature (primitive, params, operand types, which cotangents
    are zero) to its traced VJP, so the 64 identical layers of a stack are linearized once.
    """
    diff = [p for p, a in enumerate(eqn.invars) if _is_var(a) and _is_float(a.aval)]
    cins: list[Any] = [None] * len(ins)
    if not diff:
        return cins
    out_avals = [v.aval for v in eqn.outvars]
    zero = tuple(c is None for c in couts)

    def vjp(ins, cts):
        def f(*xs):
            args = list(ins)
            for p, x in zip(diff, xs, strict=True):
                args[p] = x
            return _eval_eqn(eqn, args)

        _, pullback = jax.vjp(f, *[ins[p] for p in diff])
        it = iter(cts)
        full = [_zeros_ct(a) if z else next(it) for a, z in zip(out_avals, zero, strict=True)]
        return list(pullback(full))

    cts = [c for c in couts if c is not None]
    key = None
    if cache is not None and not eqn.effects:
        try:
            key = (
                eqn.primitive,
                tuple(sorted(eqn.params.items())),
                zero,
                tuple(map(core.typeof, ins)),
            )
            hash(key)
        except TypeError:  # unhashable params: trace this one directly
            key = None
    if key is None:
        res = vjp(ins, cts)
    else:
        if key not in cache:
            cache[key] = jax.make_jaxpr(vjp)(list(ins), cts)
        closed = cache[key]
        res = core.eval_jaxpr(closed.jaxpr, closed.consts, *ins, *cts)
    for p, c in zip(diff, res, strict=True):
        cins[p] = c
    return cins


class _Fail(Exception):
    """An equation the analysis cannot invert (becomes NotInvertibleError at the top level)."""

    def __init__(self, eqn: core.JaxprEqn | None, reason: str):
        super().__init__(reason)
        self.eqn, self.reason = eqn, reason  # eqn None: about the body as a whole

    def describe(self) -> str:
        if self.eqn is None:
            return self.reason
        return f"`{_display(self.eqn)}` at {_where(self.eqn)}: {self.reason}"


# --- rules: how each kind of equation is inverted ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Assessment:
    reason: str | None = None  # why the candidate cannot be reconstructed, or None
    needs: frozenset[int] = frozenset()  # operand positions the rule needs known instead
    sub: Any = None  # a nested plan, for rules that recurse


class _SimpleRule:
    """A registered ``rn.register_inverse`` rule: invert, then VJP the equation by itself."""

    def __init__(self, rule: _inverse_rules._Rule):
        self.rule = rule

    def linked_positions(self, eqn):
        return self.rule.linked_positions(len(eqn.invars))

    def assess(self, analysis, eqn, cand, known_out):
        if not all(known_out):
            return _Assessment("some of its outputs are never used, so they are not available")
        avals = [a.aval for a in eqn.invars]
        return _Assessment(self.rule.why_not(eqn.params, avals, cand))

    def run(self, eqn, sub, ins, outs, couts, want_cts):
        del sub, couts, want_cts
        holes = [p for p, x in enumerate(ins) if x is None]
        invals = [
            jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype) if x is None else x
            for a, x in zip(eqn.invars, ins, strict=True)
        ]
        new = list(self.rule.inverse(invals, list(outs), **eqn.params))
        if len(new) != len(ins):
            raise TypeError(
                f"rn.invertible: the inverse rule of `{eqn.primitive.name}` returned {len(new)} "
                f"inputs, expected {len(ins)} (all inputs, known ones passed through)."
            )
        for p in holes:
            aval, got = eqn.invars[p].aval, core.typeof(new[p])
            if got.shape != aval.shape or got.dtype != aval.dtype:
                raise TypeError(
                    f"rn.invertible: the inverse rule of `{eqn.primitive.name}` reconstructed "
                    f"operand {p} as {_aval_str(got)}, expected {_aval_str(aval)}."
                )
        return [new[p] if x is None else x for p, x in enumerate(ins)], None


class _CallRule:
    """``jit`` / ``closed_call`` / ``checkpoint``: walk the body; custom_jvp/vjp: invert the body,
    then differentiate the call itself so its custom rule is used."""

    def __init__(self, get_jaxpr: Callable[[dict], Any], own_derivative: bool):
        self.get_jaxpr, self.own_derivative = get_jaxpr, own_derivative

    def linked_positions(self, eqn):
        return tuple(range(len(eqn.invars)))

    def assess(self, analysis, eqn, cand, known_out):
        inner, consts = _open(self.get_jaxpr(eqn.params))
        nc = len(consts)
        known_in = (True,) * nc + tuple(p not in cand for p in range(len(eqn.invars)))
        try:
            sub = analysis.nested(inner, known_in, known_out)
        except _Fail as e:
            return _Assessment(f"its body cannot be inverted: {e.describe()}")
        return _Assessment(None, frozenset(p - nc for p in sub.stored_in), sub)

    def run(self, eqn, sub, ins, outs, couts, want_cts):
        _, consts = _open(self.get_jaxpr(eqn.params))
        nc = len(consts)
        fused = want_cts and not self.own_derivative
        rins, rcts = _execute(sub, consts + list(ins), outs, couts if fused else None)
        return rins[nc:], (rcts[nc:] if fused else None)


class _ScanRule:
    """``scan`` of an invertible body: a reverse scan that inverts and differentiates one
    iteration at a time (memory flat in the scan length)."""

    def linked_positions(self, eqn):
        return tuple(range(eqn.params["num_consts"], len(eqn.invars)))

    def assess(self, analysis, eqn, cand, known_out):
        if not all(known_out):
            return _Assessment("some of its outputs are never used, so they are not available")
        nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
        consts_needed = frozenset(p for p in cand if p < nc)
        if consts_needed:
            return _Assessment(None, consts_needed)
        inner, bconsts = _open(eqn.params["jaxpr"])
        nb = len(bconsts)
        xs_known = tuple(p not in cand for p in range(nc + ncar, len(eqn.invars)))
        known_in = (True,) * (nb + nc) + (False,) * ncar + xs_known
        try:
            sub = analysis.nested(inner, known_in, (True,) * len(inner.outvars))
        except _Fail as e:
            return _Assessment(f"its body cannot be inverted: {e.describe()}")
        needs = frozenset(q - nb for q in sub.stored_in)
        carry_needs = sorted(p - nc for p in needs if nc <= p < nc + ncar)
        if carry_needs:
            return _Assessment(
                f"its body cannot reconstruct carry {carry_needs} from the next carry and the "
                "outputs without storing it"
            )
        return _Assessment(None, needs, sub)

    def run(self, eqn, sub, ins, outs, couts, want_cts):
        prm = eqn.params
        nc, ncar, length = prm["num_consts"], prm["num_carry"], prm["length"]
        _, bconsts = _open(prm["jaxpr"])
        nb = len(bconsts)
        consts, xs = list(ins[:nc]), list(ins[nc + ncar :])
        carry_avals = [a.aval for a in eqn.invars[nc : nc + ncar]]
        const_avals = [a.aval for a in eqn.invars[:nc]]
        ys = list(outs[ncar:])
        xs_known = [x is not None for x in xs]

        def ct_or_zeros(c, aval):
            return (
                (c if c is not None else jnp.zeros(aval.shape, aval.dtype))
                if _is_float(aval)
                else None
            )

        if want_cts:
            ct_carry = [ct_or_zeros(c, a) for c, a in zip(couts[:ncar], carry_avals, strict=True)]
            ct_ys = [ct_or_zeros(c, core.typeof(y)) for c, y in zip(couts[ncar:], ys, strict=True)]
            ct_consts = [ct_or_zeros(None, a) for a in const_avals]
        else:
            ct_carry, ct_ys, ct_consts = None, None, None

        def body(state, per_iter):
            carry, ct_c, ct_k = state
            y, ct_y, x = per_iter
            inner_in = (
                bconsts
                + consts
                + [None] * ncar
                + [v if k else None for v, k in zip(x, xs_known, strict=True)]
            )
            rins, rcts = _execute(
                sub,
                inner_in,
                list(carry) + list(y),
                None if ct_c is None else list(ct_c) + list(ct_y),
            )
            rins = rins[nb:]
            new_carry = rins[nc : nc + ncar]
            x_rec = [r if not k else None for r, k in zip(rins[nc + ncar :], xs_known, strict=True)]
            if ct_c is None:
                return (new_carry, None, None), (x_rec, None)
            rcts = rcts[nb:]
            new_ct_c = [
                ct_or_zeros(c, a) for c, a in zip(rcts[nc : nc + ncar], carry_avals, strict=True)
            ]
            new_ct_k = [
                None if k is None else (k if c is None else k + c)
                for k, c in zip(ct_k, rcts[:nc], strict=True)
            ]
            xs_avals = [a.aval for a in eqn.invars[nc + ncar :]]
            ct_x = [ct_or_zeros(c, a) for c, a in zip(rcts[nc + ncar :], xs_avals, strict=True)]
            return (new_carry, new_ct_c, new_ct_k), (x_rec, ct_x)

        init = (list(outs[:ncar]), ct_carry, ct_consts)
        per_iter = (ys, ct_ys, [x if k else None for x, k in zip(xs, xs_known, strict=True)])
        (carry0, ct_c0, ct_k), (x_rec, ct_x) = lax.scan(
            body, init, per_iter, length=length, reverse=not prm["reverse"]
        )
        new_xs = [r if x is None else x for r, x in zip(x_rec, xs, strict=True)]
        rins = consts + list(carry0) + new_xs
        if not want_cts:
            return rins, None
        return rins, list(ct_k) + list(ct_c0) + list(ct_x)


class _IVJPRule:
    """A ``custom_ivjp`` function: its rule gives both the inputs and their cotangents."""

    def linked_positions(self, eqn):
        bwd = eqn.params["bwd"].f
        nc = eqn.params["num_consts"]
        return tuple(nc + p for p, k in enumerate(bwd.known_mask) if not k)

    def assess(self, analysis, eqn, cand, known_out):
        if not all(known_out):
            return _Assessment("some of its outputs are never used, so they are not available")
        bwd = eqn.params["bwd"].f
        nc = eqn.params["num_consts"]
        needs = frozenset(p for p in cand if p < nc or bwd.known_mask[p - nc])
        return _Assessment(None, needs)

    def run(self, eqn, sub, ins, outs, couts, want_cts):
        del sub
        bwd = eqn.params["bwd"].f
        nc = eqn.params["num_consts"]
        dys = None
        if want_cts:
            dys = [
                c if c is not None else _zeros_ct(core.typeof(o))
                for c, o in zip(couts, outs, strict=True)
            ]
        xs, dxs = bwd.apply(list(ins[nc:]), list(outs), dys)
        return list(ins[:nc]) + xs, ([None] * nc + dxs if want_cts else None)


def _is_custom_ivjp(eqn: core.JaxprEqn) -> bool:
    return eqn.primitive is custom_vjp_call_p and isinstance(
        getattr(eqn.params["bwd"], "f", None), _IVJPBwd
    )


_CALLS = {
    jit_p: _CallRule(lambda prm: prm["jaxpr"], own_derivative=False),
    core.closed_call_p: _CallRule(lambda prm: prm["call_jaxpr"], own_derivative=False),
    remat_p: _CallRule(lambda prm: prm["jaxpr"], own_derivative=False),
    custom_jvp_call_p: _CallRule(lambda prm: prm["call_jaxpr"], own_derivative=True),
    custom_vjp_call_p: _CallRule(lambda prm: prm["call_jaxpr"], own_derivative=True),
}
_SCAN, _IVJP = _ScanRule(), _IVJPRule()


def _rule_for(eqn: core.JaxprEqn):
    if _is_custom_ivjp(eqn):
        return _IVJP
    if eqn.primitive in _CALLS:
        return _CALLS[eqn.primitive]
    if eqn.primitive is scan_p:
        return _SCAN
    rule = _inverse_rules.lookup(eqn.primitive)
    return None if rule is None else _SimpleRule(rule)


# --- the analysis: which value is known when, and how each equation is undone ------------------


@dataclasses.dataclass
class _Step:
    index: int  # position of the equation in plan.jaxpr.eqns
    path: str  # "inverted" | "recomputed"
    forward: tuple[int, ...] = ()  # equations evaluated forward first (program order)
    unknown: tuple[int, ...] = ()  # operand positions reconstructed by the rule
    sub: Any = None  # nested plan of a recursing rule
    free: tuple[core.Var, ...] = ()  # values dead after this step


@dataclasses.dataclass
class _Plan:
    jaxpr: core.Jaxpr
    steps: list[_Step]
    rules: list[Any]
    stored_in: tuple[int, ...]  # input positions the walk needs (residuals / outer operands)
    stored_vars: tuple[core.Var, ...]  # intermediates stored by fallback="recompute"
    stored_eqns: dict[int, str]  # equation index -> why its operand is stored
    vjp_cache: dict = dataclasses.field(default_factory=dict)  # see _eqn_vjp


@dataclasses.dataclass
class _Option:
    cand: tuple[int, ...]
    others: tuple[int, ...]
    roots: frozenset[core.Var]
    sub: Any
    cost: tuple[int, int, int]


class _Analysis:
    """Plans the reverse walk of one jaxpr (its constvars already turned into invars)."""

    def __init__(
        self,
        jaxpr: core.Jaxpr,
        known_in: Sequence[bool],
        known_out: Sequence[bool],
        *,
        fallback: bool,
        nested: bool,
    ):
        self.jaxpr, self.eqns = jaxpr, jaxpr.eqns
        self.known_in, self.known_out = tuple(known_in), tuple(known_out)
        self.fallback, self.is_nested = fallback, nested
        self.producer = {v: i for i, e in enumerate(self.eqns) for v in e.outvars if _is_var(v)}
        self.in_pos: dict[core.Var, int] = {}
        for p, v in enumerate(jaxpr.invars):
            self.in_pos.setdefault(v, p)
        self.rules = [_rule_for(e) for e in self.eqns]
        self.linked = self._linked()
        self.stored_in: set[int] = set()
        self.stored_vars: dict[core.Var, None] = {}
        self.stored_eqns: dict[int, str] = {}
        self.subs: dict[Any, tuple[core.Jaxpr, _Plan | _Fail]] = {}

    def nested(self, jaxpr, known_in, known_out) -> _Plan:
        """Plans the walk of a sub-jaxpr (a call's or scan's body), strictly; cached."""
        key = (id(jaxpr), tuple(known_in), tuple(known_out))
        if key not in self.subs:
            live = _dce(jaxpr, known_out)
            sub = _Analysis(live, known_in, known_out, fallback=False, nested=True)
            try:
                self.subs[key] = (jaxpr, sub.plan())  # keeps jaxpr alive: id() stays unique
            except _Fail as e:
                self.subs[key] = (jaxpr, e)
        out = self.subs[key][1]
        if isinstance(out, _Fail):
            raise out
        return out

    def _linked(self) -> set[core.Var]:
        """Values joined to an output by a chain of invertible operand positions: the natural
        things to reconstruct (as opposed to weights, which reach outputs only through
        non-invertible ops). Used only to rank choices."""
        reach = {v for v in self.jaxpr.outvars if _is_var(v)}
        for eqn, rule in zip(reversed(self.eqns), reversed(self.rules), strict=True):
            if rule is None or not any(_is_var(v) and v in reach for v in eqn.outvars):
                continue
            reach.update(a for p in rule.linked_positions(eqn) if _is_var(a := eqn.invars[p]))
        return reach

    def _touches_known(self, v, known) -> bool:
        """Whether ``v`` is computed from some known value (not only from unknown inputs)."""
        seen, stack = set(), [v]
        while stack:
            u = stack.pop()
            if u in known:
                return True
            if u in seen or u not in self.producer:
                continue
            seen.add(u)
            stack.extend(a for a in self.eqns[self.producer[u]].invars if _is_var(a))
        return False

    def _roots(self, vs, known, first_only: bool = False) -> set[core.Var]:
        """The unknown inputs that the values ``vs`` are computed from (empty: computable)."""
        roots, seen, stack = set(), set(), list(vs)
        while stack:
            v = stack.pop()
            if v in seen or v in known:
                continue
            seen.add(v)
            i = self.producer.get(v)
            if i is None:
                roots.add(v)
                if first_only:
                    break
            else:
                stack.extend(a for a in self.eqns[i].invars if _is_var(a))
        return roots

    def _schedule(self, v, known: set, evaluated: set) -> list[int]:
        """Marks the equations that compute ``v`` forward as evaluated; returns their indices."""
        order, stack = [], [(v, False)]
        while stack:
            u, expanded = stack.pop()
            if u in known:
                continue
            i = self.producer[u]
            if expanded:
                if i not in evaluated:
                    evaluated.add(i)
                    order.append(i)
                    known.update(w for w in self.eqns[i].outvars if _is_var(w))
                continue
            stack.append((u, True))
            stack.extend((a, False) for a in self.eqns[i].invars if _is_var(a) and a not in known)
        return order

    def _option(self, eqn, rule, cand, remaining, known, known_out) -> _Option | str:
        cand, others = set(cand), [p for p in remaining if p not in cand]
        sub = None
        for _ in range(len(remaining) + 1):
            a = rule.assess(self, eqn, tuple(sorted(cand)), known_out)
            if a.reason is not None:
                return a.reason
            needs = a.needs & cand
            sub = a.sub
            if not needs:
                break
            cand -= needs
            others += sorted(needs)
            if not cand:
                return "it needs all of its unknown operands to be known already"
        cand_vars = {eqn.invars[p] for p in cand}
        other_vars = {eqn.invars[p] for p in others}
        if cand_vars & other_vars:
            return "the same value is both the operand to reconstruct and an operand it needs"
        roots = self._roots(other_vars, known)
        rest = self._roots(cand_vars, known | roots)
        if not rest or (roots and not rest & self.linked):
            # Either the operands are all computed from the same unknown inputs, or inverting
            # would store data only to reconstruct a function of weights: not an inversion.
            return (
                "its operands are computed from the same unknown inputs (like x + F(x)), so "
                "its output does not determine them"
            )
        cost = (
            sum(r in self.linked for r in roots),
            sum(_nbytes(r.aval) for r in roots),
            -len(cand),
        )
        return _Option(tuple(sorted(cand)), tuple(others), frozenset(roots), sub, cost)

    def _choose(self, eqn, rule, remaining, known, known_out) -> tuple[_Option | None, str]:
        if rule is None:
            return None, f"`{eqn.primitive.name}` has no registered inverse"
        groups: dict[core.Var, list[int]] = {}
        for p in remaining:
            groups.setdefault(eqn.invars[p], []).append(p)
        cands = [tuple(ps) for ps in groups.values()]
        cands += [tuple(remaining)] if len(groups) > 1 else []
        options, reasons = [], []
        for ps in groups.values():
            if len(ps) > 1:
                reasons.append(
                    f"operands {ps} are the same unknown value (like x * x), so its output does "
                    "not determine it"
                )
        for cand in cands:
            opt = self._option(eqn, rule, cand, remaining, known, known_out)
            (reasons if isinstance(opt, str) else options).append(opt)
        if not options:
            return None, reasons[0]
        return min(options, key=lambda o: o.cost), ""

    def _try(self, i: int, known: set, evaluated: set):
        """Processes equation ``i`` if its operands can be made known; else why not."""
        eqn = self.eqns[i]
        if i in evaluated:
            return _Step(i, "recomputed")
        unknown = [p for p, a in enumerate(eqn.invars) if _is_var(a) and a not in known]
        remaining = tuple(
            p for p in unknown if self._roots([eqn.invars[p]], known, first_only=True)
        )
        # An operand computed from known values and from unknown inputs that no invertible
        # chain links to an output (F(x2) = tanh(x2 @ W) once x2 is known) is a side
        # computation: those inputs are weights, stored, not data to reconstruct through F.
        # One computed from unknown inputs only (sin(x)) is on the reconstruction path.
        side, side_roots = [], set()
        for p in remaining if self.rules[i] is not None else ():
            roots = self._roots([eqn.invars[p]], known)
            if not roots & self.linked and self._touches_known(eqn.invars[p], known):
                side.append(p)
                side_roots |= roots
        if side:
            for r in side_roots:
                self.stored_in.add(self.in_pos[r])
                known.add(r)
            remaining = tuple(p for p in remaining if p not in side)
        option = None
        if remaining:
            known_out = tuple(_is_var(v) and v in known for v in eqn.outvars)
            option, reason = self._choose(eqn, self.rules[i], remaining, known, known_out)
            if option is None:
                return remaining, reason
            for r in option.roots:  # inputs needed as known operands (weights): stored
                self.stored_in.add(self.in_pos[r])
                known.add(r)
        forward = []
        for p in unknown:
            a = eqn.invars[p]
            if a not in known and (option is None or p not in option.cand):
                forward += self._schedule(a, known, evaluated)
        if option is None:
            return _Step(i, "recomputed", tuple(sorted(forward)))
        known.update(eqn.invars[p] for p in option.cand)
        return _Step(i, "inverted", tuple(sorted(forward)), option.cand, option.sub)

    def _walk(self):
        """One reverse walk. An equation is taken once every consumer of its outputs has been
        (so its output cotangents are complete), latest first; one that cannot be resolved yet
        waits until more values are known (e.g. ``(exp(x), sum(x))``: ``sum`` waits for ``x``
        to be reconstructed from ``exp``)."""
        jaxpr, eqns = self.jaxpr, self.eqns
        known = {v for p, v in enumerate(jaxpr.invars) if self.known_in[p] or p in self.stored_in}
        known.update(self.stored_vars)
        known.update(
            v for v, k in zip(jaxpr.outvars, self.known_out, strict=True) if k and _is_var(v)
        )
        producers_of = [
            {self.producer[a] for a in e.invars if _is_var(a) and a in self.producer} for e in eqns
        ]
        waiting = [0] * len(eqns)  # consumers not yet processed
        for ps in producers_of:
            for k in ps:
                waiting[k] += 1
        ready = [-i for i in range(len(eqns)) if waiting[i] == 0]
        heapq.heapify(ready)
        evaluated: set[int] = set()
        steps, blocked = [], []
        while ready:
            i = -heapq.heappop(ready)
            out = self._try(i, known, evaluated)
            if not isinstance(out, _Step):
                blocked.append((i, *out))
                continue
            steps.append(out)
            for k in producers_of[i]:
                waiting[k] -= 1
                if waiting[k] == 0:
                    heapq.heappush(ready, -k)
            for b in blocked:  # more is known now: retry
                heapq.heappush(ready, -b[0])
            blocked = []
        if blocked:
            return sorted(blocked, reverse=True), known
        if self.is_nested:
            for p, v in enumerate(jaxpr.invars):
                if v not in known:
                    raise _Fail(None, f"operand {p} does not reach any output")
        return self._finish(steps)

    def _finish(self, steps: list[_Step]) -> _Plan:
        last: dict[core.Var, int] = {}
        for k, step in enumerate(steps):
            eqns = [self.eqns[j] for j in step.forward] + [self.eqns[step.index]]
            for e in eqns:
                for a in (*e.invars, *e.outvars):
                    if _is_var(a):
                        last[a] = k
        keep = set(self.jaxpr.invars)
        frees: list[list[core.Var]] = [[] for _ in steps]
        for v, k in last.items():
            if v not in keep:
                frees[k].append(v)
        for step, free in zip(steps, frees, strict=True):
            step.free = tuple(free)
        return _Plan(
            self.jaxpr,
            steps,
            self.rules,
            tuple(sorted(self.stored_in)),
            tuple(self.stored_vars),
            dict(self.stored_eqns),
        )

    def plan(self) -> _Plan:
        for _ in range(len(self.jaxpr.invars) + len(self.producer) + 2):
            out = self._walk()
            if isinstance(out, _Plan):
                return out
            blocked, known = out
            i, remaining, reason = blocked[0]  # the one nearest the outputs
            eqn = self.eqns[i]
            if not self.fallback:
                raise _Fail(eqn, reason)
            # Store the operands it cannot reconstruct (like a remat checkpoint): one that the
            # others compute (x in x + F(x)) suffices.
            chosen: set[core.Var] = set()
            for p in remaining:
                v = eqn.invars[p]
                if v in chosen or not self._roots([v], known | chosen, first_only=True):
                    continue
                chosen.add(v)
                if v in self.in_pos:
                    self.stored_in.add(self.in_pos[v])
                else:
                    self.stored_vars[v] = None
            self.stored_eqns[i] = reason
        raise AssertionError("rn.invertible: the analysis did not converge")  # pragma: no cover


# --- the reverse walk itself --------------------------------------------------------------------


def _accumulate(ct: dict, v: core.Var, c: Any) -> None:
    if c is None or core.typeof(c).dtype == jax.dtypes.float0:
        return
    ct[v] = c if v not in ct else ct[v] + c


def _execute(
    plan: _Plan,
    invals: Sequence[Any],
    outvals: Sequence[Any],
    out_cts: Sequence[Any] | None,
    stored: Sequence[Any] = (),
) -> tuple[list[Any], list[Any] | None]:
    """Runs the planned reverse walk.

    Args:
      plan: from ``_Analysis.plan``.
      invals: the jaxpr's inputs, ``None`` where unknown (to reconstruct).
      outvals: its outputs (``None`` for outputs the plan does not know).
      out_cts: output cotangents (``None`` entries are zeros), or ``None`` to only reconstruct.
      stored: values of ``plan.stored_vars``.

    Returns:
      All inputs (reconstructed where they were ``None``) and their cotangents (``None`` for
      zero), or ``None`` for the cotangents when ``out_cts`` is ``None``.
    """
    jaxpr, want_cts = plan.jaxpr, out_cts is not None
    env: dict[core.Var, Any] = {
        v: x for v, x in zip(jaxpr.invars, invals, strict=True) if x is not None
    }
    env.update(zip(plan.stored_vars, stored, strict=True))
    env.update(
        (v, x) for v, x in zip(jaxpr.outvars, outvals, strict=True) if _is_var(v) and x is not None
    )
    ct: dict[core.Var, Any] = {}
    if want_cts:
        for v, c in zip(jaxpr.outvars, out_cts, strict=True):
            if _is_var(v):
                _accumulate(ct, v, c)
    for step in plan.steps:
        for j in step.forward:
            e = jaxpr.eqns[j]
            outs = _eval_eqn(e, [_read(env, a) for a in e.invars])
            env.update((v, o) for v, o in zip(e.outvars, outs, strict=True) if _is_var(v))
        eqn = jaxpr.eqns[step.index]
        ins = [_read(env, a) if (not _is_var(a) or a in env) else None for a in eqn.invars]
        outs = [env.get(v) if _is_var(v) else None for v in eqn.outvars]
        couts = [ct.pop(v, None) if _is_var(v) else None for v in eqn.outvars] if want_cts else None
        cins = None
        if step.path == "inverted":
            ins, cins = plan.rules[step.index].run(eqn, step.sub, ins, outs, couts, want_cts)
            for p in step.unknown:
                env[eqn.invars[p]] = ins[p]
        if want_cts and cins is None and any(c is not None for c in couts):
            cins = _eqn_vjp(eqn, ins, couts, plan.vjp_cache)
        if want_cts and cins is not None:
            for a, c in zip(eqn.invars, cins, strict=True):
                if _is_var(a):
                    _accumulate(ct, a, c)
        for v in step.free:
            env.pop(v, None)
    new_in = [env.get(v, x) for v, x in zip(jaxpr.invars, invals, strict=True)]
    return new_in, ([ct.get(v) for v in jaxpr.invars] if want_cts else None)


# --- rn.invertible ------------------------------------------------------------------------------


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(
        leaf, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic | int | float | complex
    )


@dataclasses.dataclass
class _Traced:
    jaxpr: core.Jaxpr  # constvars turned into leading invars, dead code removed
    inputs: list[Any]  # hoisted constants, then the array leaves of (args, kwargs)
    names: list[str]  # a readable name per input
    out_tree: Any


def _trace(fun: Callable, args: tuple, kwargs: dict) -> _Traced:
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in leaves_with_path]
    dyn_idx = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]
    store = {}

    def flat_fun(*dyn):
        full = list(leaves)
        for i, d in zip(dyn_idx, dyn, strict=True):
            full[i] = d
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        out_leaves, store["out_tree"] = jax.tree_util.tree_flatten(fun(*a, **k))
        return out_leaves

    dyn = [leaves[i] for i in dyn_idx]
    closed = jax.make_jaxpr(flat_fun)(*dyn)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    jaxpr = _dce(jaxpr, [True] * len(jaxpr.outvars))
    names = [f"closed-over constant {k}" for k in range(len(closed.consts))]
    for i in dyn_idx:
        path = jax.tree_util.keystr(leaves_with_path[i][0])
        names.append(_arg_name(path))
    return _Traced(jaxpr, list(closed.consts) + dyn, names, store["out_tree"])


def _arg_name(path: str) -> str:
    # "[0][1]['w']" -> "args[1]['w']", "[1]['scale']" -> "kwargs['scale']"
    if path.startswith("[0]"):
        return "args" + path[3:]
    return "kwargs" + path[3:]


def _analyze(traced: _Traced, fallback: bool) -> _Plan:
    n = len(traced.jaxpr.invars)
    analysis = _Analysis(
        traced.jaxpr,
        (False,) * n,
        (True,) * len(traced.jaxpr.outvars),
        fallback=fallback,
        nested=False,
    )
    try:
        return analysis.plan()
    except _Fail as e:
        raise NotInvertibleError(
            _NOT_INVERTIBLE.format(prim=_display(e.eqn), where=_where(e.eqn), reason=e.reason)
        ) from None


def _as_custom_vjp(plan: _Plan) -> Callable:
    jaxpr = plan.jaxpr
    float_in = [_is_float(v.aval) for v in jaxpr.invars]

    @jax.custom_vjp
    def run(*ins):
        return _eval_jaxpr(jaxpr, ins)[0]

    def fwd(*ins):
        outs, kept = _eval_jaxpr(jaxpr, ins, plan.stored_vars)
        # Residuals: the outputs (the same buffers as the primal result), the inputs the walk
        # needs (alive anyway: weights, constants) and, with fallback="recompute" only, the
        # intermediates it could not reconstruct.
        return outs, (outs, [ins[p] for p in plan.stored_in], kept)

    def bwd(res, cts):
        outs, stored_in, kept = res
        invals: list[Any] = [None] * len(jaxpr.invars)
        for p, x in zip(plan.stored_in, stored_in, strict=True):
            invals[p] = x
        _, cins = _execute(plan, invals, outs, list(cts), kept)
        return tuple(c if f else None for c, f in zip(cins, float_in, strict=True))

    run.defvjp(fwd, bwd)
    return run


class Invertible:
    """A function whose VJP reconstructs its intermediates from its outputs.

    Made by :func:`invertible`; call it like the wrapped function.
    """

    def __init__(self, fun: Callable, fallback: str):
        functools.update_wrapper(self, fun)
        self.fun, self.fallback = fun, fallback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        traced = _trace(self.fun, args, kwargs)
        plan = _analyze(traced, self.fallback == "recompute")
        outs = _as_custom_vjp(plan)(*traced.inputs)
        return jax.tree_util.tree_unflatten(traced.out_tree, outs)

    def __repr__(self) -> str:
        name = getattr(self.fun, "__name__", repr(self.fun))
        return f"rn.invertible({name}, fallback={self.fallback!r})"


def invertible(fun: Callable | None = None, *, fallback: str = "error") -> Any:
    """Makes ``fun``'s VJP reconstruct its intermediates from its outputs instead of storing them.

    The forward pass stores ``fun``'s outputs and the inputs the reverse walk needs but cannot
    reconstruct (for a coupling ``y1 = x1 + F(x2); y2 = x2 + G(y1)``: ``F``'s and ``G``'s
    weights, which the caller keeps alive anyway), and no intermediates. The backward pass walks
    ``fun``'s jaxpr in reverse, reconstructing each equation's inputs from its outputs and taking
    that equation's VJP with them, so a stack of N couplings costs the same activation memory as
    one. Gradients equal plain autodiff up to float round-off in the reconstruction.

    Works under ``jit``, ``vmap``, ``grad``, ``lax.scan`` and ``jax.checkpoint``; takes pytrees,
    several inputs and outputs, keyword arguments and non-array (static) leaves; arrays ``fun``
    closes over are hoisted into inputs and get gradients too.

    Args:
      fun: the function to invert, mapping arrays (pytrees) to arrays. Its path from inputs
        to outputs must use invertible primitives (add, sub, mul/div by a value computable
        without the input, exp/log, reshape, concatenate/split, ..., ``scan`` of an
        invertible body, ``custom_ivjp`` functions, or ones added with
        ``rn.register_inverse``); side computations (``F(x2)`` above) may use anything.
      fallback: ``"error"`` (default) raises ``NotInvertibleError`` at trace time for an
        operation that cannot be inverted; ``"recompute"`` stores that operation's operand in
        the forward pass instead (like a remat checkpoint) and recomputes what follows from it.
        ``rn.inversion_report`` shows which path each equation took.

    Returns:
      An :class:`Invertible` callable with ``fun``'s signature, or a decorator if ``fun`` is
      omitted (``@rn.invertible(fallback="recompute")``).

    Raises:
      NotInvertibleError: (when called) an operation cannot be inverted; the message names the
        primitive, its source line and the fix.
      ValueError: ``fallback`` is not one of ``"error"`` / ``"recompute"``.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> @rn.invertible
    ... def coupling(x1, x2, w):
    ...     y1 = x1 + jnp.tanh(x2 @ w)
    ...     y2 = x2 + jnp.tanh(y1 @ w)
    ...     return y1, y2
    >>> x, w = jnp.ones((2, 3)), 0.1 * jnp.eye(3)
    >>> loss = lambda x1, x2, w: sum(y.sum() for y in coupling(x1, x2, w))
    >>> jax.grad(loss, argnums=(0, 2))(x, x, w)[0].shape
    (2, 3)

    References:
      Gomez et al. 2017, "The Reversible Residual Network: Backpropagation Without Storing
      Activations". JAX's removed ``jax.invertible`` (it handled four primitives, still stored
      its inputs, and could not be jitted with custom rules: jax#8686).
    """
    if fallback not in _FALLBACKS:
        raise ValueError(
            f"rn.invertible: argument `fallback` must be one of {_FALLBACKS}, got {fallback!r}. "
            'Fix: rn.invertible(f, fallback="recompute") to store what cannot be inverted.'
        )
    if fun is None:
        return functools.partial(invertible, fallback=fallback)
    if not callable(fun):
        raise TypeError(
            f"rn.invertible: argument `fun` must be callable, got {type(fun).__name__} {fun!r}."
        )
    return Invertible(fun, fallback)


# --- rn.custom_ivjp -----------------------------------------------------------------------------


class _IVJPBwd:
    """The bwd of one ``custom_ivjp`` call; ``rn.invertible`` recognises it in the jaxpr."""

    def __init__(self, owner: custom_ivjp, in_tree: Any, known_mask: list[bool], store: dict):
        self.owner, self.in_tree, self.known_mask, self.store = owner, in_tree, known_mask, store

    def apply(self, xs: list[Any], ys: list[Any], dys: list[Any] | None):
        """Calls the user rule on flat values; ``None`` marks inputs to reconstruct."""
        unflat = jax.tree_util.tree_unflatten
        out_tree = self.store["out_tree"]
        x_tree = unflat(self.in_tree, xs)
        dy_tree = None if dys is None else unflat(out_tree, dys)
        result = self.owner.ivjp(x_tree, unflat(out_tree, ys), dy_tree)
        name = getattr(self.owner.ivjp, "__name__", "ivjp")
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"rn.custom_ivjp: the rule {name} must return a pair (xs, dxs), got "
                f"{type(result).__name__}."
            )
        new_xs = self.in_tree.flatten_up_to(result[0])
        dxs = [None] * len(xs) if result[1] is None else self.in_tree.flatten_up_to(result[1])
        for k, (x, new) in enumerate(zip(xs, new_xs, strict=True)):
            if x is None and new is None:
                raise TypeError(
                    f"rn.custom_ivjp: the rule {name} returned None for input leaf {k}, which "
                    "it was asked to reconstruct (it was passed as None)."
                )
        return [x if x is not None else n for x, n in zip(xs, new_xs, strict=True)], list(dxs)

    def __call__(self, res, dys):
        ys, known = res
        it = iter(known)
        xs = [next(it) if k else None for k in self.known_mask]
        return tuple(self.apply(xs, list(ys), list(dys))[1])


class custom_ivjp:  # noqa: N801  (lower case, like jax.custom_vjp)
    """Gives a function an explicit inverse-and-VJP rule: the backward reconstructs its inputs.

    ``g = rn.custom_ivjp(h); g.defivjp(ivjp)`` with ``ivjp(xs, ys, dys) -> (xs, dxs)``: given the
    outputs ``ys`` and their cotangents ``dys``, the rule returns the inputs ``xs`` and their
    cotangents ``dxs``. ``xs`` is the tuple of positional arguments with every leaf to
    reconstruct passed as ``None`` (leaves of ``known_argnums`` arguments are given). A ``None``
    cotangent means zero.

    On its own, ``g`` differentiates with the rule, storing only its outputs (and the
    ``known_argnums`` arguments). Inside ``rn.invertible``, the reverse walk uses the rule
    instead of tracing into ``h``. Works under ``jax.jit`` (the old ``jax.custom_ivjp`` did
    not: jax#8686), ``vmap`` and ``grad``.

    Args:
      fun: the function, taking positional array (pytree) arguments.
      known_argnums: positions of arguments the rule needs as values (weights); they are
        stored, never reconstructed.

    Returns:
      A callable with ``fun``'s signature; register the rule with ``.defivjp(ivjp)`` before
      calling it.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> double = rn.custom_ivjp(lambda x: 2.0 * x)
    >>> _ = double.defivjp(lambda xs, ys, dys: ((ys / 2.0,), (2.0 * dys,)))
    >>> jax.jit(jax.grad(lambda x: double(x).sum()))(jnp.ones(2))
    Array([2., 2.], dtype=float32)

    References:
      JAX's removed ``jax.custom_ivjp`` (``defivjp``, jax#8686); Gomez et al. 2017 (RevNet).
    """

    def __init__(self, fun: Callable, *, known_argnums: Sequence[int] = ()):
        if not callable(fun):
            raise TypeError(
                f"rn.custom_ivjp: argument `fun` must be callable, got {type(fun).__name__}."
            )
        functools.update_wrapper(self, fun)
        self.fun, self.known_argnums = fun, tuple(known_argnums)
        self.ivjp: Callable | None = None

    def defivjp(self, ivjp: Callable) -> Callable:
        """Sets the rule ``ivjp(xs, ys, dys) -> (xs, dxs)``; returns it (usable as decorator)."""
        if not callable(ivjp):
            raise TypeError(
                f"rn.custom_ivjp.defivjp: argument `ivjp` must be callable, got "
                f"{type(ivjp).__name__}."
            )
        self.ivjp = ivjp
        return ivjp

    def check(self, *args: Any, rtol: float = 1e-5, atol: float = 1e-6) -> float:
        """Round-trips the rule at ``args`` before you train on it; returns the max error.

        Runs ``fun`` forward, asks the rule to reconstruct the inputs from the outputs (with
        all-ones output cotangents), and compares the inputs with ``args`` and the cotangents
        with plain autodiff of ``fun``.

        Raises:
          NotInvertibleError: a reconstructed input or a cotangent differs beyond
            ``atol + rtol * |reference|``; the message names the leaf and the error.

        >>> import jax.numpy as jnp, remat_nn as rn
        >>> double = rn.custom_ivjp(lambda x: 2.0 * x)
        >>> _ = double.defivjp(lambda xs, ys, dys: ((ys / 3.0,), (2.0 * dys,)))  # wrong inverse
        >>> double.check(jnp.ones(3))
        Traceback (most recent call last):
        ...
        remat_nn.errors.NotInvertibleError: rn.custom_ivjp(<lambda>).check: ... off by ...
        """
        name = getattr(self.fun, "__name__", "fun")
        if self.ivjp is None:
            raise TypeError(f"rn.custom_ivjp({name}).check: no rule defined; call defivjp first.")
        ys, vjp = jax.vjp(self.fun, *args)
        dys = jax.tree.map(jnp.ones_like, ys)
        want_dxs = vjp(dys)
        known = {k % len(args) for k in self.known_argnums}
        xs_in = tuple(a if i in known else jax.tree.map(lambda _: None, a)
                      for i, a in enumerate(args))  # fmt: skip
        xs, dxs = self.ivjp(xs_in, ys, dys)
        worst = 0.0
        for what, got, want in (("reconstructed input", xs, args), ("cotangent", dxs, want_dxs)):
            got_leaves = jax.tree_util.tree_leaves(got)
            want_leaves = jax.tree_util.tree_leaves(want)
            for k, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
                err = float(jnp.max(jnp.abs(jnp.asarray(g) - w)))
                worst = max(worst, err)
                if err > atol + rtol * float(jnp.max(jnp.abs(w))):
                    raise NotInvertibleError(
                        f"rn.custom_ivjp({name}).check: the rule's {what} leaf {k} is off by "
                        f"{err:.3g} (atol {atol}, rtol {rtol}). Fix the rule "
                        f"{getattr(self.ivjp, '__name__', 'ivjp')}: it must return the inputs "
                        "fun was called with and their cotangents."
                    )
        return worst

    def __call__(self, *args: Any) -> Any:
        name = getattr(self.fun, "__name__", "fun")
        if self.ivjp is None:
            raise TypeError(
                f"rn.custom_ivjp({name}): no rule defined. Fix: g.defivjp(ivjp) with "
                "ivjp(xs, ys, dys) -> (xs, dxs) before calling g."
            )
        bad = [k for k in self.known_argnums if not -len(args) <= k < len(args)]
        if bad:
            raise ValueError(
                f"rn.custom_ivjp({name}): known_argnums {bad} out of range for {len(args)} "
                "positional arguments."
            )
        known = {k % len(args) for k in self.known_argnums}
        known_mask = [i in known for i, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
        leaves, in_tree = jax.tree_util.tree_flatten(args)
        store: dict[str, Any] = {}

        def flat_fun(*xs):
            out, store["out_tree"] = jax.tree_util.tree_flatten(
                self.fun(*jax.tree_util.tree_unflatten(in_tree, xs))
            )
            return out

        def fwd(*xs):
            ys = flat_fun(*xs)
            return ys, (ys, [x for x, k in zip(xs, known_mask, strict=True) if k])

        run = jax.custom_vjp(flat_fun)
        run.defvjp(fwd, _IVJPBwd(self, in_tree, known_mask, store))
        outs = run(*leaves)
        return jax.tree_util.tree_unflatten(store["out_tree"], outs)


# --- rn.inversion_report ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InversionEntry:
    """How the reverse walk handles one equation of the traced function."""

    index: int  # position in the (dead-code-free) jaxpr
    primitive: str
    path: str  # "inverted" | "recomputed" | "stored"
    where: str  # source line, "file.py:12 (fn)"
    detail: str


_PATH_TEXT = {
    "inverted": "inverted (inputs reconstructed from outputs)",
    "recomputed": "recomputed forward from known values",
    "stored": "stored (operand saved in the forward pass)",
}


@dataclasses.dataclass(frozen=True)
class InversionReport:
    """What ``rn.invertible`` does with each equation of a function; ``print`` it to read it."""

    entries: tuple[InversionEntry, ...]
    stored_inputs: tuple[tuple[str, str], ...]  # (input name, "f32[8,8]"): kept, not copied
    stored_values: tuple[tuple[str, str], ...]  # ("f32[4,8]", where): extra residuals

    @property
    def counts(self) -> dict[str, int]:
        """Number of equations per path, e.g. ``{'inverted': 4, 'recomputed': 8}``."""
        out: dict[str, int] = {}
        for path in _PATH_TEXT:
            n = sum(e.path == path for e in self.entries)
            if n:
                out[path] = n
        return out

    @property
    def invertible(self) -> bool:
        """True if ``fallback="error"`` would succeed (nothing needs storing)."""
        return not self.stored_values and "stored" not in self.counts

    def __str__(self) -> str:
        lines = [
            f"rn.inversion_report: {len(self.entries)} equations; "
            + ", ".join(f"{n} {p}" for p, n in self.counts.items())
        ]
        wp = max((len(e.primitive) for e in self.entries), default=9)
        ww = max((len(e.where) for e in self.entries), default=5)
        lines.append(f"  {'#':>4}  {'primitive':<{wp}}  {'path':<10}  {'where':<{ww}}  detail")
        for e in self.entries:
            lines.append(
                f"  {e.index:>4}  {e.primitive:<{wp}}  {e.path:<10}  {e.where:<{ww}}  {e.detail}"
            )
        kept = ", ".join(f"{n} ({s})" for n, s in self.stored_inputs) or "none"
        lines.append(f"stored inputs (kept alive, not copied): {kept}")
        extra = ", ".join(f"{s} at {w}" for s, w in self.stored_values) or "none"
        lines.append(f"stored intermediates (extra residuals): {extra}")
        return "\n".join(lines)


def _detail(plan: _Plan, step: _Step) -> str:
    eqn = plan.jaxpr.eqns[step.index]
    if step.index in plan.stored_eqns:
        return plan.stored_eqns[step.index]
    if step.path == "recomputed":
        return "operands known"
    rule = plan.rules[step.index]
    ops = ", ".join(map(str, step.unknown))
    if isinstance(rule, _ScanRule):
        return f"operand(s) {ops} rebuilt by a reverse scan of its inverted body"
    if isinstance(rule, _IVJPRule):
        return f"operand(s) {ops} from its custom_ivjp rule"
    if isinstance(rule, _CallRule):
        return f"operand(s) {ops} by walking its body ({len(step.sub.jaxpr.eqns)} equations)"
    known = [p for p, a in enumerate(eqn.invars) if p not in step.unknown]
    return f"operand(s) {ops} reconstructed" + (f"; {known} known" if known else "")


def inversion_report(fun: Callable, *args: Any, **kwargs: Any) -> InversionReport:
    """Reports, per equation of ``fun``, whether ``rn.invertible`` inverts, recomputes or stores it.

    The analysis runs as with ``fallback="recompute"``, so a function that
    ``rn.invertible(fun)`` would reject still gets a full report: the equations it cannot
    invert are marked ``stored``. Nothing is executed; only ``fun``'s jaxpr is traced.

    Args:
      fun: a function, or an ``rn.invertible`` wrapper (its wrapped function is analysed).
      *args: example positional arguments (arrays or ``jax.ShapeDtypeStruct``s), as for the call.
      **kwargs: example keyword arguments.

    Returns:
      An :class:`InversionReport`: ``entries`` (one per equation, program order), ``counts``,
      ``stored_inputs``, ``stored_values``, ``invertible``; ``print`` it for a table.

    >>> import jax.numpy as jnp, remat_nn as rn
    >>> report = rn.inversion_report(lambda x, w: x + jnp.tanh(w), jnp.ones(3), jnp.ones(3))
    >>> report.counts, report.stored_inputs
    ({'inverted': 1, 'recomputed': 1}, (('args[1]', 'f32[3]'),))

    References:
      Gomez et al. 2017 (RevNet); JAX's removed ``jax.invertible`` (jax#8686).
    """
    if isinstance(fun, Invertible):
        fun = fun.fun
    traced = _trace(fun, args, kwargs)
    plan = _analyze(traced, fallback=True)
    entries = []
    for step in sorted(plan.steps, key=lambda s: s.index):
        eqn = plan.jaxpr.eqns[step.index]
        path = "stored" if step.index in plan.stored_eqns else step.path
        entries.append(
            InversionEntry(step.index, _display(eqn), path, _where(eqn), _detail(plan, step))
        )
    stored_inputs = tuple(
        (traced.names[p], _aval_str(plan.jaxpr.invars[p].aval)) for p in plan.stored_in
    )
    stored_values = tuple(
        (_aval_str(v.aval), _where(plan.jaxpr.eqns[_producer(plan.jaxpr, v)]))
        for v in plan.stored_vars
    )
    return InversionReport(tuple(entries), stored_inputs, stored_values)


def _producer(jaxpr: core.Jaxpr, v: core.Var) -> int:
    return next(i for i, e in enumerate(jaxpr.eqns) if v in e.outvars)
