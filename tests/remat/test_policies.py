"""Every built-in policy and alias: same values and gradients as no remat, and exactly the
saved residuals the policy promises, by name and count."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn
from remat_nn._jax_internals import saved_residuals
from tests.gradients import rel_err

L, B, D = 3, 2, 4


def layer(x, w, wb):
    h = rn.name(x @ w, "proj")  # dot without batch dims
    a = rn.name(jnp.tanh(h), "act")
    z = jnp.einsum("bd,bde->be", a, wb)  # dot with a batch dim
    return rn.name(jnp.sin(z), "out")


def net(x, ws, wbs):
    for i in range(L):
        x = layer(x, ws[i], wbs[i])
    return jnp.sum(x * x)


@pytest.fixture(scope="module")
def args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (B, D))
    ws = jax.random.normal(k2, (L, D, D)) / 2
    wbs = jax.random.normal(k3, (L, B, D, D)) / 2
    return x, ws, wbs


def residual_kinds(fn, *args):
    """Counter of the non-argument residuals: 'name:act', 'dot_general', 'offloaded name:out'."""
    kinds = Counter()
    for r in rn.memory_report(fn, *args).residuals:
        if r.kind == "argument":
            continue
        label = f"name:{r.name}" if r.kind == "named" else r.primitive
        kinds[("offloaded " if r.action == "offloaded" else "") + label] += 1
    return kinds


SAVE_OUT = jax.checkpoint_policies.save_only_these_names("out")
SAVE_OUT_TYPO = jax.checkpoint_policies.save_only_these_names("outt")

# policy spec -> the non-argument residuals it promises on `net` (L layers, 2 dots per layer).
PROMISES = {
    "nothing_saveable": {},
    "full": {},
    "dots_saveable": {"dot_general": 2 * L},
    "checkpoint_dots": {"dot_general": 2 * L},
    "dots": {"dot_general": 2 * L},
    "dots_with_no_batch_dims_saveable": {"dot_general": L},
    "checkpoint_dots_with_no_batch_dims": {"dot_general": L},
    "dots_no_batch": {"dot_general": L},
    ("save_only_these_names", "act"): {"name:act": L},
    ("save_any_names_but_these", "act"): {"name:proj": L, "name:out": L},
    ("save_from_both_policies", "dots_no_batch", SAVE_OUT): {"dot_general": L, "name:out": L},
    "save=act,out": {"name:act": L, "name:out": L},
    "offload=out;save=proj": {"name:proj": L, "offloaded name:out": L},
    "recompute=act;default=save": {"name:proj": L, "name:out": L},
}


def _spec(key):
    return (key, ()) if isinstance(key, str) else (key[0], key[1:])


@pytest.mark.parametrize("key", list(PROMISES), ids=str)
def test_policy_keeps_values_and_saves_what_it_promises(key, args):
    name, extra = _spec(key)
    fn = rn.checkpoint(net, policy=rn.policy(name, *extra))
    want_v, want_g = jax.value_and_grad(net, argnums=(0, 1, 2))(*args)
    got_v, got_g = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(*args)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-6)
    assert rel_err(got_g, want_g) < 1e-6, rel_err(got_g, want_g)
    assert residual_kinds(fn, *args) == Counter(PROMISES[key])


def test_offload_factories_keep_gradients_and_offload(args):
    fn = rn.checkpoint(
        net,
        policy=rn.policy(
            "save_and_offload_only_these_names",
            names_which_can_be_saved=["proj"],
            names_which_can_be_offloaded=["out"],
        ),
    )
    assert residual_kinds(fn, *args) == Counter({"name:proj": L, "offloaded name:out": L})
    fn = rn.checkpoint(net, policy=rn.policy("offload_dot_with_no_batch_dims"))
    assert residual_kinds(fn, *args) == Counter({"offloaded dot_general": L})
    assert rel_err(jax.jit(jax.grad(fn))(*args), jax.grad(net)(*args)) < 1e-6


def test_everything_saveable_matches_no_remat(args):
    plain = residual_kinds(net, *args)
    assert plain  # no remat saves intermediates
    assert residual_kinds(rn.checkpoint(net, policy="everything_saveable"), *args) == plain


def test_none_is_no_wrapper_everywhere_and_no_policy():
    # One meaning of "none": no remat wrapper. The wrappers return their target unchanged; as a
    # policy it would be ambiguous (JAX's policy=None recomputes everything), so it is refused.
    import flax.linen as fnn
    from flax import nnx

    from remat_nn import nn as rnn
    from remat_nn import nnx as rnnx

    assert rn.checkpoint(net, policy="none") is net
    assert rnn.remat(fnn.Dense, policy="none") is fnn.Dense
    assert rnnx.remat(net, policy="none") is net
    assert rnnx.remat(nnx.Linear, policy="none") is nnx.Linear
    with pytest.raises(rn.PolicyError, match="everything_saveable"):
        rn.policy("none")
    assert "none" not in rn.ALIASES


# factory -> (arguments with a typo, the same arguments spelled right, what those save on `net`)
NAME_FACTORIES = {
    "save_only_these_names": ((("act", "actt"), {}), (("act",), {}), {"name:act": L}),
    "save_any_names_but_these": (
        (("actt",), {}),
        (("act",), {}),
        {"name:proj": L, "name:out": L},
    ),
    "save_and_offload_only_these_names": (
        ((), {"names_which_can_be_saved": ["act"], "names_which_can_be_offloaded": ["outt"]}),
        ((), {"names_which_can_be_saved": ["act"], "names_which_can_be_offloaded": ["out"]}),
        {"name:act": L, "offloaded name:out": L},
    ),
}


def _made_by(maker, factory, pos, kw):
    """The factory's policy, made by rn.policy or by JAX itself (the offload one's memory
    kinds, which rn.policy defaults, given)."""
    if maker == "rn.policy":
        return rn.policy(factory, *pos, **kw)
    if factory == "save_and_offload_only_these_names":
        kw = {**kw, "offload_src": "device", "offload_dst": "pinned_host"}
    return getattr(jax.checkpoint_policies, factory)(*pos, **kw)


@pytest.mark.parametrize("maker", ["rn.policy", "jax.checkpoint_policies"])
@pytest.mark.parametrize("factory", list(NAME_FACTORIES))
def test_name_factory_typos_are_plan_errors_at_first_trace(factory, maker, args):
    import flax.linen as fnn

    from remat_nn import nn as rnn
    from remat_nn import nnx as rnnx

    (pos, kw), (fixed_pos, fixed_kw), saves = NAME_FACTORIES[factory]
    policy = _made_by(maker, factory, pos, kw)
    with pytest.raises(rn.PlanError, match=r"never occur in net.*Did you mean"):
        jax.grad(rn.checkpoint(net, policy=policy))(*args)
    with pytest.raises(rn.PlanError, match="never occur in net"):
        jax.grad(rnnx.remat(net, policy=policy))(*args)

    class Layer(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return net(x, *args[1:])

    with pytest.raises(rn.PlanError, match=r"never occur in Layer.__call__"):
        rnn.remat(Layer, policy=policy)().init(jax.random.key(0), args[0])
    # Names that occur pass: the same factory, spelled right, saves what it promises.
    fixed = rn.checkpoint(net, policy=_made_by(maker, factory, fixed_pos, fixed_kw))
    assert residual_kinds(fixed, *args) == Counter(saves)
    assert rel_err(jax.grad(fixed)(*args), jax.grad(net)(*args)) < 1e-6


def test_save_from_both_of_two_name_policies_checks_both(args):
    cp = jax.checkpoint_policies
    typo = cp.save_from_both_policies(cp.save_only_these_names("act"), SAVE_OUT_TYPO)
    with pytest.raises(rn.PlanError, match=r"\['outt'\] never occur in net.*'outt' -> 'out'"):
        jax.grad(rn.checkpoint(net, policy=typo))(*args)
    both = cp.save_from_both_policies(
        cp.save_only_these_names("act"), cp.save_any_names_but_these("proj")
    )
    fn = rn.checkpoint(net, policy=both)
    assert residual_kinds(fn, *args) == Counter({"name:act": L, "name:out": L})
    # With a policy that is not about names (here dots), the names go unchecked, as JAX's own.
    dots_or_typo = cp.save_from_both_policies(cp.dots_saveable, SAVE_OUT_TYPO)
    jax.grad(rn.checkpoint(net, policy=dots_or_typo))(*args)


def test_a_callable_of_ones_own_that_saves_nothing_warns_once():
    from remat_nn import nn as rnn

    def by_name(prim, *_, **params):  # a hand-written name policy, with a typo
        return params.get("name") == "hh"

    def f(x):
        return jnp.sum(jnp.sin(rn.name(jnp.cos(x), "h")))

    for wrap in (rn.checkpoint, rnn.remat):
        fn = wrap(f, policy=by_name)
        with pytest.warns(UserWarning) as record:
            jax.grad(fn)(jnp.ones(2))
            jax.grad(fn)(jnp.ones(3))  # traced again (another shape): no second warning
        assert len(record) == 1, [str(r.message) for r in record]
        assert re.match(
            r"rn.checkpoint: the callable `policy` '.*by_name' saves nothing in f at its first "
            r"trace .*names that occur: \['h'\]\).*Fix: ",
            str(record[0].message),
        )
    # One that saves something, and JAX's own policies, pass silently (warnings are errors here).
    jax.grad(rn.checkpoint(f, policy=lambda prim, *_, **params: params.get("name") == "h"))(
        jnp.ones(2)
    )
    jax.grad(rn.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable))(jnp.ones(2))


def test_save_anything_except_warns_that_jax_saves_everything(args):
    with pytest.warns(UserWarning, match="saves every value"):
        p = rn.policy("save_anything_except_these_names", "act")
    everything = residual_kinds(rn.checkpoint(net, policy="none"), *args)
    assert residual_kinds(rn.checkpoint(net, policy=p), *args) == everything


def test_memory_report_totals_equal_saved_residuals(args):
    fn = rn.checkpoint(net, policy="dots")
    expected = sum(
        int(np.prod(aval.shape)) * aval.dtype.itemsize for aval, _ in saved_residuals(fn, *args)
    )
    report = rn.memory_report(fn, *args)
    assert report.total_bytes == expected
    assert len(report.residuals) == len(saved_residuals(fn, *args))
    text = str(report)
    assert "residuals by name" in text and "residuals by source" in text
    assert "test_policies.py" in text  # sources point at the user's lines


def test_memory_report_groups_by_name_with_action(args):
    fn = rn.checkpoint(net, policy="offload=out;save=proj")
    by_name = rn.memory_report(fn, *args).by_name()
    assert by_name["proj"]["count"] == L and by_name["proj"]["actions"] == {"saved"}
    assert by_name["out"]["actions"] == {"offloaded"}
    assert by_name["out"]["bytes"] == L * B * D * 4


# --- resolution errors ------------------------------------------------------------------------


def test_unknown_policy_lists_valid_names_and_closest():
    with pytest.raises(rn.PolicyError, match=r"'dots_savable'.*Did you mean 'dots_saveable'"):
        rn.policy("dots_savable")
    with pytest.raises(ValueError, match="nothing_saveable"):  # PolicyError is a ValueError
        rn.policy("nothng")


def test_every_jax_policy_name_resolves():
    jax_names = {n for n in dir(jax.checkpoint_policies) if not n.startswith("_")}
    assert jax_names <= set(rn.POLICIES)
    for alias, target in rn.ALIASES.items():
        assert rn.policy(alias) is rn.policy(target)


def test_factory_without_arguments_is_a_type_error():
    with pytest.raises(TypeError, match="save_only_these_names.*needs arguments"):
        rn.policy("save_only_these_names")


def test_arguments_to_a_plain_policy_are_rejected():
    with pytest.raises(rn.PolicyError, match="takes no arguments"):
        rn.policy("dots_saveable", "x")


def test_callables_pass_through_and_bad_types_are_rejected():
    f = jax.checkpoint_policies.dots_saveable
    assert rn.policy(f) is f
    assert rn.policy(None) is None
    with pytest.raises(TypeError, match=r"`spec`.*int 3"):
        rn.policy(3)
