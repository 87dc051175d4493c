"""Bad input at the API boundary: a typed exception naming the argument, the value and the fix,
raised where the input enters (at nn.remat / rn.checkpoint call time, not deep in tracing)."""

from __future__ import annotations

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn
from remat_nn import nn
from remat_nn._plan import names_in_jaxpr

X = jnp.ones((2, 3))


class Gated(fnn.Module):
    @fnn.compact
    def __call__(self, x, flag):
        return fnn.Dense(2)(x) * (2.0 if flag > 0 else 1.0)


def f(x, flag):
    return x * 2 if flag > 0 else x


# --- rn.name ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["abc", 1.0, 3, [1, 2], {"a": "b"}, object()])
def test_name_rejects_non_arrays(value):
    with pytest.raises(TypeError, match=r"rn.name\(x, 'h'\): argument `x` must be an array.*Fix"):
        rn.name(value, "h")


@pytest.mark.parametrize("label", [None, "", 3, b"h"])
def test_name_rejects_bad_names(label):
    with pytest.raises(TypeError, match=r"argument `name` must be a non-empty string.*Fix"):
        rn.name(jnp.ones(2), label)


def test_name_accepts_arrays_and_pytrees():
    # The identity on values, and every leaf tagged (one name per leaf in the jaxpr).
    tree = {"a": jnp.arange(2.0), "b": np.full(1, 3, np.int32)}
    out = rn.name(tree, "h")
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    jaxpr = jax.make_jaxpr(lambda t: rn.name(t, "h"))(tree).jaxpr
    assert list(names_in_jaxpr(jaxpr)) == ["h", "h"]


# --- policies -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [3, 1.5, [1], ("full",), object()])
def test_non_callable_policy_fails_at_wrap_time(bad):
    with pytest.raises(TypeError, match=r"nn.remat: argument `policy` must be .*got .*Fix"):
        nn.remat(Gated, policy=bad)
    with pytest.raises(TypeError, match=r"rn.checkpoint: argument `policy` must be .*got .*Fix"):
        rn.checkpoint(jnp.sin, policy=bad)
    with pytest.raises(TypeError, match=r"nn.remat: argument `policy`"):
        nn.remat(jnp.sin, policy=bad)


def test_plan_given_as_a_list():
    with pytest.raises(TypeError, match=r"A list is not a plan.*\{'save'"):
        rn.checkpoint(jnp.sin, policy=["save", "h"])
    with pytest.raises(TypeError, match=r"A list is not a plan"):
        rn.policy(["h"])
    with pytest.raises(rn.PlanError, match=r"argument `spec` must be a mapping.*got list"):
        rn.plan(["save", "h"])


def test_unknown_policy_and_plan_names_suggest_the_closest():
    with pytest.raises(rn.PolicyError, match=r"'dots_savable'. Did you mean 'dots_saveable'"):
        nn.remat(Gated, policy="dots_savable")
    with pytest.raises(rn.PolicyError, match=r"Did you mean 'nothing_saveable'"):
        rn.checkpoint(jnp.sin, policy="nothing_savable")
    with pytest.raises(rn.PlanError, match=r"unknown keys \['sav'\].*'sav' -> 'save'"):
        nn.remat(Gated, policy={"sav": ["h"]})

    def g(x):
        return rn.name(jnp.sin(x), "mlp_hidden").sum()

    with pytest.raises(rn.PlanError, match=r"'mlp_hiden' -> 'mlp_hidden'"):
        jax.grad(rn.checkpoint(g, policy="save=mlp_hiden"))(jnp.ones(3))


def test_policy_errors_are_value_errors_too():
    # Documented subclasses: `except ValueError` keeps working.
    assert issubclass(rn.PolicyError, ValueError) and issubclass(rn.PlanError, ValueError)


# --- static_argnums -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["1", 1.5, (1, "2"), True, None])
def test_static_argnums_type(bad):
    for wrap in (
        lambda: nn.remat(Gated, static_argnums=bad),
        lambda: nn.remat(f, static_argnums=bad),
        lambda: rn.checkpoint(f, static_argnums=bad),
    ):
        with pytest.raises(TypeError, match=r"argument `static_argnums` must be an int or a tuple"):
            wrap()


def test_static_argnums_out_of_range_for_modules():
    expected = r"\(5,\) is out of range for Gated.__call__.*\['self', 'x', 'flag'\].*=\(2,\)"
    with pytest.raises(ValueError, match=expected):
        nn.remat(Gated, static_argnums=(5,))
    with pytest.raises(ValueError, match=r"counts positional arguments with `self` as 0"):
        nn.remat(Gated, static_argnums=(0,))
    with pytest.raises(ValueError, match=r"negative indices are not supported for Modules"):
        nn.remat(Gated, static_argnums=-1)
    block = nn.remat(Gated, static_argnums=(2,))()  # in range: works as in flax
    v = block.init(jax.random.key(0), X, 1)
    assert block.apply(v, X, 1).shape == (2, 2)


def test_static_argnums_out_of_range_for_functions():
    for wrap in (nn.remat, lambda fn, **kw: rn.checkpoint(fn, **kw)):
        with pytest.raises(ValueError, match=r"\(2,\) is out of range for f.*\['x', 'flag'\]"):
            wrap(f, static_argnums=(2,))
        with pytest.raises(ValueError, match=r"`static_argnums` -3 is out of range"):
            wrap(f, static_argnums=-3)
        assert jax.grad(wrap(f, static_argnums=(1,)))(1.0, 1) == 2.0
        assert jax.grad(wrap(f, static_argnums=-1))(1.0, 1) == 2.0


def test_static_argnums_not_checked_against_varargs():
    def h(*args):
        return args[0] * 2

    assert jax.grad(rn.checkpoint(h, static_argnums=(1,)))(1.0, 1) == 2.0


# --- Python control flow on traced values -------------------------------------------------------


def test_control_flow_error_points_to_static_argnums_for_functions():
    with pytest.raises(jax.errors.TracerBoolConversionError, match="static_argnums"):
        jax.grad(rn.checkpoint(f, policy="full"))(1.0, jnp.array(1.0))


def test_control_flow_error_points_to_static_argnums_for_modules():
    block = nn.remat(Gated, policy="full")()
    with pytest.raises(jax.errors.TracerBoolConversionError, match="static_argnums"):
        block.init(jax.random.key(0), X, jnp.array(1.0))


# --- prevent_cse / concrete ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["yes", 1, None, np.bool_(True)])
def test_prevent_cse_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=r"argument `prevent_cse` must be True or False.*Fix"):
        nn.remat(Gated, prevent_cse=bad)
    with pytest.raises(TypeError, match=r"argument `prevent_cse` must be True or False"):
        rn.checkpoint(jnp.sin, prevent_cse=bad)
    with pytest.raises(TypeError, match=r"argument `concrete` must be True or False"):
        nn.remat(Gated, concrete=bad)


@pytest.mark.parametrize("bad", [(1, 0), ["True"], (True, None), {"x": True}, (True, "no")])
def test_checkpoint_prevent_cse_sequence_holds_bools(bad):
    # jax.checkpoint takes a sequence of bools (a pytree prefix of the dynamic arguments); a
    # string, an int or None among them is a mistake caught here, not a silent truthiness.
    msg = r"rn.checkpoint: argument `prevent_cse` .*or a sequence of them per dynamic argument.*Fix"
    with pytest.raises(TypeError, match=msg):
        rn.checkpoint(jnp.sin, prevent_cse=bad)
    # Nested sequences (a prefix of the arguments' pytree) are accepted and still compute.
    nested = rn.checkpoint(lambda x, ys: x * ys[0], prevent_cse=[True, (False,)])
    assert jax.grad(nested)(2.0, (3.0,)) == 3.0


def test_checkpoint_target_must_be_callable():
    with pytest.raises(
        TypeError, match=r"rn.checkpoint: argument `fun` must be a callable, got int 3.*Fix"
    ):
        rn.checkpoint(3)


def test_checkpoint_concrete_is_jaxs_error():
    # jax.checkpoint still takes `concrete` (removed in JAX 0.10): passing it raises there.
    for value in (True, False):
        with pytest.raises(NotImplementedError, match="use `static_argnums`"):
            jax.checkpoint(jnp.sin, concrete=value)
        with pytest.raises(NotImplementedError, match="use `static_argnums`"):
            rn.checkpoint(jnp.sin, concrete=value)


# --- static_argnames ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [3, b"flag", ("flag", 1), {"flag": True}])
def test_static_argnames_type(bad):
    msg = r"rn.checkpoint: argument `static_argnames` must be a parameter name.*got.*Fix"
    with pytest.raises(TypeError, match=msg):
        rn.checkpoint(f, static_argnames=bad)


def test_static_argnames_unknown_name_suggests_the_closest():
    expected = r"names \['flga'\], which are not parameters of f.*\['x', 'flag'\].*'flag'"
    with pytest.raises(ValueError, match=expected):
        rn.checkpoint(f, static_argnames=("x", "flga"))

    def takes_kwargs(x, **options):
        return x * 2 if options["flag"] else x

    # Any name may reach **kwargs: not checked, and static when passed.
    assert jax.grad(rn.checkpoint(takes_kwargs, static_argnames="flag"))(1.0, flag=1) == 2.0


def test_static_argnums_out_of_range_for_a_varargs_call():
    def h(*args):
        return args[0] * 2

    with pytest.raises(ValueError, match=r"`static_argnums` \(2,\) is out of range for this call"):
        rn.checkpoint(h, static_argnums=2)(1.0, 2)
