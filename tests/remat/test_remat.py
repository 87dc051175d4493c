"""nn.remat: flax.linen.remat behaviour preserved, plus names, plans and validation."""

from functools import partial

import flax
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import remat_nn as rn
from remat_nn import nn
from tests.gradients import rel_err


class MLP(fnn.Module):
    features: tuple[int, ...] = (8, 4)
    rate: float = 0.0
    train: bool = False

    @fnn.compact
    def __call__(self, x):
        for i, f in enumerate(self.features):
            x = rn.name(fnn.Dense(f)(x), f"dense_{i}")
            x = rn.name(jnp.tanh(x), f"act_{i}")
            x = fnn.Dropout(self.rate, deterministic=not self.train)(x)
        return x

    def encode(self, x):
        return self(x) * 2


def _trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


# --- flax parity ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable])
def test_class_transform_matches_flax(policy):
    ours, theirs = nn.remat(MLP, policy=policy)(), fnn.remat(MLP, policy=policy)()
    v1, v2 = ours.init(jax.random.key(0), X), theirs.init(jax.random.key(0), X)
    _trees_equal(v1, v2)
    _trees_equal(ours.apply(v1, X), theirs.apply(v2, X))
    g1 = jax.grad(lambda v: ours.apply(v, X).sum())(v1)
    g2 = jax.grad(lambda v: theirs.apply(v, X).sum())(v2)
    _trees_equal(g1, g2)


def test_parameter_tree_does_not_depend_on_the_policy():
    trees = [
        jax.tree.map(jnp.shape, nn.remat(MLP, policy=p)().init(jax.random.key(0), X))
        for p in (None, "full", "dots", "save=act_0;offload=dense_1")
    ]
    assert all(t == trees[0] for t in trees)
    plain = jax.tree.map(jnp.shape, fnn.remat(MLP)().init(jax.random.key(0), X))
    assert trees[0] == plain


@pytest.mark.parametrize("policy", ["full", "dots", "save=act_0", "none"])
def test_remat_never_changes_the_parameter_tree_inside_a_parent(policy):
    # flax's remat names the class "Checkpoint" + name, so a parent's auto-named child moves from
    # MLP_0 to CheckpointMLP_0 when remat is switched on; nn.remat keeps the target's name, so
    # variables (and checkpoints) move between remat and no remat.
    def make(remat):
        class Parent(fnn.Module):
            @fnn.compact
            def __call__(self, x):
                return remat(MLP)()(remat(MLP)()(x)[..., :4])

        return Parent()

    ours = make(lambda cls: nn.remat(cls, policy=policy)).init(jax.random.key(1), X)
    plain = make(lambda cls: cls).init(jax.random.key(1), X)
    theirs = make(fnn.remat).init(jax.random.key(1), X)
    assert sorted(ours["params"]) == sorted(plain["params"]) == ["MLP_0", "MLP_1"]
    assert sorted(theirs["params"]) == ["CheckpointMLP_0", "CheckpointMLP_1"]
    _trees_equal(ours, plain)
    y_plain = make(lambda cls: cls).apply(plain, X)
    y_ours = make(lambda cls: nn.remat(cls, policy=policy)).apply(plain, X)
    np.testing.assert_array_equal(y_ours, y_plain)


@pytest.mark.parametrize("remat", [nn.remat, fnn.remat], ids=["remat_nn", "flax"])
def test_static_argnums_class_and_decorator(remat):
    seen = []

    class Foo(fnn.Module):
        @fnn.compact
        def __call__(self, x, train: bool):
            seen.append(type(train))
            return fnn.Dense(3, use_bias=False)(x)

    foo = remat(Foo, static_argnums=(2,))()
    v = foo.init(jax.random.key(0), X, True)
    assert foo.apply(v, X, False).shape == (3, 3)
    assert seen and all(t is bool for t in seen)

    class Bar(fnn.Module):
        @partial(remat, static_argnums=(2,))
        @fnn.compact
        def __call__(self, x, train: bool):
            assert isinstance(train, bool)
            return fnn.Dense(3, use_bias=False)(x) * (2.0 if train else 1.0)

    bar = Bar()
    v = bar.init(jax.random.key(0), X, True)
    np.testing.assert_allclose(bar.apply(v, X, True), 2 * bar.apply(v, X, False))


def test_methods_are_lifted_as_in_flax():
    ours = nn.remat(MLP, methods=["encode"], policy="full")()
    theirs = fnn.remat(MLP, methods=["encode"])()
    v = ours.init(jax.random.key(0), X, method="encode")
    _trees_equal(v, theirs.init(jax.random.key(0), X, method="encode"))
    _trees_equal(ours.apply(v, X, method="encode"), theirs.apply(v, X, method="encode"))


def test_rng_handling_matches_flax_and_dropout_mask_is_recomputed():
    ours = nn.remat(MLP, policy="full")(rate=0.5, train=True)
    theirs, plain = fnn.remat(MLP)(rate=0.5, train=True), MLP(rate=0.5, train=True)
    v = plain.init(jax.random.key(0), X)
    rngs = {"dropout": jax.random.key(7)}

    def loss(m):
        return lambda p: m.apply({"params": p}, X, rngs=rngs).sum()

    g_plain = jax.grad(loss(plain))(v["params"])
    _trees_equal(jax.grad(loss(ours))(v["params"]), jax.grad(loss(theirs))(v["params"]))
    assert rel_err(jax.grad(loss(ours))(v["params"]), g_plain) < 1e-6


def _dropout_masks(report) -> list[tuple[int, ...]]:
    # A dropout mask is the bool `lt` of the random bits against the keep rate.
    return sorted(r.shape for r in report.residuals if r.dtype == "bool")


def test_dropout_mask_is_recomputed_under_a_policy_that_saves_the_matmuls():
    # Under `dots` the backward keeps the matmul outputs, so something is saved: the mask next
    # to them must still be recomputed from the key (bit-identical, or the gradient would
    # differ from plain autodiff's), never stored.
    plain = MLP(rate=0.5, train=True)
    v = plain.init(jax.random.key(0), X)
    rngs = {"dropout": jax.random.key(7)}

    def loss(m):
        return lambda p: m.apply({"params": p}, X, rngs=rngs).sum()

    dots = loss(nn.remat(MLP, policy="dots")(rate=0.5, train=True))
    report = rn.memory_report(dots, v["params"])
    outputs = sorted(r.shape for r in report.residuals if r.kind == "output")
    assert outputs == [(3, 4), (3, 8)]  # the two Dense matmuls (B, F), and nothing else
    assert {r.primitive for r in report.residuals if r.kind == "output"} == {"dot_general"}
    assert _dropout_masks(report) == [], str(report)
    assert rel_err(jax.grad(dots)(v["params"]), jax.grad(loss(plain))(v["params"])) < 1e-6
    # The check can see a saved mask: saving everything keeps both layers' masks.
    every = loss(nn.remat(MLP, policy="everything_saveable")(rate=0.5, train=True))
    assert _dropout_masks(rn.memory_report(every, v["params"])) == [(3, 4), (3, 8)]


def test_variables_filter_as_in_flax():
    class Counter(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            c = self.variable("counter", "n", lambda: jnp.zeros((), jnp.int32))
            c.value += 1
            return fnn.Dense(2)(x)

    for remat in (nn.remat, fnn.remat):
        m = remat(Counter)()
        v = m.init(jax.random.key(0), X)
        _, state = m.apply(v, X, mutable=["counter"])
        assert int(state["counter"]["n"]) == 2


# --- plain functions --------------------------------------------------------------------------


def test_plain_function_is_jax_checkpoint_with_resolution():
    def f(x):
        h = rn.name(jnp.sin(x), "h")
        return jnp.sum(jnp.cos(h) * h)

    x = jnp.linspace(0.0, 1.0, 5)
    for spec in ("full", "dots", "save=h", rn.plan(save=["h"])):
        g = jax.grad(nn.remat(f, policy=spec))(x)
        assert rel_err(g, jax.grad(f)(x)) < 1e-6, spec
    names = rn.memory_report(nn.remat(f, policy="save=h"), x).names()
    assert names == {"h": 1}


def test_python_control_flow_error_points_to_static_argnums():
    # JAX's own message for remat'd functions already names static_argnums; keep it that way.
    def f(x, flag):
        return x * 2 if flag > 0 else x

    with pytest.raises(jax.errors.TracerBoolConversionError, match="static_argnums"):
        jax.grad(nn.remat(f, policy="full"))(1.0, jnp.array(1.0))
    assert jax.grad(nn.remat(f, static_argnums=(1,)))(1.0, 1) == 2.0


# --- plans ------------------------------------------------------------------------------------


def test_plan_forms_agree():
    mapping = {"save": ["query_proj"], "offload": ["mlp_hidden"], "default": "recompute"}
    p = rn.plan(mapping)
    assert rn.plan("save=query_proj; offload=mlp_hidden") == p
    assert rn.plan(yaml.safe_load("save: [query_proj]\noffload: [mlp_hidden]\n")) == p
    assert rn.plan(**mapping) == p
    assert rn.plan(p.to_dict()) == p and rn.plan(p) is p
    assert p.action("mlp_hidden") == "offload" and p.action("other") == "recompute"


def test_plan_from_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("remat:\n  save: [a]\n  recompute: [b]\n  default: save\n")
    assert rn.plan(path) == rn.plan(save=["a"], recompute=["b"], default="save")


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"save": ["a"], "offload": ["a"]}, r"'a' is listed in both 'save' and 'offload'"),
        ({"save": ["a", "a"]}, r"'a' is listed twice"),
        ({"save": "a"}, r"`save` must be a list.*\['a'\]"),
        ({"save": [3]}, r"`save` holds 3"),
        ({"default": "offload"}, r"`default` must be 'save' or 'recompute', got 'offload'"),
        ({"sav": ["a"]}, r"unknown keys \['sav'\]"),
        ("save", r"cannot read 'save'"),
    ],
)
def test_plan_validation_errors_name_the_value(spec, match):
    with pytest.raises(rn.PlanError, match=match):
        rn.plan(spec)


def test_plan_name_absent_from_function_is_an_error(jax_upgrade_flags):
    def f(x):
        return jnp.sum(rn.name(jnp.sin(x), "mlp_hidden"))

    with pytest.raises(rn.PlanError, match=r"\['mlp_hiden'\] never occur.*\['mlp_hidden'\]"):
        rn.plan(save=["mlp_hiden"]).check(f, jnp.ones(3))
    with pytest.raises(rn.PlanError, match=r"'mlp_hiden' -> 'mlp_hidden'"):
        jax.grad(rn.checkpoint(f, policy="save=mlp_hiden"))(jnp.ones(3))
    assert rn.plan(save=["mlp_hidden"]).check(f, jnp.ones(3)) == {"mlp_hidden"}


def test_plan_name_absent_from_module_is_an_error_at_first_use():
    block = nn.remat(MLP, policy={"save": ["act_0", "act_9"]})()
    with pytest.raises(rn.PlanError, match=r"\['act_9'\] never occur in MLP.__call__"):
        block.init(jax.random.key(0), X)
    ok = nn.remat(MLP, policy={"save": ["act_0"], "offload": ["dense_1"]})()
    v = ok.init(jax.random.key(0), X)
    names = rn.memory_report(lambda p: ok.apply({"params": p}, X).sum(), v["params"]).names()
    assert names == {"act_0": 1, "dense_1": 1}


def test_jax_name_policies_are_checked_as_flax_users_pass_them(jax_upgrade_flags):
    # The flax habit: JAX's own factory, passed to remat as a callable.
    cp = jax.checkpoint_policies
    typo = nn.remat(MLP, policy=cp.save_only_these_names("act_0", "dens_1"))()
    with pytest.raises(
        rn.PlanError,
        match=r"\['dens_1'\] never occur in MLP.__call__.*Names that occur: "
        r"\['act_0', 'act_1', 'dense_0', 'dense_1'\].*'dens_1' -> 'dense_1'",
    ):
        typo.init(jax.random.key(0), X)
    ok = nn.remat(MLP, policy=cp.save_only_these_names("act_0", "dense_1"))()
    v = ok.init(jax.random.key(0), X)
    names = rn.memory_report(lambda p: ok.apply({"params": p}, X).sum(), v["params"]).names()
    assert names == {"act_0": 1, "dense_1": 1}
    g = jax.grad(lambda p: ok.apply({"params": p}, X).sum())(v["params"])
    want = jax.grad(lambda p: MLP().apply({"params": p}, X).sum())(v["params"])
    assert rel_err(g, want) < 1e-6


def test_plan_names_inside_nested_scan_are_found(jax_upgrade_flags):
    def body(c, _):
        return rn.name(jnp.sin(c), "inner"), None

    def f(x):
        return jnp.sum(jax.lax.scan(body, x, None, length=3)[0])

    assert rn.plan(save=["inner"]).check(f, jnp.ones(2)) == {"inner"}
    g = jax.grad(rn.checkpoint(f, policy="save=inner"))(jnp.ones(2))
    assert rel_err(g, jax.grad(f)(jnp.ones(2))) < 1e-6


def test_remat_rejects_module_instances_as_flax_does():
    with pytest.raises(flax.errors.TransformTargetError, match="Dense"):
        nn.remat(fnn.Dense(2))


def test_plans_under_jax_remat3_save_their_names_or_fail_loudly(jax_upgrade_flags):
    """JAX's new remat (the `jax_remat3` upgrade flag) applies only name lists and the dots
    policies: a plan of names becomes the name list with the same meaning; a policy it would
    silently ignore (recompute everything) is an error, never a no-op."""

    def f(x):
        h = rn.name(jnp.sin(x), "mlp_hidden")
        return jnp.sum(jnp.sin(rn.name(h * h, "mlp_out")))

    x = jnp.linspace(0.0, 1.0, 4)
    keep_out = {"default": "save", "recompute": ["mlp_hidden"]}
    for spec, saved in (("save=mlp_hidden", {"mlp_hidden"}), (keep_out, {"mlp_out"})):
        g = rn.checkpoint(f, policy=spec)
        assert set(rn.memory_report(g, x).names()) == saved, spec
        assert rel_err(jax.grad(g)(x), jax.grad(f)(x)) < 1e-6
    if jax_upgrade_flags == "default":
        return
    for spec in ("offload=mlp_hidden", "everything_saveable", lambda *_, **__: True):
        with pytest.raises(rn.PolicyError, match="jax_remat3"):
            rn.checkpoint(f, policy=spec)
        with pytest.raises(rn.PolicyError, match="jax_remat3"):
            nn.remat(MLP, policy=spec)
