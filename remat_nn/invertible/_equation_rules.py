"""Equation rules: how each kind of equation is inverted, behind one Protocol.

A primitive with a registered :class:`PrimitiveRule` is inverted by it (``SimpleRule``). Call-like
equations recurse: ``jit`` / ``closed_call`` / ``checkpoint`` bodies are walked (reconstruction
and cotangents together), ``custom_jvp`` / ``custom_vjp`` bodies are walked to reconstruct, then
differentiated with their own rules, a ``scan`` is undone by a reverse scan of its body's walk
(memory flat in its length) and a ``custom_ivjp`` call uses its user rule for both. The slices
of a value that tile it share a ``TilingRule``: each rebuilds the value from all of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp

from remat_nn import _named_axes
from remat_nn._jax_internals import (
    core,
    custom_jvp_call_p,
    custom_vjp_bwd,
    custom_vjp_call_p,
    hi_kind,
    jit_p,
    remat_p,
    scan_p,
    sub_jaxprs,
)
from remat_nn.invertible import (
    _errors,
    _primitive_rules,
    _scan_recompute,
    _scan_sketch,
    _tiling,
)
from remat_nn.invertible._jaxpr import aval_str, is_var, open_jaxpr, zeros_ct
from remat_nn.invertible._scan_carry import _initial_cts, _ScanErrors, _split_cts


class Nesting(Protocol):
    """What a rule's assessment asks of the analysis it is part of (an ``Analysis``)."""

    rtol: float  # the tolerance of the run-time bounds

    def nested(self, jaxpr: core.Jaxpr, known_in: Any, known_out: Any) -> Any:
        """The analysis of a call's or scan's body, or why it fails (a str)."""
        ...


# The errors known values carry into a rule or a walk (see ``_errors``): (inputs, outputs), each
# a float32 scalar (an absolute error) or None (exact); None at positions to rebuild.
Errors = tuple[list[Any], list[Any]]
# The walk, as the rules of calls and scans run it on their body's analysis (``_walk.execute``):
# (analysis, inputs with None to rebuild, outputs, output cotangents or None, errs=Errors)
#   -> (all inputs, their cotangents or None, failed-check code or None, the inputs' errors).
Walk = Callable[..., tuple[list[Any], list[Any] | None, Any, list[Any]]]


def combine_codes(code: Any, new: Any) -> Any:
    """The worse failed check of two codes (``_verdict``; 0: none failed; None: nothing
    checked)."""
    if new is None:
        return code
    if code is None:
        return new
    return _errors.settle(jnp.maximum(code, new))


@dataclasses.dataclass(frozen=True)
class Assessment:
    """Whether a set of unknown operands can be reconstructed from the equation's outputs."""

    reason: str | None = None  # why not, or None: it can
    sub: Any = None  # the nested Analysis of a rule that walks a body
    lossy: str | None = None  # why the inversion needs a run-time exactness check
    bounded: str | None = None  # a floating inverse: what its run-time error bound guards
    rtol: float = _primitive_rules.DEFAULT_RTOL  # the bound's tolerance (of the scale)


class EquationRule(Protocol):
    """How one kind of equation is inverted (and, for ``fused`` rules, differentiated)."""

    fused: bool  # run() also returns the operands' cotangents

    # What its inversion reads besides the known operands, if not the equation's outputs (a
    # tiling's every slice); see :func:`outputs_read`.
    @property
    def reads(self) -> tuple[core.Var, ...] | None: ...

    def reconstructs(self, eqn: core.JaxprEqn, position: int) -> bool:
        """Whether operand ``position`` can ever be rebuilt from the outputs."""
        ...

    def assess(self, analysis: Nesting, eqn: core.JaxprEqn, unknown: tuple[int, ...]) -> Assessment:
        """Can the operands at ``unknown`` be rebuilt, all outputs and other operands known?"""
        ...

    def run(
        self,
        eqn: core.JaxprEqn,
        assessment: Assessment,
        ins: list[Any],
        outs: list[Any],
        couts: list[Any] | None,
        walk: Walk,
        errs: Errors | None = None,
    ) -> tuple[list[Any], list[Any] | None, Any, list[Any] | None]:
        """Returns (all operands, their cotangents or None, failed-check code or None, the
        rebuilt operands' errors or None).

        ``ins`` has ``None`` at the operands to rebuild; ``couts`` is None to only rebuild.
        ``walk`` runs a body's analysis (the walk running this rule passes itself). ``errs``:
        the errors the known operands and the outputs carry (None: the walk tracks none).
        """
        ...


class SimpleRule:
    """A registered primitive rule: rebuild the operand; the walk takes the VJP separately."""

    fused, reads = False, None

    def __init__(self, rule: _primitive_rules.PrimitiveRule):
        self.rule = rule

    def reconstructs(self, eqn, position):
        del eqn
        return self.rule.reconstructs(position)

    def assess(self, analysis, eqn, unknown):
        avals = [a.aval for a in eqn.invars]
        reason = self.rule.why_not(eqn.params, avals, unknown)
        if reason is not None:
            return Assessment(reason)
        constants = [
            a.val
            if isinstance(a, core.Literal)
            else jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype)
            for a in eqn.invars
        ]
        outside = self.rule.outside_domain(constants, unknown)
        if outside is not None:
            return Assessment(f"outside its rule's domain: {outside}")
        sizes = [math.prod(a.shape) for a in avals]
        if all(math.prod(v.aval.shape) == 0 for v in eqn.outvars) and any(
            sizes[p] for p in unknown
        ):
            return Assessment("its output is empty, so it holds nothing of the operand")
        kind, why = self.rule.exactness(constants, unknown)
        if kind == "lost":
            return Assessment(f"a constant operand destroys it ({why})")
        bound = self.rule.bound
        floating = any(jnp.issubdtype(avals[p].dtype, jnp.inexact) for p in unknown)
        return Assessment(
            lossy=why if kind == "checked" else None,
            bounded=bound.reason if bound is not None and floating else None,
            rtol=analysis.rtol,
        )

    def run(self, eqn, assessment, ins, outs, couts, walk, errs=None):
        del couts, walk
        holes = tuple(p for p, x in enumerate(ins) if x is None)
        invals = [
            jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype) if x is None else x
            for a, x in zip(eqn.invars, ins, strict=True)
        ]
        if all(math.prod(invals[p].shape) == 0 for p in holes):  # nothing to rebuild
            new = [jnp.zeros(x.shape, x.dtype) if p in holes else x for p, x in enumerate(invals)]
            return new, None, None, None
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
                    f"operand {p} as {aval_str(got)}, expected {aval_str(aval)}."
                )
        ok, guard, bound, own = None, self.rule.guard, self.rule.bound, None
        if assessment.lossy is not None and guard is not None:  # lossy: the guard said why
            ok = guard.ok(invals, list(outs), new, holes, **eqn.params)
        if assessment.bounded is not None and bound is not None:
            tol = _primitive_rules.tolerance(assessment.rtol, new[holes[0]].dtype)
            per_element = bound.error(invals, list(outs), new, holes, **eqn.params)
            rel = _primitive_rules.relative(per_element, new[holes[0]])
            ok = rel <= tol if ok is None else ok & (rel <= tol)
            zero = jnp.zeros((), jnp.float32)
            own = _errors.summarize(
                jnp.broadcast_to(per_element, new[holes[0]].shape), new[holes[0]], zero
            )
        new_errs = None
        if errs is not None:
            new_errs = self._inherited(eqn, invals, outs, new, holes, errs)
            if own is not None:
                new_errs[holes[0]] = _errors.add(new_errs[holes[0]], own)
        return [new[p] if x is None else x for p, x in enumerate(ins)], None, ok, new_errs

    def _inherited(self, eqn, invals, outs, new, holes, errs) -> list:
        """The errors the rebuilt operands inherit from the known operands and the outputs
        (first order, through the inverse rule)."""
        in_errs, out_errs = errs
        known = [p for p in range(len(invals)) if p not in holes]

        def inverse(known_vals, out_vals):
            args = list(invals)
            for p, v in zip(known, known_vals, strict=True):
                args[p] = v
            again = self.rule.inverse(args, out_vals, **eqn.params)
            return [again[p] for p in holes]

        got = _errors.inherited(
            inverse,
            [invals[p] for p in known],
            outs,
            [in_errs[p] for p in known] + list(out_errs),
            [new[p] for p in holes],
        )
        new_errs: list = [None] * len(invals)
        for p, e in zip(holes, got, strict=True):
            new_errs[p] = e
        return new_errs


class CallRule:
    """A call: its body is walked. ``fused`` bodies give cotangents too; own-derivative ones
    (custom_jvp / custom_vjp) only rebuild, and the walk differentiates the call itself."""

    reads = None

    def __init__(self, body: Callable[[core.JaxprEqn], Any], *, fused: bool):
        self.body, self.fused = body, fused

    def reconstructs(self, eqn, position):
        inner, consts = open_jaxpr(self.body(eqn))
        return input_rebuildable(inner, len(consts) + position)

    def assess(self, analysis, eqn, unknown):
        inner, consts = open_jaxpr(self.body(eqn))
        num_consts = len(consts)
        known_in = (True,) * num_consts + tuple(p not in unknown for p in range(len(eqn.invars)))
        sub = analysis.nested(inner, known_in, (True,) * len(inner.outvars))
        if isinstance(sub, str):
            return Assessment(f"its body cannot be inverted: {sub}")
        return Assessment(sub=sub, lossy=sub.lossy, rtol=analysis.rtol)

    def run(self, eqn, assessment, ins, outs, couts, walk, errs=None):
        _, consts = open_jaxpr(self.body(eqn))
        num_consts = len(consts)
        want = couts if self.fused else None
        inner_errs = None if errs is None else ([None] * num_consts + errs[0], errs[1])
        rebuilt, inner_cts, code, new_errs = walk(
            assessment.sub, consts + list(ins), outs, want, errs=inner_errs
        )
        cts = inner_cts[num_consts:] if inner_cts is not None else None
        return rebuilt[num_consts:], cts, code, new_errs[num_consts:]


class ScanRule:
    """A ``scan`` of an invertible body: a reverse scan that rebuilds and differentiates one
    iteration at a time (memory flat in the scan length)."""

    fused, reads = True, None

    def reconstructs(self, eqn, position):
        num_consts, num_carry = eqn.params["num_consts"], eqn.params["num_carry"]
        if position < num_consts + num_carry:
            return position >= num_consts
        inner, body_consts = open_jaxpr(eqn.params["jaxpr"])
        return input_rebuildable(inner, len(body_consts) + position)

    def assess(self, analysis, eqn, unknown):
        num_consts, num_carry = eqn.params["num_consts"], eqn.params["num_carry"]
        if any(p < num_consts for p in unknown):
            return Assessment("its loop-invariant operands (weights) must be known first")
        inner, body_consts = open_jaxpr(eqn.params["jaxpr"])
        xs_known = tuple(p not in unknown for p in range(num_consts + num_carry, len(eqn.invars)))
        known_in = (True,) * (len(body_consts) + num_consts) + (False,) * num_carry + xs_known
        sub = analysis.nested(inner, known_in, (True,) * len(inner.outvars))
        if isinstance(sub, str):
            return Assessment(f"its body cannot be inverted: {sub}")
        return Assessment(sub=sub, lossy=sub.lossy, rtol=analysis.rtol)

    def run(self, eqn, assessment, ins, outs, couts, walk, errs=None, sketches=None, anchor=None):
        """``sketches``: the forward pass's, per iteration (``_scan_sketch``); ``anchor``: the
        scan's first carry, kept by ``fallback="recompute"`` (``_scan_recompute``)."""
        params = eqn.params
        num_consts, num_carry = params["num_consts"], params["num_carry"]
        _, body_consts = open_jaxpr(params["jaxpr"])
        num_body_consts = len(body_consts)
        consts, xs = list(ins[:num_consts]), list(ins[num_consts + num_carry :])
        avals = [a.aval for a in eqn.invars]
        const_avals, carry_avals = avals[:num_consts], avals[num_consts : num_consts + num_carry]
        xs_avals = avals[num_consts + num_carry :]
        ys, xs_known = list(outs[num_carry:]), [x is not None for x in xs]
        want_cts, checked = couts is not None, assessment.sub.checked

        ct_carry, ct_ys, ct_consts = _initial_cts(couts, carry_avals, ys, const_avals)
        code0 = jnp.zeros((), jnp.int32) if checked else None
        scan_errs = _ScanErrors.of(errs, checked, num_consts, num_carry, carry_avals, xs_known)
        err_c0 = None if scan_errs is None else scan_errs.carry0

        sketches, measure = _scan_sketch.per_iteration(
            None if scan_errs is None else sketches, assessment.sub, want_cts
        )
        usable = anchor is not None and checked and want_cts and all(xs_known)
        recompute, tally, n0 = _scan_recompute.prepare(eqn, consts, xs, usable)

        def body(state, per_iter):
            carry, ct_c, ct_k, code, err_c, n = state
            y, ct_y, x, sk, k = per_iter
            given_x = [v if known else None for v, known in zip(x, xs_known, strict=True)]
            inner_in = body_consts + consts + [None] * num_carry + given_x
            inner_errs = None if scan_errs is None else scan_errs.inner(err_c, num_body_consts)
            with _errors.untied():  # an iteration's values die with it (see untied)
                rebuilt, inner_cts, inner_code, new_errs = walk(
                    assessment.sub,
                    inner_in,
                    list(carry) + list(y),
                    None if ct_c is None else list(ct_c) + list(ct_y),
                    errs=inner_errs,
                    sketches=measure(sk),
                )
            if recompute is None:
                code = combine_codes(code, inner_code)
            rebuilt = rebuilt[num_body_consts:]
            new_carry = rebuilt[num_consts : num_consts + num_carry]
            x_rec = [
                r if not known else None
                for r, known in zip(rebuilt[num_consts + num_carry :], xs_known, strict=True)
            ]
            new_err_c, x_err = None, None
            if scan_errs is not None:
                new_err_c, x_err = scan_errs.split(new_errs[num_body_consts:], xs_avals)
            if inner_cts is None:  # no cotangents wanted (ct_c is None)
                return (new_carry, None, None, code, new_err_c, n), (x_rec, None, x_err)
            const_cts, new_ct_c, ct_x = _split_cts(
                inner_cts[num_body_consts:], (const_avals, carry_avals, xs_avals)
            )
            if recompute is not None and inner_code is not None:  # recomputed where it failed
                walked = (new_carry, new_ct_c, const_cts, ct_x)
                (new_carry, new_ct_c, const_cts, ct_x), new_err_c = _scan_recompute.where_failed(
                    inner_code, recompute, (anchor, k, ct_c, ct_y), walked, new_err_c
                )
                n = None if n is None else n + (inner_code != 0).astype(jnp.int32)
            new_ct_k = [
                None if acc is None else (acc if c is None else acc + c)
                for acc, c in zip(ct_k, const_cts, strict=True)
            ]
            return (new_carry, new_ct_c, new_ct_k, code, new_err_c, n), (x_rec, ct_x, x_err)

        init = (list(outs[:num_carry]), ct_carry, ct_consts, code0, err_c0, n0)
        known_xs = [x if known else None for x, known in zip(xs, xs_known, strict=True)]
        per_iter = (ys, ct_ys, known_xs, sketches, jnp.arange(params["length"]))
        (carry0, ct_c0, ct_k, code, err_c, n), (x_rec, ct_x, x_err) = _named_axes.scan(
            body, init, per_iter, length=params["length"], reverse=not params["reverse"]
        )
        _scan_recompute.counted(tally, n)
        new_xs = [r if x is None else x for r, x in zip(x_rec, xs, strict=True)]
        rebuilt = consts + list(carry0) + new_xs
        new_errs = None if scan_errs is None else scan_errs.result(err_c, x_err)
        if not want_cts:
            return rebuilt, None, code, new_errs
        assert ct_k is not None and ct_c0 is not None and ct_x is not None  # wanted: carried
        return rebuilt, list(ct_k) + list(ct_c0) + list(ct_x), code, new_errs


class IVJPRule:
    """A ``custom_ivjp`` call: its user rule gives both the inputs and their cotangents."""

    fused, reads = True, None

    def reconstructs(self, eqn, position):
        num_consts = ivjp_num_consts(eqn)
        return position >= num_consts and not ivjp_bwd(eqn).known_mask[position - num_consts]

    def assess(self, analysis, eqn, unknown):
        del analysis
        if not all(self.reconstructs(eqn, p) for p in unknown):
            return Assessment("its rule needs the known_argnums arguments (and constants) known")
        return Assessment()

    def run(self, eqn, assessment, ins, outs, couts, walk, errs=None):
        del assessment, walk
        bwd = ivjp_bwd(eqn)
        num_consts = ivjp_num_consts(eqn)
        # The rule is always given cotangents (zeros where the walk only rebuilds the inputs:
        # the cotangents it then returns are unused, and XLA drops their computation).
        zeros = [zeros_ct(core.typeof(o)) for o in outs]
        dys = (
            zeros
            if couts is None
            else [z if c is None else c for c, z in zip(couts, zeros, strict=True)]
        )
        given = list(ins[num_consts:])
        xs, dxs = bwd.apply(given, list(outs), dys)
        cts = [None] * num_consts + dxs if couts is not None else None
        new_errs = None
        if errs is not None:  # the user's inverse, linearized in the known values it reads
            known = [k for k, x in enumerate(given) if x is not None]
            holes = [k for k, x in enumerate(given) if x is None]

            def inverse(known_vals, out_vals):
                args = list(given)
                for k, v in zip(known, known_vals, strict=True):
                    args[k] = v
                new = bwd.apply(args, out_vals, [jnp.zeros_like(y) for y in out_vals])[0]
                return [new[k] for k in holes]

            got = _errors.inherited(
                inverse,
                [given[k] for k in known],
                outs,
                [errs[0][num_consts + k] for k in known] + list(errs[1]),
                [xs[k] for k in holes],
            )
            new_errs = [None] * len(ins)
            for k, e in zip(holes, got, strict=True):
                new_errs[num_consts + k] = e
        return list(ins[:num_consts]) + xs, cts, None, new_errs


class TilingRule:
    """Slices that tile their operand (``x[:, :8]`` and ``x[:, 8:]``; ``x[:, ::2]`` and
    ``x[:, 1::2]``): each of them rebuilds its operand from all of them (see ``_tiling``)."""

    fused = False

    def __init__(self, members: tuple[core.JaxprEqn, ...]):
        self.slices = [_tiling.slice_params(e) for e in members]
        self.reads = tuple(e.outvars[0] for e in members)

    def reconstructs(self, eqn, position):
        del eqn
        return position == 0

    def assess(self, analysis, eqn, unknown):
        del analysis, eqn, unknown
        return Assessment()  # data movement: exact for every value and dtype

    def run(self, eqn, assessment, ins, outs, couts, walk, errs=None):
        del assessment, ins, couts, walk
        shape = eqn.invars[0].aval.shape

        def inverse(known, pieces):
            del known
            return [_tiling.assemble(shape, self.slices, pieces)]

        (x,) = inverse([], outs)
        new_errs = None
        if errs is not None:  # the pieces' errors, each element's from the piece holding it
            new_errs = _errors.inherited(inverse, [], outs, list(errs[1]), [x])
        return [x], None, None, new_errs


def outputs_read(rule: EquationRule, eqn: core.JaxprEqn) -> tuple[Any, ...]:
    """What an inversion of ``eqn`` by ``rule`` reads besides its known operands: the
    equation's outputs, or every slice of a tiling (``DropVar`` for a dropped output)."""
    return tuple(eqn.outvars) if rule.reads is None else rule.reads


# --- which rule an equation gets -----------------------------------------------------------------


def ivjp_bwd(eqn: core.JaxprEqn) -> Any:
    """The custom_ivjp backward object of a custom_vjp equation, or None."""
    bwd = custom_vjp_bwd(eqn)
    return bwd if getattr(bwd, "is_custom_ivjp", False) else None


def ivjp_fun(eqn: core.JaxprEqn) -> Any:
    """The jaxpr of the function a custom_ivjp equation calls (either custom_vjp staging)."""
    if eqn.primitive is custom_vjp_call_p:
        return eqn.params["call_jaxpr"]
    return _custom_vjp3_body(eqn)


def ivjp_num_consts(eqn: core.JaxprEqn) -> int:
    return eqn.params.get("num_consts", 0) if eqn.primitive is custom_vjp_call_p else 0


def verify_custom_rules(jaxpr: core.Jaxpr) -> None:
    """Checks the rule of every ``custom_ivjp`` call in ``jaxpr`` (bodies included) once per
    input signature, at random inputs (``_IVJPBwd.verify``): the walk trusts these rules."""
    for eqn in jaxpr.eqns:
        bwd = ivjp_bwd(eqn)
        if bwd is not None:
            ins = eqn.invars[ivjp_num_consts(eqn) :]
            bwd.verify([a.aval for a in ins], [v.aval for v in eqn.outvars])
            continue
        for sub in sub_jaxprs(eqn):
            verify_custom_rules(open_jaxpr(sub)[0])


def linked(jaxpr: core.Jaxpr) -> set[core.Var]:
    """Values joined to the outputs by a chain of operand positions some rule rebuilds.

    Only these can ever be reconstructed: an input outside the set (a weight that feeds only
    ``dot_general`` / ``tanh``, even through a ``squeeze``) must be kept.
    """
    reach = {v for v in jaxpr.outvars if is_var(v)}
    # Reversed program order: a tiling is complete at its first slice, after every reader of
    # every slice of it.
    for eqn, rule in reversed(list(zip(jaxpr.eqns, rules_of(jaxpr)[0], strict=True))):
        reads = eqn.outvars if rule is None else outputs_read(rule, eqn)
        if rule is None or not reads or not all(is_var(v) and v in reach for v in reads):
            continue
        reach.update(a for p, a in enumerate(eqn.invars) if is_var(a) and rule.reconstructs(eqn, p))
    return reach


def input_rebuildable(jaxpr: core.Jaxpr, position: int) -> bool:
    """Whether input ``position`` of a body could ever be rebuilt from its outputs."""
    return jaxpr.invars[position] in linked(jaxpr)


def _custom_vjp3_body(eqn: core.JaxprEqn) -> Any:
    return eqn.params["_prim"].traced.jaxpr


_CALLS: dict[Any, EquationRule] = {
    jit_p: CallRule(lambda e: e.params["jaxpr"], fused=True),
    core.closed_call_p: CallRule(lambda e: e.params["call_jaxpr"], fused=True),
    remat_p: CallRule(lambda e: e.params["jaxpr"], fused=True),
    custom_jvp_call_p: CallRule(lambda e: e.params["call_jaxpr"], fused=False),
    custom_vjp_call_p: CallRule(lambda e: e.params["call_jaxpr"], fused=False),
}
_HI: dict[str, EquationRule] = {
    "remat": CallRule(lambda e: e.params["_prim"].jaxpr, fused=True),
    "custom_vjp": CallRule(_custom_vjp3_body, fused=False),
}
_SCAN, _IVJP = ScanRule(), IVJPRule()


def rules_of(jaxpr: core.Jaxpr) -> tuple[list[EquationRule | None], dict[int, str]]:
    """The rule of each equation of ``jaxpr`` (the slices of a tiling share one), and why each
    slice in no tiling does not rebuild its operand."""
    rules = [rule_for(e) for e in jaxpr.eqns]
    found = _tiling.tilings(jaxpr)
    for group in found.groups:
        rule = TilingRule(tuple(jaxpr.eqns[i] for i in group))
        for i in group:
            rules[i] = rule
    return rules, found.refused


def rule_for(eqn: core.JaxprEqn) -> EquationRule | None:
    """The rule that inverts ``eqn``, or None if it has none."""
    if ivjp_bwd(eqn) is not None:
        return _IVJP
    kind = hi_kind(eqn)
    if kind is not None and kind != "name":
        return _HI[kind]
    if eqn.primitive in _CALLS:
        return _CALLS[eqn.primitive]
    if eqn.primitive is scan_p:
        return _SCAN
    # checkpoint_name under jax_remat3 is a hi primitive: the registry's rule for name_p.
    rule = _primitive_rules.lookup(prims.name_p if kind == "name" else eqn.primitive)
    return None if rule is None else SimpleRule(rule)
