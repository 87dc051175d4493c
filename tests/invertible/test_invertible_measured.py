"""The drift the walk measures against the forward pass's sketches (remat_nn/invertible/_sketch.py).

Issue #44: the error estimate propagated through every matmul and derivative compounded per layer
much faster than the real error, so ``rn.invertible`` refused the canonical coupling stack it
exists for (depth 4..16 at weight scale 0.3) though its gradient was as exact as ``jax.grad``'s.
The forward pass now keeps a few projections of each value the walk derives from a rebuilt one,
and the walk caps the carried error by the drift it measures. These tests pin the estimator and
show both sides of the verdict: the stack is accepted, a stack whose rebuild really drifts is not.
"""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn
from benchmarks import invertible_matrix as matrix
from benchmarks.invertible_drift import loss, problem, reference, stack
from remat_nn.invertible import _sketch, _vjp
from tests.jaxprs import equations

REFUSED = (rn.NotInvertibleError, jax.errors.JaxRuntimeError)


def _grad(f, args):
    return jax.block_until_ready(jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(*args))


def test_the_canonical_coupling_stack_is_accepted_and_as_exact_as_autodiff():
    """Depth 8, weights 0.3 * N(0, 1): refused by the propagated estimate even at rtol 1e-3; its
    gradient is as close to the float64 one as jax.grad's."""
    args = problem(0.3, 8)
    got = _grad(rn.invertible(stack, known_argnums=0), args)  # raises if refused
    plain = _grad(stack, args)
    want = reference(*args)
    autodiff = rn.relative_error(plain, want)
    assert rn.relative_error(got, want) <= 10 * autodiff
    assert rn.relative_error(got, plain) <= 10 * autodiff


#: A stack whose rebuild really drifts: the matrix's affine couplings with LayerNorm, width 16,
#: depth 32, LeCun weights (benchmarks/invertible_matrix.py). Inverting each coupling divides
#: by its scale and amplifies the rounding of the layers above: the walk's gradient, its checks
#: not raised, is 90x further from float64 than jax.grad's (146x in the matrix run).
DRIFTING = matrix.Stack("affine", 16, 32, "scan", ln=True, dtype="f32")


def _cell(stack, **kw):
    """``(jit(grad) of rn.invertible over the matrix's stack, weights known; its LeCun data)``."""
    args = [jnp.asarray(a, jnp.float32) for a in matrix._data(stack, "lecun")]
    fn = rn.invertible(matrix._stack_fn(stack), known_argnums=(2, 3), **kw)
    return matrix._grad(fn), args


def _float64_and_autodiffs_error(stack, args):
    """``(the float64 gradient, jax.grad's own error against it)`` of the matrix's stack."""
    want = matrix._reference(replace(stack, dtype="f64"), ("lecun",))["lecun"]
    return want, rn.relative_error(matrix._grad(matrix._stack_fn(stack))(*args), want)


def test_a_stack_whose_rebuild_drifts_is_still_refused():
    """(Catches a measurement that reads no drift, with the next test.)"""
    grad, args = _cell(DRIFTING)
    want, own = _float64_and_autodiffs_error(DRIFTING, args)
    loose, _ = _cell(DRIFTING, rtol=0.5)
    # How far the unchecked walk lands depends on how XLA rounds on this CPU (90x jax.grad's own
    # error where it was written, 146x in the matrix run): printed, not asserted. What the
    # project promises is the refusal below, and the next test shows the measurement makes it.
    print(f"unchecked walk: {rn.relative_error(loose(*args), want) / own:.0f}x jax.grad's error")
    with pytest.raises(REFUSED, match="rebuilt"):
        jax.block_until_ready(grad(*args))


def test_with_the_measurement_reading_no_drift_the_drifting_stack_passes_silently():
    """The mutation: a drift of 0 everywhere. The drifting stack is then accepted with its wrong
    gradient, so the measurement, not the propagated estimate, is what refuses it."""

    def reads_no_drift(rebuilt, recorded):
        return jnp.float32(0), jnp.max(jnp.abs(rebuilt)).astype(jnp.float32)

    with mock.patch.object(_sketch, "measure", reads_no_drift):
        grad, args = _cell(DRIFTING)
        jax.block_until_ready(grad(*args))  # not refused


#: A stack whose float32 forward is itself ill-conditioned: the matrix's affine couplings
#: without LayerNorm, width 64, depth 8, LeCun weights. jax.grad's own error against float64 is
#: about 1e-4 there, and the rebuild drifts by as much; the walk's gradient is as close to
#: float64 (0.9x jax.grad's error in the matrix run). The derivative checks held to 2.5e-4
#: refused it; held to 1e-2 (``_errors.DERIVATIVE_SLACK``) they accept it.
ILL_CONDITIONED = matrix.Stack("affine", 64, 8, "scan", ln=False, dtype="f32")


def test_a_stack_as_ill_conditioned_as_its_autodiff_is_accepted():
    grad, args = _cell(ILL_CONDITIONED)
    want, own = _float64_and_autodiffs_error(ILL_CONDITIONED, args)
    got = jax.block_until_ready(grad(*args))  # raises if refused
    print(f"jax.grad's error {own:.2e}, the walk's {rn.relative_error(got, want):.2e}")
    assert own > 1e-5  # the premise: float32 autodiff itself is this far from float64
    assert rn.relative_error(got, want) <= 10 * own


def _perturbed(shape, scale, seed):
    x = jax.random.normal(jax.random.PRNGKey(seed), shape)
    d = scale * jax.random.normal(jax.random.PRNGKey(seed + 1000), shape)
    return x, x + d, d


def test_an_exact_rebuild_measures_no_drift():
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = jax.random.normal(jax.random.PRNGKey(0), (5, 7)).astype(dtype)
        assert float(_sketch.drift(x, _sketch.sketch(x, 3), 3)) == 0.0


@pytest.mark.parametrize("shape", [(4, 16), (64, 256)])
def test_a_spread_out_drift_is_measured_at_least_at_its_largest_element(shape):
    """Rounding-like drift (every element off, independently): the estimate is at least the
    largest element's drift and within a small factor of it, at every seed tried."""
    for seed in range(20):
        x, rebuilt, d = _perturbed(shape, 1e-6, seed)
        d = np.abs(np.asarray(rebuilt, np.float64) - np.asarray(x, np.float64))
        got = float(_sketch.drift(rebuilt, _sketch.sketch(x, seed), seed))
        assert d.max() <= got <= 8 * d.max(), (seed, got, d.max())


def test_the_estimate_never_exceeds_the_norm_and_a_lost_value_is_infinite():
    """One element off by 1e-3: the estimate is at most ||d||_2 (a bound of every element's
    drift); a NaN or an overflow in the rebuilt value reads as an infinite drift."""
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16))
    rebuilt = x.at[1, 2].add(1e-3)
    got = float(_sketch.drift(rebuilt, _sketch.sketch(x, 0), 0))
    norm = float(jnp.linalg.norm((rebuilt - x).ravel()))
    assert 0 < got <= norm * (1 + 1e-3)
    for bad in (jnp.nan, jnp.inf):
        assert float(_sketch.drift(x.at[0, 0].set(bad), _sketch.sketch(x, 0), 0)) == np.inf


def test_the_quantization_power_is_frexps_over_the_whole_float32_range():
    """``_power`` reads the exponent from the bits: it equals ``2**clip(30 - e, -125, 126)``
    with ``frexp``'s ``e``, for magnitudes drawn log-uniformly over float32's range, its edges
    (subnormals, the largest float, powers of two and their neighbours) and 0, inf, NaN."""
    rng = np.random.default_rng(0)
    info = np.finfo(np.float32)
    drawn = np.exp(rng.uniform(np.log(info.smallest_subnormal), np.log(info.max), 4000))
    twos = np.ldexp(np.float32(1), np.arange(-149, 128)).astype(np.float32)
    edges = [0.0, np.inf, np.nan, info.max, info.tiny, info.smallest_subnormal, 1.0]
    tops = np.concatenate(
        [drawn, twos, np.nextafter(twos, 0), np.nextafter(twos, np.inf), edges]
    ).astype(np.float32)
    got = np.asarray(jax.jit(jax.vmap(_sketch._power))(jnp.asarray(tops)))
    exponent = np.where(np.isfinite(tops), np.frexp(np.where(np.isfinite(tops), tops, 0))[1], 0)
    want = np.ldexp(np.float32(1), np.clip(30 - exponent, -125, 126)).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float32


def test_the_cap_only_lowers_the_propagated_error():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16))
    for a_part in (1e-4, 1e-2):  # the largest error its absolute part, then its relative one
        err = (jnp.float32(a_part), jnp.float32(1e-3), jnp.float32(0))
        largest = min(a_part, 1e-3 * float(jnp.max(jnp.abs(x))))  # of the per-element errors
        for measured in (jnp.float32(1e-6), jnp.float32(1.0), jnp.float32(jnp.nan)):
            a, r, _ = _sketch.capped(err, jnp.max(jnp.abs(x)), measured)
            assert float(a) == pytest.approx(
                a_part if jnp.isnan(measured) else min(a_part, measured)
            )
            # The relative part shrinks as the largest error does (never grows).
            shrink = 1.0 if jnp.isnan(measured) else min(1.0, float(measured) / largest)
            assert float(r) == pytest.approx(1e-3 * shrink)


def test_the_cap_reads_the_largest_error_from_the_values_scale():
    """``capped`` takes the largest per-element error as ``min(A, R max|x|)`` from the scale
    ``measure`` read: the largest of ``_errors.spread``'s per-element errors, whatever the
    error's parts (0, tiny, huge, inf, NaN) and the value (zeros, a NaN, an inf, magnitudes
    log-uniform over float32's range)."""
    from remat_nn.invertible import _errors

    rng = np.random.default_rng(0)
    mags = np.exp(rng.uniform(np.log(1e-38), np.log(1e38), (6, 16))).astype(np.float32)
    values = [mags * rng.choice([-1, 1], mags.shape), np.zeros((3, 4), np.float32)]
    values += [np.where(mags > 1, np.float32(bad), mags) for bad in (np.nan, np.inf, 0)]
    parts = [0.0, 1e-30, 1e-6, 1.0, 1e30, np.inf, np.nan]
    for x in map(jnp.asarray, values):
        for a in parts:
            for r in parts:
                err = (jnp.float32(a), jnp.float32(r), jnp.float32(0))
                want = _errors.scale(_errors.spread(err, x))
                got = _errors.spread(err, jnp.max(jnp.abs(x)))
                np.testing.assert_array_equal(got, want, err_msg=f"A={a} R={r}")


def test_the_sketches_cost_their_own_bytes_not_copies_of_the_activations():
    """The forward pass sketches each value as it is made, with sign matrices shared by every
    value. Before: one hashed sign per element made XLA:CPU materialize an 8x
    signed copy of each value, and the sketches ran late, holding the activations; at width
    512 the walk's temp (12.2 MB) exceeded plain autodiff's (8.4 MB), 5.2 MB without sketches.
    (Catches sketches that hold a copy per value, or signs made per value and held to the
    backward: temp growing with depth.)"""

    def temp(f, args):
        return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

    temps = {}
    for depth in (4, 16):
        args = problem(0.3, depth, width=256, batch=64)
        walk = lambda: jax.grad(loss(rn.invertible(stack, known_argnums=0)), argnums=(0, 1, 2))  # noqa: E731
        with mock.patch.object(_vjp, "sketched", lambda schedule: []):
            unsketched = temp(walk(), args)
        plain = temp(jax.grad(loss(stack), argnums=(0, 1, 2)), args)
        temps[depth] = (temp(walk(), args), unsketched, plain)
    value = 64 * 256 * 4
    print(f"temp (sketched, unsketched, plain autodiff) by depth: {temps}; one value {value} B")
    for sketched, unsketched, _ in temps.values():
        assert sketched - unsketched <= value  # at most one value-sized transient
    assert temps[16][0] < temps[16][2]  # below plain autodiff's, which stores 16 layers
    # From depth 4 to 16 the sketched walk grows by its sketches (36 B per value) at most.
    growth = (temps[16][0] - temps[16][1]) - (temps[4][0] - temps[4][1])
    assert growth <= 12 * 6 * 64, growth  # 12 layers, at most 6 values each, 64 B a sketch


def _ties(jaxpr):
    """``{False: n, True: m}``: the walk's scheduling ties (``_errors.after``: ``x - 0 * (dep >
    -1)``, found by their ``dep > -1``) outside and inside ``scan`` bodies of ``jaxpr``."""
    found = {False: 0, True: 0}
    for eqn, enclosing in equations(jaxpr):
        if eqn.primitive.name == "gt" and getattr(eqn.invars[-1], "val", None) == -1:
            found["scan" in enclosing] += 1
    return found


def test_a_scan_bodys_walk_runs_untied_an_unrolled_walk_tied():
    """The ties keep an unrolled walk's temp flat in depth; in a loop body they bound nothing
    that grows, and they made XLA:CPU run the body's reductions one after another (the depth
    benchmark's step 1.50x plain autodiff's at depth 512, untied 1.09x). (Catches the body's
    walk tied again, or the unrolled walk untied with it.)"""
    scanned = matrix.Stack("additive", 16, 4, "scan", ln=False, dtype="f32")
    fn, args = _cell(scanned)
    scan_ties = _ties(jax.make_jaxpr(fn)(*args).jaxpr)
    unrolled = matrix.Stack("additive", 16, 4, "loop", ln=False, dtype="f32")
    fn, args = _cell(unrolled)
    loop_ties = _ties(jax.make_jaxpr(fn)(*args).jaxpr)
    print(f"ties (outside, inside scan bodies): scan {scan_ties}, unrolled {loop_ties}")
    assert scan_ties[True] == 0
    assert loop_ties[False] > 0
