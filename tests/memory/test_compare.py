"""rn.relative_error: max|got - want| / max|want| per leaf, at the trees' own precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn


def test_float64_trees_are_compared_at_float64_precision():
    # Compared in float32 (as it was), a 1e-12 relative difference rounded away to 0.
    with jax.enable_x64(True):
        want = jnp.linspace(1.0, 2.0, 7, dtype=jnp.float64)
        got = want.at[3].add(2.0 * 1e-12)
        err = rn.relative_error({"w": got}, {"w": want})
    assert err == pytest.approx(1e-12, rel=1e-3, abs=0.0)


def test_float32_and_bfloat16_differences_are_exact():
    a = np.float32(1.0) + np.float32(2.0**-23)  # one float32 ulp above 1
    assert rn.relative_error(jnp.array([a]), jnp.array([1.0], jnp.float32)) == 2.0**-23
    b = jnp.array([1.0078125], jnp.bfloat16)  # one bfloat16 ulp above 1
    assert rn.relative_error(b, jnp.array([1.0], jnp.bfloat16)) == 2.0**-7


def test_leaves_scale_on_their_own_unless_floored():
    got = {"big": jnp.array([100.0]), "zero": jnp.array([1e-3])}
    want = {"big": jnp.array([100.0]), "zero": jnp.array([0.0])}
    assert rn.relative_error(got, want) == pytest.approx(1e-3)  # a zero leaf: max|got|
    assert rn.relative_error(got, want, floor=0.1) == pytest.approx(1e-3 / 10.0)


def test_mismatched_trees_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="Fix: compare trees of the same structure"):
        rn.relative_error([jnp.ones(2)], [jnp.ones(2), jnp.ones(2)])
    with pytest.raises(ValueError, match="shape"):
        rn.relative_error({"w": jnp.ones(2)}, {"w": jnp.ones(3)})
