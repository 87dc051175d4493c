"""rn.name: checked at the call; the canonical names are documented once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn


def test_name_is_identity_on_arrays_and_pytrees():
    tree = {"a": jnp.ones(2), "b": (np.zeros(3, np.float32),)}
    out = rn.name(tree, "pair")
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    np.testing.assert_array_equal(out["a"], tree["a"])


@pytest.mark.parametrize("bad", [3, "x", [1.0], {"a": 2.0}])
def test_non_array_is_a_type_error_naming_the_value(bad):
    with pytest.raises(TypeError, match=r"argument `x` must be an array"):
        rn.name(bad, "h")


@pytest.mark.parametrize("bad", ["", 3, None, b"h"])
def test_bad_name_is_a_type_error(bad):
    with pytest.raises(TypeError, match=r"argument `name` must be a non-empty string"):
        rn.name(jnp.ones(2), bad)


def test_name_errors_at_the_call_under_jit():
    with pytest.raises(TypeError, match="non-empty string"):
        jax.jit(lambda x: rn.name(x, ""))(jnp.ones(2))


def test_every_canonical_name_is_documented_once():
    constants = {v for k, v in vars(rn.names).items() if k.isupper() and isinstance(v, str)}
    assert constants == set(rn.names.ACTIVATIONS)
    assert all(doc.strip() for doc in rn.names.ACTIVATIONS.values())
