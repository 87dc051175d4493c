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


def test_the_error_names_the_leaf_that_dominates_and_when_floor_is_the_fix():
    # An attention block's key bias: its exact gradient is 0, the two computations' round-off
    # differs, and the per-leaf error is ~1 although every other leaf agrees to 1e-7 (#46).
    want = {"kernel": jnp.linspace(1.0, 2.0, 8), "key_bias": jnp.array([3e-9, -1e-9])}
    got = {"kernel": want["kernel"] * (1 + 1e-7), "key_bias": jnp.array([-2e-9, 2e-9])}
    err = rn.relative_error(got, want)
    assert err.leaf == "['key_bias']" and err > 1.0
    assert "largest at ['key_bias']" in repr(err) and "floor=1e-3" in repr(err)
    assert str(err) == repr(float(err)) and f"{err}" == str(err)  # tables get the number alone
    floored = rn.relative_error(got, want, floor=1e-3)
    assert floored < 1e-5 and "floor=" not in repr(floored)
    same = rn.relative_error(want, want)
    assert same == 0.0 and repr(same) == "0.0" and same.leaf == ""
    # The leaf is where the error is largest, whatever order the leaves come in.
    worse = {"a": jnp.ones(3) * 1.01, "b": jnp.ones(3) * 1.1, "c": jnp.ones(3) * 1.001}
    assert rn.relative_error(worse, {k: jnp.ones(3) for k in worse}).leaf == "['b']"
