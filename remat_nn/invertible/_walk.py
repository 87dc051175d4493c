"""The backward walk: rebuild values on demand, in lock-step with the cotangents.

``build_schedule`` turns an :class:`Analysis` into a list of steps. With cotangents it visits the
equations from last to first (so each one's output cotangents are complete when it is reached);
before an equation's VJP it derives the operands it lacks by following their recorded
derivations (reconstruct by an inverse rule, or recompute forward), and every value is freed
after its last use, so only about one equation's working set is live. ``execute`` runs the steps.

Inversions whose exactness depends on the values at hand (division by a known operand, ``log``
of an ``exp``) run their rule's guard and bound; every value derived from a rebuilt one carries
an error estimate (``_errors``) and each derivative taken at such values is checked against it.
The worst failed check is reported as an int32 code (``_verdict``; 0: all passed) that
``rn.invertible``'s backward judges and turns into an error at run time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from remat_nn import _drift
from remat_nn._host_errors import raise_from_callback
from remat_nn._jax_internals import core
from remat_nn._named_axes import varying
from remat_nn.errors import NotInvertibleError
from remat_nn.invertible import _errors, _sketch, _verdict
from remat_nn.invertible._equation_rules import (
    Assessment,
    CallRule,
    EquationRule,
    Errors,
    IVJPRule,
    ScanRule,
    combine_codes,
    ivjp_fun,
    outputs_read,
    rule_for,
)
from remat_nn.invertible._jaxpr import display, eqn_vjp, eval_eqn, is_var, read, where
from remat_nn.invertible._primitive_rules import DEFAULT_RTOL
from remat_nn.invertible._scan_sketch import values

_CHECK_MESSAGES: list[str] = []  # check id - 1 -> the error text of a failed run-time check
_CHECK_IDS: dict[str, int] = {}

_FAILED_CHECK = """\
rn.invertible: rebuilding an operand of `{prim}` at {where} from its output lost information at
run time: {reason}. The gradient would not be finite or not be exact, so the step stops here.
Fix: rn.invertible(f, fallback="recompute") keeps the input this value comes from and recomputes
it instead of inverting `{prim}` where a value can destroy it; rn.invertible(f, rtol=...) loosens
the rounding tolerance (relative to the rebuilt tensor's max |value|); or give this part an
explicit inverse with rn.custom_ivjp."""

_AMPLIFIED = """\
rn.invertible: the derivative of `{prim}` at {where} is taken at values the backward rebuilt,
and the rounding error they carry changes it by more than the tolerance of its scale (they
cancelled on the way, or `{prim}` is steep there): the gradient would not be exact, so the step
stops here. Fix: compute this part in a wider dtype (16-bit rounding is what is amplified);
declare the input it comes from with known_argnums / known_argnames, so it is stored instead of
rebuilt; loosen rn.invertible(f, rtol=...); or give this part an explicit inverse with
rn.custom_ivjp."""


@dataclasses.dataclass(frozen=True)
class Derivation:
    """How a value becomes known in the reverse walk."""

    kind: str  # "given" (an output or a kept input) | "forward" | "inverse"
    eqn: int = -1  # the equation evaluated (forward) or undone (inverse)
    unknown: tuple[int, ...] = ()  # inverse: the operand positions it rebuilds together
    assessment: Assessment | None = None  # inverse: the rule's verdict (nested analysis, guard)


class Walkable(Protocol):
    """What the walk reads of an analysis (``_analysis.Analysis``, which builds its schedules
    with :func:`build_schedule`)."""

    @property
    def jaxpr(self) -> core.Jaxpr: ...

    @property
    def eqns(self) -> list[core.JaxprEqn]: ...

    @property
    def known(self) -> Mapping[Any, Derivation]: ...  # every value the walk can know

    @property
    def needs_vjp(self) -> list[bool]: ...

    @property
    def rules(self) -> list[EquationRule | None]: ...

    @property
    def touching(self) -> Mapping[Any, list[int]]: ...

    @property
    def checked(self) -> bool: ...  # some inversion runs a run-time check (guard or bound)

    @property
    def rtol(self) -> float: ...  # the tolerance of the run-time bounds

    def active(self, i: int) -> tuple[int, ...]: ...

    def schedule(self, want_cts: bool, want_inputs: bool) -> Any: ...  # a WalkSchedule


@dataclasses.dataclass
class Step:
    action: str  # "forward" | "inverse" | "fused" (inverse + cotangents) | "vjp"
    eqn: int
    derivation: Derivation | None = None  # inverse / fused: which operands, the rule's verdict
    check: int = 0  # id of the run-time exactness check (0: none)
    free: tuple = ()  # values dead after this step


@dataclasses.dataclass
class WalkSchedule:
    """The steps of one walk over ``analysis.jaxpr``."""

    analysis: Walkable
    steps: list[Step]
    vjp_cache: dict = dataclasses.field(default_factory=dict)  # see _jaxpr.eqn_vjp


def _register_check(eqn, reason: str | None = None) -> int:
    """The id of the check's error text (one id per distinct text: retracing adds none): a
    failed inversion's (``reason``), or else an amplified error's at ``eqn``'s derivative."""
    if reason is not None:
        text = _FAILED_CHECK.format(prim=display(eqn), where=where(eqn), reason=reason)
    else:
        text = _AMPLIFIED.format(prim=display(eqn), where=where(eqn))
    if text not in _CHECK_IDS:
        _CHECK_MESSAGES.append(text)
        _CHECK_IDS[text] = len(_CHECK_MESSAGES)
    return _CHECK_IDS[text]


def build_schedule(analysis: Walkable, want_cts: bool, want_inputs: bool) -> WalkSchedule:
    jaxpr, eqns, known = analysis.jaxpr, analysis.eqns, analysis.known
    avail = {v for v, d in known.items() if d.kind == "given"}
    inverse_of: dict[int, Derivation] = {}
    for d in known.values():
        if d.kind == "inverse":
            inverse_of.setdefault(d.eqn, d)
    steps: list[Step] = []

    def deps(d: Derivation) -> list:
        eqn = eqns[d.eqn]
        if d.kind == "forward":
            return [a for a in eqn.invars if is_var(a)]
        return [v for v in _reads(analysis, d.eqn) if is_var(v)] + [
            a for p, a in enumerate(eqn.invars) if is_var(a) and p not in d.unknown
        ]

    def emit(d: Derivation, action: str) -> None:
        eqn = eqns[d.eqn]
        if d.kind == "forward":
            steps.append(Step("forward", d.eqn))
            avail.update(v for v in eqn.outvars if is_var(v))
            return
        a = d.assessment
        why = None if a is None else "; or ".join(w for w in (a.lossy, a.bounded) if w)
        check = _register_check(eqn, why) if why else 0
        steps.append(Step(action, d.eqn, d, check))
        avail.update(a for p, a in enumerate(eqn.invars) if p in d.unknown and is_var(a))

    def ensure(v) -> None:
        stack = [v]
        while stack:
            u = stack[-1]
            if u in avail:
                stack.pop()
                continue
            d = known[u]
            missing = [w for w in deps(d) if w not in avail]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            emit(d, "inverse")

    if want_cts:
        for i in reversed(range(len(eqns))):
            if not analysis.needs_vjp[i]:
                continue
            rule, d = analysis.rules[i], inverse_of.get(i)
            if rule is not None and rule.fused and d is not None:
                for w in deps(d):
                    ensure(w)
                emit(d, "fused")
            else:
                for a in eqns[i].invars:
                    if is_var(a):
                        ensure(a)
                steps.append(Step("vjp", i))
    if want_inputs:  # a body's caller (or a check) wants the unknown inputs back
        for v in jaxpr.invars:
            if v in analysis.touching or v in jaxpr.outvars:
                ensure(v)

    _set_frees(analysis, steps)
    return WalkSchedule(analysis, steps)


def _reads(analysis: Walkable, i: int) -> tuple:
    """What inverting equation ``i`` reads besides its known operands (see ``outputs_read``)."""
    rule, eqn = analysis.rules[i], analysis.eqns[i]
    return tuple(eqn.outvars) if rule is None else outputs_read(rule, eqn)


def _set_frees(analysis: Walkable, steps: list[Step]) -> None:
    """Sets each step's ``free``: the values (not inputs) no later step reads or writes."""
    last: dict[Any, int] = {}
    for k, step in enumerate(steps):
        eqn = analysis.eqns[step.eqn]
        inverts = step.action in ("inverse", "fused")
        for a in (*eqn.invars, *eqn.outvars, *(_reads(analysis, step.eqn) if inverts else ())):
            if is_var(a):
                last[a] = k
    keep = set(analysis.jaxpr.invars)
    frees: list[list] = [[] for _ in steps]
    for v, k in last.items():
        if v not in keep:
            frees[k].append(v)
    for step, free in zip(steps, frees, strict=True):
        step.free = tuple(free)


def scan_key(eqn: int) -> tuple[str, int]:
    """The key of a scan's per-iteration sketches among a walk's sketches."""
    return ("scan", eqn)


def anchor_key(eqn: int) -> tuple[str, int]:
    """The key of a scan's first carry (``_scan_recompute``) among a walk's sketches."""
    return ("anchor", eqn)


def _checked_scans(schedule: WalkSchedule) -> Iterator[tuple[Step, Any]]:
    """``(step, body analysis)`` of each scan the walk undoes whose body's walk runs checks."""
    for step in schedule.steps:
        if step.action not in ("inverse", "fused") or step.derivation is None:
            continue
        assessment = step.derivation.assessment
        sub = None if assessment is None else assessment.sub
        if isinstance(schedule.analysis.rules[step.eqn], ScanRule) and sub is not None:
            if sub.checked:
                yield step, sub


def anchored_scans(schedule: WalkSchedule) -> list[int]:
    """The scans whose first carry ``fallback="recompute"`` keeps (``_scan_recompute``): those
    the walk undoes with cotangents whose body's walk runs checks and whose ``xs`` it knows
    (a rebuilt ``xs`` has nothing to replay from)."""
    out = []
    for step, _ in _checked_scans(schedule):
        params = schedule.analysis.eqns[step.eqn].params
        first_x = params["num_consts"] + params["num_carry"]
        assert step.derivation is not None  # _checked_scans yields derived steps
        if step.action == "fused" and all(p < first_x for p in step.derivation.unknown):
            out.append(step.eqn)
    return out


def sketched_scans(schedule: WalkSchedule) -> list[tuple[int, Any, list]]:
    """The scans the forward pass sketches at every iteration for this walk
    (``_scan_sketch``), those the walk undoes whose body's inversions are checked, each with
    its body's jaxpr and the body values it sketches: ``(equation, body, values)``."""
    out = []
    for step, sub in _checked_scans(schedule):
        body_values = values(sub, step.action == "fused")
        if body_values:
            out.append((step.eqn, sub.jaxpr, body_values))
    return out


def _tie(env: dict, vs: list, code: Any) -> Any:
    """Makes the rebuilt float values ``vs`` depend on the running check ``code`` at no cost
    (``_errors.after``: ``x`` bit for bit), so XLA folds each step's check in as the walk goes
    instead of holding every step's scalar until the end. Returns ``code``."""
    for v in vs:
        x = env.get(v) if is_var(v) else None
        if x is not None and jnp.issubdtype(x.dtype, jnp.floating):
            env[v] = _errors.after(x, code)
    return code


def _accumulate(ct: dict, v: Any, c: Any) -> None:
    if c is None or jax.dtypes.result_type(c) == jax.dtypes.float0:
        return
    ct[v] = c if v not in ct else ct[v] + c


def _body_of(eqn: core.JaxprEqn) -> Any:
    """The body a call-like equation evaluates (None for any other equation). A custom_ivjp
    call's is its function: the errors its rebuilt inputs carry are propagated, and its
    derivatives checked, through the function itself (JAX cannot linearize a custom_vjp)."""
    rule = rule_for(eqn)
    if isinstance(rule, IVJPRule):
        return ivjp_fun(eqn)
    return rule.body(eqn) if isinstance(rule, CallRule) else None


@dataclasses.dataclass
class _State:
    """One walk's values, errors (see ``_errors``: absent means exact), cotangents and check."""

    analysis: Walkable
    schedule: WalkSchedule
    env: dict
    err: dict
    ct: dict
    code: Any = None
    sketches: Mapping[Any, _sketch.Sketch] = dataclasses.field(default_factory=dict)

    def known_errs(self, eqn, unknown, reads) -> Errors | None:
        """The errors an inverse rule gets: of its known operands and of what it reads (its
        outputs; None if no value here can carry one)."""
        if not (self.analysis.checked or self.err):
            return None
        ins = [
            None if p in unknown or not is_var(a) else self.err.get(a)
            for p, a in enumerate(eqn.invars)
        ]
        return ins, [self.err.get(v) if is_var(v) else None for v in reads]

    def carry(self, v, e) -> None:
        """Records ``v``'s error, computed at this step (the value depends on it); capped by
        the drift measured against the forward pass's sketch of ``v``, if it kept one."""
        if v in self.sketches:
            measured, top = _sketch.measure(self.env[v], self.sketches[v])
            # Under shard_map the packed sketches vary over every value's axes: a value
            # varying over fewer keeps its propagated error (its type must not change).
            if varying(measured) <= varying(self.env[v]):
                e = _sketch.capped(e, top, measured)
        self.err[v], self.env[v] = e, _errors.after(self.env[v], sum(e))

    def forward(self, eqn) -> None:
        ins = [read(self.env, a) for a in eqn.invars]
        outs = eval_eqn(eqn, ins)
        self.env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True) if is_var(v))
        in_errs = [self.err.get(a) if is_var(a) else None for a in eqn.invars]
        if any(e is not None for e in in_errs) or _errors.recomputes_16_bit(eqn, _body_of):
            for v, e in zip(
                eqn.outvars, _errors.forward(eqn, ins, outs, in_errs, _body_of), strict=True
            ):
                if e is not None and is_var(v):
                    self.carry(v, e)

    def inverse(self, step: Step, eqn, fused: bool) -> None:
        d, env = step.derivation, self.env
        assert d is not None  # an inverse step has its derivation
        rule = self.analysis.rules[step.eqn]
        assert rule is not None and d.assessment is not None  # an inverse step has both
        ins = [None if p in d.unknown else read(env, a) for p, a in enumerate(eqn.invars)]
        reads = outputs_read(rule, eqn)
        outs = [env[v] for v in reads]
        couts = [self.ct.pop(v, None) for v in eqn.outvars] if fused else None
        errs = self.known_errs(eqn, d.unknown, reads)
        extra = {
            name: self.sketches[key]
            for name, key in (("sketches", scan_key(step.eqn)), ("anchor", anchor_key(step.eqn)))
            if key in self.sketches
        }
        rebuilt, in_cts, result, new_errs = rule.run(
            eqn, d.assessment, ins, outs, couts, execute, errs, **extra
        )
        fresh = [p for p in d.unknown if eqn.invars[p] not in env]
        for p in d.unknown:
            env.setdefault(eqn.invars[p], rebuilt[p])
        if result is not None and jnp.result_type(result) == np.bool_:  # a guard's
            result = _verdict.encode(result, step.check)
        self.code = combine_codes(self.code, result)
        if result is not None:
            self.code = _tie(env, [eqn.invars[p] for p in d.unknown], self.code)
        # The errors rebuilt values inherit are judged where they matter: at the derivatives
        # taken at them (a value a coupling only adds needs no digits of its own).
        for p in fresh:
            e = new_errs[p] if new_errs else None
            if e is not None and _errors.floating(rebuilt[p]):
                self.carry(eqn.invars[p], e)
        for a, c in zip(eqn.invars, in_cts or (), strict=False):
            if is_var(a):
                _accumulate(self.ct, a, c)

    def vjp(self, step: Step, eqn) -> None:
        couts = [self.ct.pop(v, None) if is_var(v) else None for v in eqn.outvars]
        if all(c is None for c in couts):
            return
        ins = [read(self.env, a) for a in eqn.invars]
        active = self.analysis.active(step.eqn)
        in_errs = [self.err.get(a) if is_var(a) else None for a in eqn.invars]
        flag = None
        if any(e is not None for e in in_errs):
            move = _errors.derivative_excess(
                eqn, ins, in_errs, active, self.analysis.rtol, _body_of
            )
            flag = _verdict.encode(move, _register_check(eqn))
            self.code = combine_codes(self.code, flag)
        in_cts = eqn_vjp(eqn, ins, couts, self.schedule.vjp_cache, active)
        for a, c in zip(eqn.invars, in_cts, strict=True):
            if is_var(a):
                if flag is not None and c is not None and jnp.issubdtype(c.dtype, jnp.floating):
                    c = _errors.after(c, self.code)  # the check runs at its step
                _accumulate(self.ct, a, c)


def execute(
    analysis: Walkable,
    invals: list[Any],
    outvals: list[Any],
    out_cts: list[Any] | None,
    *,
    want_inputs: bool = True,
    errs: Errors | None = None,
    sketches: Mapping[Any, _sketch.Sketch] | None = None,
) -> tuple[list[Any], list[Any] | None, Any, list[Any]]:
    """Runs the walk of ``analysis``.

    Args:
      analysis: a successful analysis.
      invals: the jaxpr's inputs, ``None`` where unknown (to rebuild).
      outvals: its outputs.
      out_cts: output cotangents (``None`` entries are zeros), or ``None`` to only rebuild.
      want_inputs: rebuild every unknown input (a body's caller needs them; the top-level
        backward does not).
      errs: the errors (see ``_errors``; ``None``: exact) the known inputs and the outputs
        carry from an enclosing walk, as (inputs, outputs).
      sketches: the forward pass's sketches of values of ``analysis.jaxpr`` (``_sketch``:
        value -> sketch), which cap the errors the walk carries for them.

    Returns:
      All inputs (rebuilt where they were ``None``), their cotangents (``None`` for zero; the
      whole list ``None`` when ``out_cts`` is), the failed-check code (None if unchecked) and
      the inputs' errors (``None``: exact).
    """
    want_cts = out_cts is not None
    schedule = analysis.schedule(want_cts, want_inputs)
    jaxpr, eqns = analysis.jaxpr, analysis.eqns
    env: dict[Any, Any] = {v: x for v, x in zip(jaxpr.invars, invals, strict=True) if x is not None}
    env.update(
        (v, x) for v, x in zip(jaxpr.outvars, outvals, strict=True) if is_var(v) and x is not None
    )
    state = _State(analysis, schedule, env, {}, {}, sketches=sketches or {})
    if errs is not None:
        for vs, es in zip((jaxpr.invars, jaxpr.outvars), errs, strict=True):
            state.err.update(
                (v, e) for v, e in zip(vs, es, strict=True) if is_var(v) and e is not None
            )
    if want_cts:
        for v, c in zip(jaxpr.outvars, out_cts, strict=True):
            if is_var(v):
                _accumulate(state.ct, v, c)
    for step in schedule.steps:
        eqn = eqns[step.eqn]
        if step.action == "forward":
            state.forward(eqn)
        elif step.action in ("inverse", "fused"):
            state.inverse(step, eqn, fused=step.action == "fused")
        else:
            state.vjp(step, eqn)
        for v in step.free:
            env.pop(v, None)
            state.err.pop(v, None)
    new_in = [env.get(v, x) for v, x in zip(jaxpr.invars, invals, strict=True)]
    cts = [state.ct.get(v) for v in jaxpr.invars] if want_cts else None
    return new_in, cts, state.code, [state.err.get(v) for v in jaxpr.invars]


#: Appended to a failed check's text: what ``fallback`` could do about it.
_FALLBACK_NOTES = {
    "error": """
With fallback="recompute", an iteration of a top-level `jax.lax.scan` over stacked weights whose
check fails is recomputed from the scan's first carry instead (write repeated layers as one).""",
    "recompute": """
fallback="recompute" could not recompute it: it recomputes only iterations of a `jax.lax.scan`
at the top level of f whose per-iteration inputs are known (stacked weights), and this check is
outside one (an unrolled Python loop, a scan nested in a body or over rebuilt inputs). Write
the repeated layers as such a scan to have them recomputed instead of refused.""",
}


def stop_on_failed_check(code: Any, fallback: str | None = None, allowed: Any = None) -> None:
    """Stages a host callback that raises the error of the failed check in ``code`` (an int32
    code from :func:`execute`, judged: ``_verdict.judged``; None: nothing was checked, nothing
    is staged), run only where a check failed (``_drift.report_if``: a step whose checks pass
    makes no host round trip, which cost the depth benchmark's 8-layer step 0.5 ms of its 6).
    Under ``jit`` the refusal is in the error's first lines: :mod:`remat_nn._host_errors`.
    Given the gradient's ``fallback`` (``rn.invertible``'s), the text ends with what it could
    do: a check that reaches here failed outside the scans ``fallback="recompute"`` recomputes
    in; given the tolerance the function's conditioning ``allowed``, it says so.
    """
    if code is not None:
        note = "" if fallback is None else _FALLBACK_NOTES[fallback]
        allowed = jnp.float32(-1.0) if allowed is None else allowed
        _drift.report_if(code != 0, functools.partial(_raise_failed_check, note), code, allowed)


_CONDITIONED = """
The derivative moved by up to {move:.2g} of its scale; the tolerance was at least {tol:.2g}
(rn.invertible's default: 1e-2 of the derivative's scale, or 8 epsilons of the narrowest dtype
the value came through if more (bfloat16: 0.0625), or if more still the square root of epsilon
times the function's relative condition number, measured by this backward pass, up to {most:g})."""


def _raise_failed_check(note: str, code: Any, allowed: Any) -> None:
    codes, allowed = np.asarray(code).ravel(), np.broadcast_to(allowed, np.shape(code)).ravel()
    failed = np.flatnonzero(codes)
    if failed.size:
        k, failed_code = failed[0], int(codes[failed[0]])
        text = _CHECK_MESSAGES[_verdict.check_id(failed_code) - 1]
        move = _verdict.bound(failed_code)
        if move is not None and allowed[k] >= 0:
            tol = max(float(allowed[k]), _errors.DERIVATIVE_SLACK * DEFAULT_RTOL)
            text += _CONDITIONED.format(move=move, tol=tol, most=_verdict.MAX_MOVE)
        raise_from_callback(NotInvertibleError(text + note))
