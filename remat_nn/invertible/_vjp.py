"""The ``jax.custom_vjp`` of an analysed function: a forward pass that keeps the outputs, the
inputs the walk needs and the sketches of the values it will rebuild, and a backward pass that
walks the jaxpr (``_walk.execute``) and judges its run-time checks (``_verdict``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from remat_nn import _drift, _named_axes
from remat_nn.invertible import _errors, _scan_sketch, _sketch, _verdict
from remat_nn.invertible._analysis import Analysis
from remat_nn.invertible._jaxpr import eval_eqn, eval_jaxpr, is_float
from remat_nn.invertible._scan_sketch import sketched
from remat_nn.invertible._walk import (
    WalkSchedule,
    anchor_key,
    anchored_scans,
    execute,
    scan_key,
    sketched_scans,
    stop_on_failed_check,
)


def run_and_sketch(
    schedule: WalkSchedule, ins: Sequence[Any], anchored: bool = False
) -> tuple[list, Any]:
    """The outputs, and the sketches of the values ``schedule`` derives from rebuilt ones
    (``_scan_sketch.sketched``; value ``k`` at row ``k``) packed in two arrays, whatever
    the depth: ``(m,)`` float32 scales and ``(m, K)`` int32 projections (None if none); the
    per-iteration sketches inside the scans it undoes (``_scan_sketch``), by equation; and if
    ``anchored``, the first carry of each scan ``fallback="recompute"`` recomputes in
    (``_scan_recompute``), by equation."""
    analysis = schedule.analysis
    jaxpr, values = analysis.jaxpr, sketched(schedule)
    in_scans: dict[int, Any] = {}
    anchors: dict[int, list] = {}

    def sketching(i: int, body: Any, body_values: list) -> Callable[[list], list]:
        def run(ins: list) -> list:
            outs, in_scans[i] = _scan_sketch.forward(jaxpr.eqns[i], body, body_values, ins)
            return outs

        return run

    def anchoring(i: int, run: Callable[[list], list] | None) -> Callable[[list], list]:
        eqn = jaxpr.eqns[i]
        num_consts, num_carry = eqn.params["num_consts"], eqn.params["num_carry"]

        def anchored_run(ins: list) -> list:
            anchors[i] = list(ins[num_consts : num_consts + num_carry])
            return run(ins) if run is not None else eval_eqn(eqn, ins)

        return anchored_run

    packed = {
        "tops": jnp.zeros((len(values),), jnp.float32),
        "projections": jnp.zeros((len(values), _sketch.K), jnp.int32),
    }

    def sketch(k: int, x: Any) -> Any:
        # Taken as soon as the value is made and written in place: taken after the forward
        # pass, the sketches held its activations until then (temp above plain autodiff's).
        # Not tied to the value by an optimization barrier: that makes XLA round a 16-bit
        # value where the forward pass kept excess precision (gradients off by bfloat16's eps).
        top, projection = _sketch.sketch(x)
        packed["tops"] = packed["tops"].at[k].set(top)
        packed["projections"] = packed["projections"].at[k].set(projection)
        return x

    runs = {i: sketching(i, body, vs) for i, body, vs in sketched_scans(schedule)}
    if anchored:
        runs.update((i, anchoring(i, runs.get(i))) for i in anchored_scans(schedule))
    outs, _ = eval_jaxpr(jaxpr, ins, values, runs, tap=sketch)
    if not values:
        return outs, (None, in_scans, anchors)
    return outs, ((packed["tops"], packed["projections"]), in_scans, anchors)


def by_value(schedule: WalkSchedule, packed: Any) -> dict:
    """The sketches of :func:`run_and_sketch` as the walk reads them: value -> sketch,
    ``scan_key(i)`` -> a scan's per-iteration sketches (``_scan_sketch.ScanSketches``) and
    ``anchor_key(i)`` -> a scan's first carry."""
    values, in_scans, anchors = packed
    out: dict[Any, Any] = {}
    if values is not None:
        tops, projections = values
        out = {v: (tops[k], projections[k]) for k, v in enumerate(sketched(schedule))}
    for i, _, _ in sketched_scans(schedule):
        out[scan_key(i)] = in_scans[i]
    out.update((anchor_key(i), anchor) for i, anchor in anchors.items())
    return out


def as_custom_vjp(
    analysis: Analysis, recompute: bool = False, report: bool = False, conditioned: bool = False
) -> Callable:
    """``recompute``: ``fallback="recompute"``, which also keeps each checked scan's first
    carry and recomputes an iteration that fails a check from it (``_scan_recompute``).
    ``report``: the last input is a drift probe (``remat_nn._drift.report_drift_to``) whose
    cotangent counts [failed checks, recomputed iterations]; no host callback is staged.
    ``conditioned`` (``rn.invertible``'s default ``rtol``): a derivative check is judged
    against the function's conditioning (``_verdict``), from the norms of its rebuilt inputs
    (kept by the forward: one float32), its outputs and their cotangents."""
    jaxpr = analysis.jaxpr
    float_in = [is_float(v.aval) for v in jaxpr.invars]
    rebuilt = [p for p, f in enumerate(float_in) if f and p not in set(analysis.kept)]
    conditioned = conditioned and analysis.checked and bool(rebuilt)
    eps = _drift.default_eps((), _drift.float_dtypes(jaxpr)) if conditioned else 0.0
    split = (lambda ins: (ins[:-1], ins[-1:])) if report else (lambda ins: (ins, ()))  # noqa: E731

    @jax.custom_vjp
    def run(*ins):
        return eval_jaxpr(jaxpr, split(ins)[0])[0]

    def fwd(*all_ins):
        ins, probe = split(all_ins)
        outs, sketches = run_and_sketch(analysis.schedule(True, False), ins, recompute)
        # Residuals: the outputs (the same buffers as the primal result), the inputs the walk
        # keeps (weights, constants, or inputs no output determines) and a few scalars per
        # value the walk derives from a rebuilt one (_sketch); never an intermediate (with
        # fallback="recompute", a checked scan's first carry: one carry per scan).
        # (Under shard_map, also the input types, for 0 bytes: see remat_nn._named_axes.)
        kept = [ins[p] for p in analysis.kept]
        x_norm = _drift.norm([ins[p] for p in rebuilt]) if conditioned else None
        return outs, (outs, kept, sketches, x_norm, _named_axes.type_witness([*ins, *probe]))

    def bwd(res, cts):
        outs, kept, sketches, x_norm, types = res
        y_norm = dy_norm = None
        if conditioned:  # the norms taken first: taken at the end, y and dy would live to it
            y_norm, dy_norm = _drift.norm(_floats(outs)), _drift.norm(_floats(cts))
            outs = [_errors.after(o, y_norm + dy_norm) if _is_float(o) else o for o in outs]
        invals: list[Any] = [None] * len(jaxpr.invars)
        for p, x in zip(analysis.kept, kept, strict=True):
            invals[p] = x
        with _drift.tally() if report else contextlib.nullcontext([]) as recomputed:  # scans
            _, in_cts, code, _ = execute(
                analysis,
                invals,
                outs,
                list(cts),
                want_inputs=False,
                sketches=by_value(analysis.schedule(True, False), sketches),
            )
        assert in_cts is not None  # execute returns the input cotangents when given cotangents
        in_cts = [c if f else None for c, f in zip(in_cts, float_in, strict=True)]
        allowed = None
        if conditioned:
            dx_norm = _drift.norm(_floats([in_cts[p] for p in rebuilt]))
            allowed = _verdict.allowance(eps, x_norm, y_norm, dy_norm, dx_norm)
            code = _verdict.judged(code, allowed)
        if report:  # a check that failed outside the recomputed scans: counted, not raised
            failed = 0 if code is None else jnp.any(code != 0)
            in_cts.append(_drift.counts(failed, sum(recomputed)))
        else:
            stop_on_failed_check(code, "recompute" if recompute else "error", allowed)
        return tuple(_named_axes.cotangents_like(in_cts, types))

    # Seen by the report. (A function's type declares no attributes: this one is set here.)
    block = getattr(jaxpr.debug_info, "func_name", "?")
    bwd.invertible_block = block  # pyright: ignore[reportFunctionMemberAccess]
    run.defvjp(fwd, bwd)
    return run


def _is_float(x: Any) -> bool:
    """Whether ``x`` is a float array (not None, an integer value or a float0 cotangent)."""
    return x is not None and jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _floats(xs: Sequence[Any]) -> list:
    """The float arrays of ``xs``."""
    return [x for x in xs if _is_float(x)]
