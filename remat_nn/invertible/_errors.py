"""The rounding error rebuilt values carry into what the backward walk computes from them.

A bounded inversion rebuilds its operand within a run-time bound of that operand's scale. The
walk then computes other values from it (a coupling's side branch, the next inversion), and a
computation that cancels (terms of 500 summing to 3) or is steep there amplifies that error
beyond anything the inversion's own bound sees. So the walk carries, beside every value it
derives from a rebuilt one, an estimate of its error (nothing for a value known exactly), and
checks the derivatives the backward takes at such values against the tolerance of their scale.
Design and limits: remat_nn/invertible/README.md.

An error is two float32 scalars ``(A, R)``: element ``j`` of the value ``x`` is off by at most
``min(A, R * |x_j|)`` (an absolute and a relative part: ``exp`` of a rebuilt value is off
relative to itself, so its small elements stay precise). Between steps only the two scalars
live; each step expands them to per-element errors (:func:`spread`), propagates those, and
summarizes the result (:func:`summarize`), so temp memory stays flat in depth.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp

from remat_nn._jax_internals import core
from remat_nn._named_axes import varying
from remat_nn.invertible._jaxpr import eval_eqn, is_var, open_jaxpr, read
from remat_nn.invertible._primitive_rules import tolerance

#: ``body_of(eqn)``: the jaxpr a call-like equation evaluates (None for any other equation).
BodyOf = Callable[[core.JaxprEqn], Any]


def floating(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def scale(x: Any) -> Any:
    """``max|x|`` in float32 (0 for an empty tensor)."""
    return jnp.max(jnp.abs(jnp.asarray(x)).astype(jnp.float32), initial=0.0)


def settle(x: Any) -> Any:
    """The scalar ``x`` (NaN included), computed where it stands.

    The walk's scalars (errors, check codes) form chains from step to step. XLA fuses a chain
    of cheap scalar operations into each of its consumers, recomputing it there from every
    earlier step's inputs, which then all stay alive to the end: temp memory grows with depth
    and compile time with its square. A ``sort`` is never fused, so passing each step's scalar
    through a two-element sort (``sort([x, -1])[1]`` is ``x`` for every ``x >= -1`` and NaN)
    ends the chain there, at the cost of one tiny sort per step."""
    return jnp.sort(jnp.stack([x, jnp.full_like(x, -1)]))[1]


_TIED = contextvars.ContextVar("remat_nn_invertible_tied", default=True)


@contextlib.contextmanager
def untied() -> Iterator[None]:
    """Within: :func:`after` returns ``x`` untied (a loop body's walk: ``ScanRule``).

    The ties keep an unrolled walk's temp memory flat in depth. In a loop body every value dies
    with its iteration, so nothing they bound can grow with the loop's length there, and each
    tie makes the operation after it wait for the error's reductions: XLA:CPU then runs the
    body's few dozen small reductions one after another instead of beside its matmuls. On the
    depth benchmark's scan (benchmarks/results/depth.md) untying the body took the step at
    depth 512 from 1.50x plain autodiff's to 1.09x, for a flat ~0.9 MiB more temp (the body's
    per-element error arrays live at once: 2.91 MiB at depth 8, 3.00 MiB at 512)."""
    token = _TIED.set(False)
    try:
        yield
    finally:
        _TIED.reset(token)


def after(x: Any, dep: Any) -> Any:
    """``x``, bit for bit, made to depend on the scalar ``dep`` (``x - 0 * (dep > -1)``; floats
    of 32 bits or more only; ``x`` itself within :func:`untied`).

    A reduction of a value the walk was given (a weight, an output) could run at any time, and
    XLA runs them all at the start, holding one scalar per step to the end: temp memory would
    grow with depth. Made to depend on the step's error, it runs at its step."""
    x = jnp.asarray(x)
    if not _TIED.get():
        return x
    if not varying(dep) <= varying(x):  # under shard_map: it would change x's type
        return x
    if jnp.finfo(x.dtype).bits <= 16:
        # An operation on a 16-bit value makes XLA round it there, where the forward pass may
        # have kept excess precision: the recomputed value would differ, and gradients of
        # bfloat16 branches lose accuracy. Not tied: scheduling, not values, is at stake.
        return x
    return x - jnp.zeros((), x.dtype) * (dep > -1).astype(x.dtype)


def value_excess(err: Err, value: Any, rtol: float) -> Any:
    """How far the largest error is past the tolerance of ``value``'s scale (:func:`excess`:
    0 if within, inf if NaN)."""
    top = scale(value)
    a, r, floor = err
    tol = jnp.maximum(tolerance(rtol, jnp.result_type(value)), floor)
    return excess(jnp.minimum(a, r * top), top, tol)


def excess(off: Any, top: Any, tol: Any) -> Any:
    """A check's result (``_verdict``): 0 where ``off <= tol * top``, else the relative move
    ``off / top`` (inf where it is NaN or ``top`` is 0), a float32 scalar."""
    move = jnp.where(off <= tol * top, 0.0, (off / top).astype(jnp.float32))
    return jnp.where(jnp.isnan(move), jnp.inf, move)


def worse(a: Any, b: Any) -> Any:
    """The larger of two :func:`excess` results (None: nothing checked)."""
    return b if a is None else (a if b is None else jnp.maximum(a, b))


#: An error: (absolute part, relative part, tolerance floor), float32 scalars. The floor is
#: the tolerance of the coarsest dtype the error came through (a float32 value rebuilt from a
#: bfloat16 branch is as precise as bfloat16).
Err = tuple[Any, Any, Any]


def rounding(y: Any) -> Err | None:
    """What a 16-bit float value computed again adds: the tolerance floor of its dtype (the
    values computed from it are as precise as it), and no error (None for wider dtypes).

    XLA keeps excess precision where a fusion allows it, so a recomputation fused differently
    could round where the forward pass did not (half an ulp per element). The walk adds no
    operation to 16-bit values (see :func:`after`), so it fuses them alike; counting that
    rounding in full at every recomputation refused ordinary mixed-precision couplings whose
    gradients equal jitted autodiff's."""
    dtype = jnp.result_type(y)
    if not floating(y) or jnp.finfo(dtype).bits > 16:
        return None
    zero = jnp.zeros((), jnp.float32)
    return zero, zero, jnp.float32(tolerance(0.0, dtype))


def spread(err: Err, x: Any) -> Any:
    """Per-element errors of ``x``: ``min(A, R * |x|)`` (float32, ``x``'s shape)."""
    a, r, _ = err
    rel = r * jnp.abs(jnp.asarray(x)).astype(jnp.float32)
    return jnp.where(rel < a, rel, a)  # NaN (inf * 0) picks A


def beyond_floor(err: Err, x: Any) -> Any:
    """Per-element errors of a 16-bit ``x`` past its rounding floor, ``max(0, spread - floor *
    |x_j|)`` (``floor``: :func:`remat_nn.invertible._primitive_rules.tolerance` of ``x``'s
    dtype, 8 ulps of 1); of a wider ``x``, :func:`spread` unchanged.

    A 16-bit value rebuilt within its floor at each element is as precise as the 16-bit
    computation that made it, and plain autodiff takes its derivatives at values rounded as
    much: a derivative check counts only the error past it. Element by element, not at the
    tensor's scale (as :func:`value_excess` judges a value): a small element of a large tensor
    can sit where the derivative is steep (a side branch that cancels). Only for 16-bit
    operands, whose floor is known when tracing: wider operands pay no extra operation."""
    per_element = spread(err, x)
    dtype = jnp.result_type(x)
    if not _is_16_bit(dtype):
        return per_element
    floor = tolerance(0.0, dtype) * jnp.abs(jnp.asarray(x)).astype(jnp.float32)
    return jnp.maximum(per_element - floor, 0.0)


def summarize(per_element: Any, y: Any, floor: Any) -> Err:
    """The error of ``y`` from per-element errors (and the tolerance floor they came with)."""
    per_element = jnp.abs(per_element).astype(jnp.float32)
    mag = jnp.abs(jnp.asarray(y)).astype(jnp.float32)
    ratio = jnp.where(per_element == 0, 0.0, per_element / mag)  # inf where y_j = 0
    return scale(per_element), jnp.max(ratio, initial=0.0), floor


def add(a: Err | None, b: Err | None) -> Err | None:
    """Errors from distinct sources, combined as independent (root sum of squares of each
    part). Keep both parts finite where possible: with ``A = inf`` on one side the sum would
    lose the other side's absolute part (``min(A1 + A2, ...)`` has mixed terms this drops)."""
    if a is None or b is None:
        return b if a is None else a
    return jnp.hypot(a[0], b[0]), jnp.hypot(a[1], b[1]), jnp.maximum(a[2], b[2])


def _tangent_ok(t: Any) -> bool:
    return t is not None and floating(t) and jnp.result_type(t) != jax.dtypes.float0


def _along(fn: Callable, args: Sequence[Any], i: int) -> Callable[[Any], Any]:
    """``fn`` as a function of its argument ``i`` alone, the others fixed at ``args``."""

    def at(x):
        return fn(*[x if j == i else a for j, a in enumerate(args)])

    return at


def linearized(
    fn: Callable, primals: Sequence[Any], errs: Sequence[Err | None], outs: Sequence[Any]
) -> list:
    """First-order errors of ``fn``'s outputs (``outs``, its values): for each input ``i`` with
    an error, ``|d fn / d x_i . e_i|`` along its per-element errors ``e_i``, combined over the
    inputs by :func:`add`.

    Exact to first order for elementwise and structural functions (slices, reshapes,
    concatenations); a signed sum for contractions, so those use :func:`_dot_general` /
    :func:`_reduce_sum` instead.
    """
    result: list = [None] * len(outs)
    for i, (x, e) in enumerate(zip(primals, errs, strict=True)):
        if e is None or not floating(x):
            continue

        x = after(x, e[0])
        _, tangents = jax.jvp(_along(fn, primals, i), (x,), (spread(e, x).astype(x.dtype),))
        for k, (t, y) in enumerate(zip(tangents, outs, strict=True)):
            if _tangent_ok(t) and floating(y):
                result[k] = add(result[k], summarize(t, y, e[2]))
    return result


def inherited(
    inverse: Callable[[list, list], list],
    known: Sequence[Any],
    outs: Sequence[Any],
    errs: Sequence[Err | None],
    rebuilt: Sequence[Any],
) -> list:
    """The errors rebuilt values inherit, to first order, from the known values and outputs an
    inverse reads: ``inverse(known, outs) -> rebuilt``; ``errs`` of ``known`` then ``outs``."""
    if all(e is None for e in errs):
        return [None] * len(rebuilt)
    n = len(known)
    return linearized(
        lambda *vals: inverse(list(vals[:n]), list(vals[n:])), [*known, *outs], errs, rebuilt
    )


def _root_sum_square(x: Any, axes: Sequence[int]) -> Any:
    """``sqrt(sum over axes of x**2)`` in float32 (scaled first: float32 squares overflow above
    1e19)."""
    x = jnp.abs(jnp.asarray(x)).astype(jnp.float32)
    top = scale(x)
    unit = x / jnp.where(top > 0, top, 1.0)
    return top * jnp.sqrt(jnp.sum(unit * unit, axis=tuple(axes)))


def _dot_general(eqn, ins, errs, outs) -> list:
    # y = a . b: errors of a reach y as at most max err(a) * ||column of b||_2 (the errors of
    # distinct elements independent); a worst case, max err(a) * sum |b|, compounds over a
    # stack of layers exponentially and would refuse well-conditioned stacks.
    (lc, rc), _ = eqn.params["dimension_numbers"]
    (a, b), (ea, eb), (y,) = ins, errs, outs
    err = None
    for e, x, other, axes in ((ea, a, b, rc), (eb, b, a, lc)):
        if e is not None:
            top = spread(e, scale(x))  # the largest of x's per-element errors (they grow with |x|)
            part = top * scale(_root_sum_square(after(other, top), axes))
            err = add(err, uniform(part, y, e[2]))
    return [err]


def uniform(part: Any, y: Any, floor: Any) -> Err:
    """:func:`summarize` of the error ``part`` in every element of ``y``, from one reduction of
    ``y`` (the broadcast's own maximum is ``|part|``)."""
    part = jnp.abs(jnp.asarray(part, jnp.float32))
    mag = jnp.abs(jnp.asarray(y)).astype(jnp.float32)
    ratio = jnp.max(jnp.where(part == 0, 0.0, part / mag), initial=0.0)  # inf where y_j = 0
    return (part if jnp.size(y) else jnp.zeros((), jnp.float32)), ratio, floor


def _reduce_sum(eqn, ins, errs, outs) -> list:
    (x,), (e,), (y,) = ins, errs, outs
    return [summarize(_root_sum_square(spread(e, x), eqn.params["axes"]), y, e[2])]


_SPECIAL = {prims.dot_general_p: _dot_general, prims.reduce_sum_p: _reduce_sum}


def forward(
    eqn: core.JaxprEqn,
    ins: Sequence[Any],
    outs: Sequence[Any],
    errs: Sequence[Any],
    body_of: BodyOf,
) -> list:
    """The errors of ``eqn``'s outputs recomputed from inputs carrying ``errs`` (None: exact)."""
    body = body_of(eqn)
    if all(e is None for e in errs):
        out_errs = [None] * len(outs)
    elif body is not None:
        out_errs = _through(body, ins, errs, body_of)[0]
    else:
        special = _SPECIAL.get(eqn.primitive)
        if special is not None and all(floating(x) for x in ins):
            out_errs = special(eqn, ins, errs, outs)
        else:
            out_errs = linearized(lambda *xs: eval_eqn(eqn, xs), ins, errs, outs)
    if body is None:  # (a body's own 16-bit values were counted inside it)
        out_errs = [add(e, rounding(y)) for e, y in zip(out_errs, outs, strict=True)]
    return [e if floating(y) else None for e, y in zip(out_errs, outs, strict=True)]


def recomputes_16_bit(eqn: core.JaxprEqn, body_of: BodyOf) -> bool:
    """Whether recomputing ``eqn`` makes a 16-bit float value (inside a call's body too)."""
    if any(is_var(v) and _is_16_bit(getattr(v.aval, "dtype", None)) for v in eqn.outvars):
        return True
    body = body_of(eqn)
    return body is not None and any(recomputes_16_bit(e, body_of) for e in open_jaxpr(body)[0].eqns)


def _is_16_bit(dtype: Any) -> bool:
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact) and jnp.finfo(dtype).bits <= 16


#: The derivative checks' tolerance in units of ``rtol`` (the default 1e-5: 1e-2). A derivative
#: taken at a rebuilt value moves the gradient by about its own relative change; but the error
#: the walk carries into it is a propagated estimate (capped by the forward's sketches where it
#: kept them), pessimistic, and in a stack whose float32 forward is itself ill-conditioned the
#: real drift is of the order of plain autodiff's own error. Set on the canonical-stacks matrix
#: (benchmarks/results/invertible.md; rn.invertible's 112 cells refused at 25, swept): at 25
#: (2.5e-4), 52 refusals were false (the unchecked gradient within 10x of plain autodiff's own
#: error against float64), 21 of them where that error is below 1e-2; at 250 (2.5e-3) 38 and
#: 7; at 1000 (1e-2) 33 and 2 (the matrix re-run at 1000, which gets an unchecked error for
#: more refused cells, counts 44 and 2; with the scan body's walk untied, 44 and 4: values at
#: the threshold round differently). No setting accepted a gradient further than 53x
#: autodiff's own error (the silent line is 100x), and the magnitude fuzz (600 programs, seeds
#: 0-2) has no mismatch even at 0.1. The inversions' own bounds stay at ``rtol``: they, not
#: these checks, refuse the fuzz's extreme magnitudes; these catch a side branch that cancels
#: or is steep at the rebuilt value (a float16 one 34% off:
#: tests/invertible/test_invertible_magnitudes.py). At ``rtol`` 1e-3 the tolerance is 1: only
#: a derivative that changes by more than its own scale is refused.
DERIVATIVE_SLACK = 1000

#: Primitives whose derivative does not depend on their operands' values (no check needed).
_LINEAR = {
    getattr(prims, name)
    for name in (
        "add_p sub_p neg_p reshape_p broadcast_in_dim_p transpose_p squeeze_p slice_p "
        "dynamic_slice_p dynamic_update_slice_p concatenate_p pad_p reduce_sum_p copy_p "
        "select_n_p gather_p rev_p cumsum_p real_p imag_p conj_p convert_element_type_p"
    ).split()
}
#: The same, for collectives (named by their primitive's name: not all are public).
_LINEAR_NAMES = {"pvary", "psum", "psum_invariant", "pbroadcast", "all_gather", "ppermute"}
#: Bilinear primitives: the derivative in one operand is the other operand.
_BILINEAR = {prims.dot_general_p, prims.mul_p, prims.conv_general_dilated_p}


def derivative_excess(
    eqn: core.JaxprEqn,
    ins: Sequence[Any],
    errs: Sequence[Err | None],
    active: Sequence[int],
    rtol: float,
    body_of: BodyOf,
) -> Any:
    """How far the derivatives the backward takes of ``eqn`` (in the operands at ``active``)
    at operands carrying ``errs`` move past ``DERIVATIVE_SLACK * rtol`` of their own scale: 0
    if none does, else the largest relative move (:func:`excess`; None: nothing to check).

    A bilinear operation's derivative in one operand is the other operand: its error relative
    to its scale. Any other: for each operand ``i`` with an error and each active operand
    ``k``, the derivative ``D_k = d f / d x_k`` along ones, and its change ``d D_k / d x_i``
    along the per-element errors of ``x_i``, relative to ``max|D_k|`` (``1 - tanh(s)**2``
    near ``s = 3`` is 0.01: a rebuilt ``s`` off by 1 changes it entirely).
    """
    if eqn.primitive in _LINEAR or eqn.primitive.name in _LINEAR_NAMES:
        return None
    body = body_of(eqn)
    if body is not None:  # its own derivative rule: judged by its body's derivatives
        return _through(body, ins, errs, body_of, rtol)[1]
    ok = None
    if eqn.primitive in _BILINEAR:  # d/da (a * b) = b: b's error matters if a is active
        (x, ex), (y, ey) = zip(ins, errs, strict=True)
        for e, v, partner in ((ex, x, 1), (ey, y, 0)):
            if e is not None and partner in active and floating(v):
                ok = worse(ok, value_excess(e, v, DERIVATIVE_SLACK * rtol))
        return ok
    vals = [jnp.asarray(x) for x in ins]

    def slope(k: int, *xs: Any) -> list:  # D_k along ones, at xs
        at = _along(lambda *a: eval_eqn(eqn, a), xs, k)
        return list(jax.jvp(at, (xs[k],), (jnp.ones_like(xs[k]),))[1])

    for i, e in enumerate(errs):
        if e is None or not floating(vals[i]):
            continue
        for k in active:
            if not floating(vals[k]):
                continue

            at = after(vals[i], e[0])
            slope_at = _along(functools.partial(slope, k), vals, i)
            d, h = jax.jvp(slope_at, (at,), (beyond_floor(e, at).astype(at.dtype),))
            for dk, hk in zip(d, h, strict=True):
                if _tangent_ok(dk):
                    tol = jnp.maximum(tolerance(DERIVATIVE_SLACK * rtol, jnp.result_type(dk)), e[2])
                    ok = worse(ok, excess(scale(hk), scale(dk), tol))
    return ok


def _through(
    body: Any, ins: Sequence[Any], errs: Sequence[Any], body_of: BodyOf, rtol: float | None = None
) -> tuple[list, Any]:
    """:func:`forward` through a call's body, equation by equation (the values are computed
    again: under jit XLA merges them with the call's own); with ``rtol``, also
    :func:`derivative_excess` of each equation (in all its float operands)."""
    jaxpr, consts = open_jaxpr(body)
    env = dict(zip(jaxpr.invars, [*consts, *ins], strict=True))
    err = {
        v: e
        for v, e in zip(jaxpr.invars, [None] * len(consts) + list(errs), strict=True)
        if e is not None
    }
    ok = None
    for eqn in jaxpr.eqns:
        vals = [read(env, a) for a in eqn.invars]
        outs = eval_eqn(eqn, vals)
        env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True) if is_var(v))
        in_errs = [err.get(a) if is_var(a) else None for a in eqn.invars]
        if any(e is not None for e in in_errs) or recomputes_16_bit(eqn, body_of):
            if rtol is not None and any(e is not None for e in in_errs):
                active = [k for k, a in enumerate(eqn.invars) if is_var(a) and floating(vals[k])]
                ok = worse(ok, derivative_excess(eqn, vals, in_errs, active, rtol, body_of))
            out_errs = forward(eqn, vals, outs, in_errs, body_of)
            err.update((v, e) for v, e in zip(eqn.outvars, out_errs, strict=True) if e is not None)
    return [err.get(v) if is_var(v) else None for v in jaxpr.outvars], ok
