"""rn.invertible's derivative checks follow the function's conditioning by default
(remat_nn/invertible/_verdict.py, issue #44: no refusal where the rebuilt gradient is as good
as plain autodiff's).

In a chaotic stack the forward amplifies rounding: plain autodiff's gradient is then about as
far from float64 as the rebuilt one, and the fixed tolerance refused the rebuilt one. With the
default ``rtol``, a derivative check whose move is within ``sqrt(eps)`` times the function's
relative condition number (from the backward's cotangents; at most 100) is accepted. These
tests hold the verdicts against float64 autodiff on cells of the canonical-stacks matrix, and
the code that carries a check's verdict (``_verdict``) on its own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn
from benchmarks import invertible_matrix as matrix
from remat_nn.invertible import _verdict
from tests.invertible.test_reversible_sensitivity import cell_args, cell_own, cell_reference

#: Additive couplings, width 64, depth 32, weights twice He's: refused by the fixed tolerance
#: (tanh's derivative moves ~1.6e-2 > 1e-2) though the unchecked gradient is within 3x plain
#: autodiff's error (2.2e-3 here); kappa ~330.
CHAOTIC = (matrix.Stack("additive", 64, 32, "scan", ln=False, dtype="f32"), "2he")
#: Affine couplings, width 16, depth 32, He weights: the unchecked gradient is ~1000x plain
#: autodiff's error (its inverse amplifies rounding, kappa ~110): still refused.
AMPLIFYING = (matrix.Stack("affine", 16, 32, "scan", ln=False, dtype="f32"), "he")
REFUSED = (jax.errors.JaxRuntimeError, rn.NotInvertibleError)


def _grad(cell, **kw):
    return matrix._grad(rn.invertible(matrix._stack_fn(cell[0]), known_argnums=(2, 3), **kw))


def _error(cell, **kw) -> float:
    return rn.relative_error(
        jax.block_until_ready(_grad(cell, **kw)(*cell_args(cell))), cell_reference(cell)
    )


def test_a_chaotic_stack_is_accepted_by_default_with_autodiffs_accuracy():
    """(Catches the loosening not taken: refused; or taken for a tolerance the user gave.)"""
    own, error = cell_own(CHAOTIC), _error(CHAOTIC)
    print(f"jax.grad's error {own:.2e}, rn.invertible's {error:.2e}")
    assert error <= 10 * own
    with pytest.raises(REFUSED, match="the derivative of `tanh`"):
        _error(CHAOTIC, rtol=1e-5)  # the default's number, given: never raised


def test_a_stack_whose_inverse_amplifies_is_still_refused():
    """(Catches a loosening too generous: a multiplier or a condition estimate far too big.)"""
    own, unchecked = cell_own(AMPLIFYING), _error(AMPLIFYING, rtol=0.5)
    print(f"jax.grad's error {own:.2e}, unchecked {unchecked:.2e}")
    assert unchecked > 100 * own  # a gradient the check must not accept
    with pytest.raises(REFUSED, match=r"moved by up to .* the tolerance was at least"):
        _error(AMPLIFYING)


def test_under_a_probe_and_vmap_the_verdicts_hold():
    """The allowance is judged per call: under ``rn.report_drift_to`` (no host callback) and per
    example under vmap. (Catches a judgement skipped on the probe path, or a verdict shared
    across the batch.)"""
    stack, _ = CHAOTIC
    inv = rn.invertible(matrix._stack_fn(stack), known_argnums=(2, 3))

    def loss(x1, x2, wf, wg, c1, c2, probe):
        with rn.report_drift_to(probe):
            y1, y2 = inv(x1, x2, wf, wg)
        return jnp.sum(y1 * c1) + jnp.sum(y2 * c2)

    probe = jnp.zeros(2)
    x1, x2, wf, wg, c1, c2 = cell_args(CHAOTIC)
    counts = jax.jit(jax.grad(loss, argnums=6))(x1, x2, wf, wg, c1, c2, probe)
    assert counts.tolist() == [0.0, 0.0]
    # vmap: the chaotic inputs, and the same inputs with weights 100x smaller (nothing moves).
    batched = jax.vmap(jax.grad(loss, argnums=6), in_axes=(0, 0, 0, 0, None, None, None))
    ws = [jnp.stack([w, w / 100]) for w in (wf, wg)]
    counts = jax.jit(batched)(jnp.stack([x1, x1]), jnp.stack([x2, x2]), *ws, c1, c2, probe)
    assert counts.tolist() == [[0.0, 0.0]] * 2
    amplifying = cell_args(AMPLIFYING)
    inv = rn.invertible(matrix._stack_fn(AMPLIFYING[0]), known_argnums=(2, 3))
    assert jax.jit(jax.grad(loss, argnums=6))(*amplifying, probe).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("move", [1.1e-2, 0.07, 0.3, 1.0, 7.0, 3e4, 2.0**-70])
def test_a_derivative_checks_code_is_judged_by_its_move(move):
    """A failed derivative check's code keeps its move within a 16th of an octave (4.4%), above
    it: accepted where the allowance covers the bound, kept below; a guard or a NaN move is
    never accepted. (Catches a level rounded down (accepting a move above the allowance), a
    coarser grid (whole octaves were strict by up to 4x: a move of 0.07 read as 0.125, an
    allowance of 0.095 as 0.0625), or a guard loosened.)"""
    code = _verdict.encode(jnp.float32(move), 5)
    assert _verdict.check_id(int(code)) == 5
    bound = _verdict.bound(int(code))
    least = max(move, 2.0**-64)  # the least move a level tells apart
    assert bound is not None and least <= bound < 2.0 ** (1 / 16) * least * (1 + 1e-5)
    assert int(_verdict.judged(code, jnp.float32(bound))) == 0
    assert int(_verdict.judged(code, jnp.float32(least * 1.1))) == 0  # within 9% (two steps)
    assert int(_verdict.judged(code, jnp.float32(bound * 0.99))) == int(code)
    assert int(_verdict.judged(code, jnp.float32(least * 0.99))) == int(code)
    assert int(_verdict.judged(code, jnp.float32(0.0))) == int(code)
    for fatal in (_verdict.encode(jnp.bool_(False), 5), _verdict.encode(jnp.float32(math.nan), 5)):
        assert _verdict.bound(int(fatal)) is None
        assert int(_verdict.judged(fatal, jnp.float32(jnp.inf))) == int(fatal)
        assert int(_verdict.judged(fatal, jnp.float32(1e30))) == int(fatal)
    assert int(_verdict.encode(jnp.float32(0.0), 5)) == 0
    assert int(_verdict.encode(jnp.bool_(True), 5)) == 0


def test_the_grid_read_from_the_bits_equals_frexps_reading():
    """``_verdict._grid`` reads the exponent and mantissa from the bits; frexp's reading (what
    it replaced, 22 operations more per check) gives the same step, both ways, on normal
    float32 moves drawn log-uniformly from ``2**-64`` to the largest float, on every grid
    point and on the float below each. (Catches an off-by-one in the exponent's bias or a
    mantissa read from the wrong bits.)"""

    def frexp_steps(x, up):
        mantissa, exponent = jnp.frexp(x)
        steps = _verdict.STEPS * (exponent - 1) + _verdict.STEPS * jnp.log2(2 * mantissa)
        rounded = jnp.ceil(steps - _verdict._SLACK) if up else jnp.floor(steps + _verdict._SLACK)
        return rounded.astype(jnp.int32)

    rng = np.random.default_rng(0)
    grid = (2.0 ** (np.arange(-64 * 16, 128 * 16) / 16)).astype(np.float32)
    grid = grid[np.isfinite(grid)]
    x = np.concatenate(
        [
            (2.0 ** rng.uniform(-64, 128, 50_000)).astype(np.float32),
            grid,
            np.nextafter(grid, np.float32(0)),
            np.float32([np.finfo(np.float32).max, 2.0**-64]),
        ]
    )
    x = jnp.asarray(x[np.isfinite(x)])
    for up in (True, False):
        got = jax.jit(lambda v, up=up: _verdict._grid(v, up))(x)
        want = jax.jit(lambda v, up=up: frexp_steps(v, up))(x)
        assert int(jnp.sum(got != want)) == 0, up


def test_a_derivative_check_counts_only_the_error_past_the_16_bit_floor():
    """A rebuilt value within 8 ulps of its 16-bit dtype at each element is as precise as the
    computation that made it (plain autodiff takes its derivatives at values rounded as much):
    the derivative check counts only the error past that floor, element by element, not at the
    tensor's scale. (Catches the floor ignored: rsqrt's derivative moves 1.5 times its input's
    relative error, so an error within the floor fails its tolerance (LayerNorm in a bfloat16
    branch); or the floor taken at the tensor's scale: the float16 side branch that cancels,
    tests/invertible/test_invertible_magnitudes.py, was then accepted 34% off.)"""
    from remat_nn.invertible import _errors

    rsqrt = jax.make_jaxpr(jax.lax.rsqrt)(jnp.ones(3, jnp.bfloat16)).jaxpr.eqns[0]
    v = jnp.array([0.01, 1.0, 100.0], jnp.bfloat16)
    floor = jnp.float32(8 * 2.0**-7)  # an error: (absolute, relative, floor) float32 scalars

    def move(a, r):
        err = (jnp.float32(a), jnp.float32(r), floor)
        return float(_errors.derivative_excess(rsqrt, [v], [err], [0], 1e-5, lambda e: None))

    assert move(jnp.inf, 0.9 * floor) == 0.0  # within the floor at every element
    assert move(0.9 * floor * 0.01, jnp.inf) == 0.0  # within it at the smallest element
    assert move(jnp.inf, 3.0 * floor) > 0.0  # 2 floors past it: rsqrt' moves 19% > 6.25%
    assert move(5.0 * floor * 0.01, jnp.inf) > 0.0  # past it at 0.01 (not at the scale, 100)


def test_codes_combine_to_the_worst_check():
    """(Catches the first failed check kept instead of the worst: a small move hiding a guard.)"""
    from remat_nn.invertible._equation_rules import combine_codes

    small, large = _verdict.encode(jnp.float32(0.02), 3), _verdict.encode(jnp.float32(5.0), 4)
    guard = _verdict.encode(jnp.bool_(False), 2)
    assert int(combine_codes(small, large)) == int(large)
    assert int(combine_codes(large, small)) == int(large)
    assert int(combine_codes(combine_codes(small, guard), large)) == int(guard)
    assert int(combine_codes(jnp.int32(0), small)) == int(small)


def test_the_allowance_is_sqrt_eps_times_the_condition_number_capped():
    """``sqrt(eps) kappa``, ``kappa = (|dx| / |dy|) (|x| / |y|)``, at most MAX_MOVE; 0 where
    kappa is not finite. (Catches the formula inverted, linear in eps, or uncapped: a bfloat16
    stack whose derivatives moved thousands of times their scale was accepted 140x off.)"""
    eps = 2.0**-7
    for growth in (1.0, 30.0, 1e6):  # |dx| / |dy|, with |x| = 10, |y| = 5
        got = float(_verdict.allowance(eps, *map(jnp.float32, (10.0, 5.0, 2.0, 2.0 * growth))))
        want = min(_verdict.MAX_MOVE, math.sqrt(eps) * growth * 2.0)
        assert got == pytest.approx(want, rel=1e-5), growth
    assert float(_verdict.allowance(eps, *map(jnp.float32, (10, 5, 0, 1)))) == 0.0  # no kappa
    assert float(_verdict.allowance(eps, *map(jnp.float32, (10, 0, 1, 1)))) == 0.0
