"""remat_nn.nnx: nnx.remat behaviour preserved plus names, plans and validation; reversible NNX
stacks (gradients, state, memory flat in depth); the memory report and the planner on an NNX
model; the NNX example config trained by `python -m train` through nnx.bridge.to_linen."""

from __future__ import annotations

import functools
import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import remat_nn as rn
from remat_nn import nnx as rnnx
from tests.gradients import rel_err

# Inputs made with NumPy: no compile at import.
X = jnp.asarray(np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, rate: float = 0.0):
        self.l0 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.l1 = nnx.Linear(8, 4, rngs=rngs)
        self.l2 = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        h = rn.name(self.l0(x), "dense_0")
        h = self.drop(rn.name(jnp.tanh(self.bn(h)), "act_0"))
        return self.l2(rn.name(jnp.tanh(self.l1(h)), "act_1"))


def _trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _saved(remat, policy, rate=0.0):
    """The residuals reverse-mode saves through a remat'd MLP (traced, nothing compiled)."""
    body = remat(lambda m, x: m(x), policy=policy)
    fn, params = rnnx.pure(lambda m, x: body(m, x).sum(), MLP(nnx.Rngs(0), rate))
    report = rn.memory_report(fn, params, X)
    return sorted((r.kind, r.name, r.shape, r.action) for r in report.residuals)


def _run(remat, policy, rate):
    """Loss, gradients and updated BatchNorm / RNG state of one jitted step of a remat'd MLP."""
    model = MLP(nnx.Rngs(0), rate)
    body = remat(lambda m, x: m(x), policy=policy)
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: body(m, X).sum()))(model)
    return loss, grads, nnx.state(model, nnx.Any(nnx.BatchStat, nnx.RngCount))


# --- flax parity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable])
def test_same_values_gradients_state_and_residuals_as_nnx_remat(policy):
    # Dropout on: the mask is recomputed from the same stream in both.
    ours, theirs = _run(rnnx.remat, policy, 0.5), _run(nnx.remat, policy, 0.5)
    for a, b in zip(ours, theirs, strict=True):
        _trees_equal(a, b)
    (count,) = jax.tree.leaves(ours[2]["drop"]["rngs"]["count"])
    assert int(count) == 1  # the stream advanced once, as in flax
    for p in (policy, jax.checkpoint_policies.nothing_saveable):
        assert _saved(rnnx.remat, p, 0.5) == _saved(nnx.remat, p, 0.5)


def test_signature_is_a_superset_of_nnx_remat():
    theirs = inspect.signature(nnx.remat).parameters
    ours = inspect.signature(rnnx.remat).parameters
    for name, p in theirs.items():
        assert name in ours and ours[name].kind == p.kind, name
        if name != "f":  # flax's sentinel for "no function: return a decorator"; ours is None
            assert ours[name].default == p.default, name
    assert set(ours) - set(theirs) == {"methods"}
    assert rnnx.checkpoint is rnnx.remat


# --- names, policies and plans --------------------------------------------------------------------


def test_policy_names_resolve_and_plans_change_what_is_saved():
    dots = _saved(rnnx.remat, "dots_saveable")
    assert dots == _saved(nnx.remat, jax.checkpoint_policies.dots_saveable)
    full = _saved(rnnx.remat, "full")
    assert full == _saved(nnx.remat, jax.checkpoint_policies.nothing_saveable) != dots
    plan = rn.plan(save=["act_0"], offload=["act_1"])
    planned = _saved(rnnx.remat, plan)
    # The plan's compiled policy through flax's own remat saves the same.
    assert planned == _saved(nnx.remat, plan.to_policy())
    added = sorted(set(planned) - set(full))
    assert added == [("named", "act_0", (3, 8), "saved"), ("named", "act_1", (3, 4), "offloaded")]
    assert not [r for r in full if r[0] == "named"]


def test_plan_name_absent_from_the_body_is_an_error_at_first_use():
    model = MLP(nnx.Rngs(0))
    typo = rnnx.remat(lambda m, x: m(x), policy={"save": ["act_O"]})
    with pytest.raises(rn.PlanError, match=r"\['act_O'\] never occur in <lambda>.*'act_0'"):
        typo(model, X)

    class Decorated(MLP):
        @rnnx.remat(policy="save=act_9")
        def __call__(self, x):
            return super().__call__(x)

    with pytest.raises(rn.PlanError, match=r"\['act_9'\] never occur in __call__"):
        Decorated(nnx.Rngs(0))(X)
    with pytest.raises(rn.PlanError, match=r"never occur in MLP.__call__"):
        rnnx.remat(MLP, policy="save=nope")(nnx.Rngs(0))(X)


class Scaled(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x, double):
        h = rn.name(self.lin(x), "hid")
        return jnp.tanh(h) * (2.0 if double else 1.0)  # Python control flow: `double` static


def test_class_form_and_decorator_with_static_argnums():
    plain = Scaled(nnx.Rngs(0))
    grad = nnx.jit(nnx.grad(lambda m: m(X, True).sum()))
    want = grad(plain)

    class Decorated(Scaled):
        __call__ = rnnx.remat(Scaled.__call__, policy="save=hid", static_argnums=(2,))

    Remat = rnnx.remat(Scaled, policy="save=hid", static_argnums=(2,))
    assert Remat.__name__ == "Scaled" and issubclass(Remat, Scaled)
    for cls in (Decorated, Remat):
        model = cls(nnx.Rngs(0))
        _trees_equal(grad(model), want)
        fn, params = rnnx.pure(lambda m, x: m(x, True).sum(), model)
        assert rn.memory_report(fn, params, X).names() == {"hid": 1}


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: rnnx.remat(lambda m: m, policy=["act_0"]), TypeError, r"`policy`.*A list is not"),
        (lambda: rnnx.remat(lambda m: m, policy="dotz"), rn.PolicyError, r"'dotz'"),
        (
            lambda: rnnx.remat(lambda m: m, prevent_cse="yes"),  # pyright: ignore[reportArgumentType]
            TypeError,
            r"`prevent_cse`.*'yes'",
        ),
        (
            lambda: rnnx.remat(lambda m: m, graph=1),  # pyright: ignore[reportArgumentType]
            TypeError,
            r"`graph` must be True or False",
        ),
        (lambda: rnnx.remat(lambda m, x: m, static_argnums=(2,)), ValueError, r"out of range"),
        (lambda: rnnx.remat(nnx.Dropout(0.5)), TypeError, r"instance of Dropout.*remat\(type\(m"),
        (lambda: rnnx.remat(lambda m: m, methods=["f"]), TypeError, r"`methods` applies to a"),
        (lambda: rnnx.remat(MLP, methods=["encode"]), ValueError, r"\['encode'\].*not methods"),
        (lambda: rnnx.remat(MLP, methods="__call__"), TypeError, r"`methods` must be a list"),
    ],
)
def test_bad_arguments_fail_at_wrap_time_naming_the_value(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- reversible stacks ----------------------------------------------------------------------------


class Residual(nnx.Module):
    """F or G: optional BatchNorm -> Linear (small init) -> tanh -> optional dropout.

    ``stream``: an ``nnx.Rngs`` the dropout draws from (F and G of a layer may share one, so
    F's draws advance G's); None: the dropout's own stream (``nnx.Dropout`` forks one).
    """

    def __init__(self, d_in, d_out, rngs, *, norm=False, rate=0.0, stream=None):
        init = nnx.initializers.normal(0.3 / d_in**0.5)
        self.lin = nnx.Linear(d_in, d_out, kernel_init=init, rngs=rngs)
        self.bn = nnx.BatchNorm(d_in, rngs=rngs) if norm else None
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.stream = stream

    def __call__(self, x, *, train=True):
        if self.bn is not None:  # before the Linear: a BatchNorm after it zeroes the bias gradient
            x = self.bn(x, use_running_average=not train)
        return self.drop(jnp.tanh(self.lin(x)), deterministic=not train, rngs=self.stream)


def _stack(cls, depth, width=8, *, shared_stream=False, **kw):
    out = width if cls is rnnx.AdditiveCoupling else 2 * width

    def layer(r):
        kw_layer = {**kw, "stream": nnx.Rngs(dropout=r.default()) if shared_stream else None}
        return cls(Residual(width, out, r, **kw_layer), Residual(width, out, r, **kw_layer))

    def build():
        return rnnx.ReversibleSequence(layer, depth, rngs=nnx.Rngs(0))

    return nnx.jit(build)()  # one compiled init (eagerly, each initializer op compiles alone)


XS = jnp.asarray(np.sin(np.arange(64, dtype=np.float32)).reshape(4, 16))


def test_reversible_gradient_and_batchnorm_equal_plain_autodiff_through_nnx_scan():
    # Affine couplings with training-mode BatchNorm in F and G; the reference is the NNX idiom
    # for a stack of layers (nnx.scan over the stacked layers), where autodiff stores everything.
    seq = _stack(rnnx.AffineCoupling, 3, norm=True)
    ref, init = nnx.clone(seq), nnx.clone(seq)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def plain(h, layer):
        return layer(h)

    grads = nnx.jit(nnx.grad(lambda s: jnp.sum(s(XS) ** 2)))(seq)
    want = nnx.jit(nnx.grad(lambda s: jnp.sum(plain(XS, s.layers) ** 2)))(ref)
    assert rel_err(grads, want) < 1e-5
    # BatchNorm averages updated once, by the forward pass, as nnx.scan updates them.
    stats = [nnx.state(m, nnx.BatchStat) for m in (seq, ref)]
    assert rel_err(*stats) < 1e-6
    assert rel_err(stats[0], nnx.state(init, nnx.BatchStat)) > 1e-3  # they did change
    x_rec = nnx.jit(lambda s: s.inverse(s(XS)))(seq)
    assert float(jnp.max(jnp.abs(x_rec - XS))) < 1e-5


def test_dropout_masks_match_the_stored_stack_and_are_replayed_by_the_inverse():
    # F and G of a layer draw from one shared stream: F's draws advance the count G sees.
    stored = _stack(rnnx.AdditiveCoupling, 3, rate=0.5, shared_stream=True)
    stored.reversible = False  # the same layers, keys and results, plain autodiff (core's scan)
    seq = nnx.clone(stored)
    seq.reversible = True
    start = nnx.clone(seq)  # streams at count 0
    loss = lambda s: jnp.sum(s(XS) ** 2)  # noqa: E731
    (l_rev, g_rev), (l_ref, g_ref) = (nnx.jit(nnx.value_and_grad(loss))(m) for m in (seq, stored))
    assert abs(float(l_rev - l_ref)) <= 1e-5 * abs(float(l_ref))
    assert rel_err(g_rev, g_ref) < 1e-5
    counts = jax.tree.leaves(nnx.state(seq, nnx.RngCount))
    assert counts and all(np.all(np.asarray(c) == 1) for c in counts)  # advanced once
    # The inverse replays the masks of the stream state it is given: count 0 -> the forward's.
    forward, inverse = nnx.jit(lambda m: m(XS)), nnx.jit(lambda m, y: m.inverse(y))
    y = forward(nnx.clone(start))
    assert float(jnp.max(jnp.abs(inverse(start, y) - XS))) < 1e-5
    assert float(jnp.max(jnp.abs(inverse(seq, y) - XS))) > 1e-3  # count 1: other masks
    assert float(jnp.max(jnp.abs(forward(seq) - y))) > 1e-3  # the next call draws new masks


def test_activation_memory_flat_in_depth_while_plain_grows():
    x = jnp.asarray(np.sin(np.arange(256 * 16, dtype=np.float32)).reshape(256, 16))
    temp = {}
    for depth in (4, 16):
        seq = _stack(rnnx.AdditiveCoupling, depth)
        for reversible in (True, False):
            seq.reversible = reversible
            fn, params = rnnx.pure(lambda s, x: jnp.sum(s(x) ** 2), seq)
            compiled = jax.jit(jax.grad(fn)).lower(params, x).compile()
            temp[reversible, depth] = compiled.memory_analysis().temp_size_in_bytes
    print(f"temp bytes (reversible, depth): {temp}")
    assert temp[True, 16] <= 1.1 * temp[True, 4]
    activation = 256 * 8 * 4  # one half of the stream, float32
    assert temp[False, 16] - temp[False, 4] >= 12 * activation  # >= one half per added layer
    assert temp[True, 16] < temp[False, 4]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"depth": 0}, ValueError, r"`depth` must be a positive int, got 0"),
        ({"make_layer": nnx.Dropout(0.5)}, TypeError, r"`make_layer` must be"),
        ({"make_layer": lambda r: nnx.Linear(2, 2, rngs=r)}, TypeError, r"`forward` and"),
        ({"rngs": 0}, TypeError, r"`rngs` must be an nnx.Rngs, got int"),
    ],
)
def test_reversible_sequence_bad_arguments(kwargs, error, match):
    def build():  # under nnx.jit: a failing build compiles nothing
        args = {
            "make_layer": lambda r: rnnx.AdditiveCoupling(Residual(2, 2, r), Residual(2, 2, r)),
            "depth": 2,
            "rngs": nnx.Rngs(0),
            **kwargs,
        }
        return rnnx.ReversibleSequence(args.pop("make_layer"), args.pop("depth"), **args)

    with pytest.raises(error, match=match):
        nnx.jit(build)()


def test_reversible_sequence_bad_call_arguments():
    seq = _stack(rnnx.AdditiveCoupling, 2, width=2)
    with pytest.raises(TypeError, match=r"keyword argument train= must be a static"):
        seq(XS[:, :4], train=jnp.array(True))
    with pytest.raises(ValueError, match=r"even size"):
        seq(XS[:, :3])


class NormDense(nnx.Module):
    """F or G without RNG streams: BatchNorm -> Linear (small init) -> tanh."""

    def __init__(self, d, rngs):
        self.bn = nnx.BatchNorm(d, rngs=rngs)
        self.lin = nnx.Linear(d, d, kernel_init=nnx.initializers.normal(0.3 / d**0.5), rngs=rngs)

    def __call__(self, x, *, train=True):
        return jnp.tanh(self.lin(self.bn(x, use_running_average=not train)))


def test_coupling_layer_runs_one_layer_as_the_sequence_does():
    # rnnx.coupling_layer: a ReversibleSequence's layer for a caller that scans the layers itself,
    # over pure dicts of one layer's variables. Scanned over the stacked ones, it gives the
    # sequence's training-mode output and BatchNorm averages; its inverse and its fused backward
    # give the input back and plain autodiff's VJP.
    def build():
        coupling = lambda r: rnnx.AdditiveCoupling(NormDense(8, r), NormDense(8, r))  # noqa: E731
        return rnnx.ReversibleSequence(coupling, 3, rngs=nnx.Rngs(0))

    seq = nnx.jit(build)()
    params = nnx.to_pure_dict(nnx.state(seq.layers, nnx.Param))
    stats = nnx.to_pure_dict(nnx.state(seq.layers, nnx.BatchStat))
    layer = rnnx.coupling_layer(seq, train=True)
    x = tuple(jnp.split(XS, 2, axis=-1))  # (4, 8) each
    scan = jax.jit(lambda p, s, h: jax.lax.scan(lambda h, ps: layer.forward(*ps, h), h, (p, s)))
    y, new = scan(params, stats, x)
    want = nnx.jit(lambda s: s(XS, train=True))(seq)  # updates seq's averages
    assert rel_err(jnp.concatenate(y, axis=-1), want) <= 1e-6
    assert rel_err(new, nnx.to_pure_dict(nnx.state(seq.layers, nnx.BatchStat))) <= 1e-6
    assert rel_err(new, stats) > 1e-3  # they did change
    # The inverse and the fused backward in float64 (BatchNorm's statistics of 4 examples
    # amplify float32 round-off to 1.4e-5).
    with jax.enable_x64(True):
        wide = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), t)  # noqa: E731
        p0, s0 = (wide(jax.tree.map(lambda a: a[0], t)) for t in (params, stats))
        x = wide(x)
        y0 = layer.forward(p0, s0, x)[0]
        assert rel_err(layer.inverse(p0, s0, y0), x) <= 1e-12
        dy = (jnp.ones((4, 8), jnp.float64), -jnp.ones((4, 8), jnp.float64))
        h, dp, dx = layer.backward(p0, s0, y0, dy)
        want_dp, want_dx = jax.vjp(lambda p, h: layer.forward(p, s0, h)[0], p0, x)[1](dy)
        assert all(a.dtype == jnp.float64 for a in jax.tree.leaves((h, dp, dx)))
        assert rel_err(h, x) <= 1e-12
        err = rel_err((dp, dx), (want_dp, want_dx))
        print(f"float64: inverse {rel_err(h, x):.2g}, backward {err:.2g}")
        assert err <= 1e-12
    with pytest.raises(ValueError, match=r"hold RNG streams .*Fix: build F and G"):
        rnnx.coupling_layer(_stack(rnnx.AdditiveCoupling, 2))  # Residual's dropout stream
    with pytest.raises(TypeError, match=r"must be a ReversibleSequence of couplings, got"):
        rnnx.coupling_layer(seq.layers)
    with pytest.raises(TypeError, match=r"argument `f` must be a callable"):
        rnnx.AdditiveCoupling(3, nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


# --- the memory report and the planner on an NNX model -------------------------------------------


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        h = rn.name(jax.nn.gelu(self.up(rn.name(x * 1.5, "mlp_in"))), "mlp_hidden")
        return x + rn.name(self.down(h), "mlp_out")


class ScannedNet(nnx.Module):
    """Blocks stacked with nnx.vmap and run by nnx.scan, each under rnnx.remat(policy)."""

    def __init__(self, depth, rngs):
        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)

    def __call__(self, x, policy="none"):
        body = rnnx.remat(lambda block, h: block(h), policy=policy)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(h, block):
            return body(block, h)

        return step(x, self.blocks)


def test_memory_report_and_planner_on_an_nnx_model():
    net = nnx.jit(lambda: ScannedNet(6, nnx.Rngs(0)))()
    x = jnp.asarray(np.sin(np.arange(64 * 16, dtype=np.float32)).reshape(64, 16))

    def loss(model, x, *, policy="none"):
        return jnp.mean(model(x, policy) ** 2)

    fn, params = rnnx.pure(loss, net)
    report = rn.memory_report(functools.partial(fn, policy="save=mlp_hidden"), params, x)
    assert report.names() == {"mlp_hidden": 1}
    (hidden,) = [r for r in report.residuals if r.name == "mlp_hidden"]
    assert hidden.shape == (6, 64, 64)  # one per layer, stacked by the scan

    def temp(policy):
        compiled = jax.jit(jax.grad(functools.partial(fn, policy=policy))).lower(params, x)
        return compiled.compile().memory_analysis().temp_size_in_bytes

    # Slow recompute, fast memory: the model prefers saving what fits.
    planned = rn.plan_for_budget(
        fn, params, x, budget=0.5, flops_per_second=1e9, memory_bandwidth=1e12, measure=False
    )
    print(planned)
    assert planned.budget_bytes < planned.no_remat_temp_bytes
    assert isinstance(planned.plan, rn.Plan) and planned.plan.save  # it keeps some names
    # The plan, applied to the NNX model through rnnx.remat, fits.
    assert temp(planned.plan) == planned.compiled_temp_bytes <= planned.budget_bytes
    with pytest.raises(rn.PlanError, match=r"never occur"):
        rn.memory_report(functools.partial(fn, policy="save=mlp_hiden"), params, x)
    with pytest.raises(TypeError, match=r"`module` must be an nnx.Module, got dict"):
        rnnx.pure(loss, {"w": x})  # pyright: ignore[reportArgumentType]


# --- the NNX example config, trained by python -m train -------------------------------------------


def test_example_model_takes_remat_plans_through_the_bridge():
    import models

    x = jax.ShapeDtypeStruct((8, 8, 8, 1), jnp.float32)
    saved = {}
    for remat in ("none", "full", "save_conv_out"):
        model = models.build("nnx_revnet", width=4, depth=1, remat=remat)
        init = functools.partial(model.init, train=False)
        shapes = jax.eval_shape(init, jax.random.key(0), x)  # nothing compiled
        variables = jax.tree.map(lambda a: jnp.asarray(np.zeros(a.shape, a.dtype)), shapes)

        def loss(params, x, model=model, stats=variables["batch_stats"]):
            variables = {"params": params, "batch_stats": stats}
            out, _ = model.apply(variables, x, train=True, mutable=["batch_stats"])
            return jnp.sum(out**2)

        report = rn.memory_report(loss, variables["params"], jnp.asarray(np.ones(x.shape, x.dtype)))
        named = {r.name: r.nbytes for r in report.residuals if r.name}
        saved[remat] = (named, report.saved_bytes)
    conv_out = 8 * 4 * 4 * 8 * 4  # (B, H / 2, W / 2, 2 * width) float32
    assert saved["full"][0] == saved["none"][0] == {}
    assert saved["save_conv_out"][0] == {"conv_out": conv_out}
    assert saved["full"][1] < saved["save_conv_out"][1] < saved["none"][1]
    with pytest.raises(ValueError, match=r"\['conv_outt'\], which nnx_revnet never produces"):
        models.build("nnx_revnet", remat={"save": ["conv_outt"]})


def test_nnx_example_config_trains_through_the_bridge(tmp_path):
    from tests.trainer_cli import run_in_process

    run_dir = tmp_path / "nnx"
    code, out = run_in_process(
        [
            "--config",
            "configs/nnx_revnet.yaml",
            "model.options.width=16",
            "model.options.depth=1",
            "data.batch_size=32",
            "train.steps=20",
            "train.log_every=4",
            "train.eval_every=20",
            "train.plot=false",
            "checkpoint.every=20",
            "optim.warmup_steps=2",
            f"run_dir={run_dir}",
        ]
    )
    assert code == 0, out
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in lines if r["split"] == "train"]
    (final,) = [r for r in lines if r["split"] == "eval"]
    print(f"train losses {train}; eval {final}")
    assert train[-1] < 0.85 * train[0]  # measured: 2.42 -> 1.83
    assert final["accuracy"] > 0.3  # 10 classes: chance is 0.1; measured 0.60
    assert "donation: XLA aliases" in out


# --- rnnx.tied_remat: an unrolled loop of units that remats on XLA:CPU too -----------------------


class _TiedUnit(nnx.Module):
    """BatchNorm (state updated in the forward), dropout (a key drawn), a named hidden."""

    def __init__(self, width: int, rngs: nnx.Rngs):
        self.bn = nnx.BatchNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        h = rn.name(jax.nn.gelu(self.up(self.bn(x))), "mlp_hidden")
        return x + self.drop(self.down(h))


class _TiedNet(nnx.Module):
    def __init__(self, call, width: int, rngs: nnx.Rngs):
        self.call = call
        self.units = nnx.List([_TiedUnit(width, rngs) for _ in range(4)])

    def __call__(self, x):
        for unit in self.units:  # unrolled
            x = self.call(unit, x)
        return x


def _tied_step(call, width=64, batch=32):
    """The jitted (gradients, new state) of a 4-unit loop and its compiled temp bytes."""
    graphdef, state = nnx.split(_TiedNet(call, width, nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (batch, width))

    def step(state, x):
        model = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=(0, 1))(model, x)
        return grads, nnx.state(model)

    compiled = jax.jit(step).lower(state, x).compile()
    out = jax.tree.leaves(compiled(state, x))
    floats = [a for a in out if jnp.issubdtype(a.dtype, jnp.floating)]
    return floats, compiled.memory_analysis().temp_size_in_bytes


def test_tied_remat_recomputes_an_unrolled_loop_with_plain_gradients_and_state():
    plain, plain_temp = _tied_step(lambda unit, x: unit(x))
    tied, tied_temp = _tied_step(lambda unit, x: rnnx.tied_remat(unit, x, policy="full"))
    remat, remat_temp = _tied_step(
        lambda unit, x: rnnx.remat(lambda m, x: m(x), policy="full")(unit, x)
    )
    # Gradients, BatchNorm averages and the dropout streams: the recompute replays the mask.
    assert rel_err(tied, plain) <= 1e-5
    assert rel_err(remat, plain) <= 1e-5
    hidden = 32 * 4 * 64 * 4  # one unit's (B, 4W) float32 hidden
    print(f"temp: plain {plain_temp:,} B, rnnx.remat {remat_temp:,} B, tied {tied_temp:,} B")
    # Three units' hiddens (at least) are no longer held; rnnx.remat alone holds what plain does.
    assert tied_temp <= plain_temp - 3 * hidden, (tied_temp, plain_temp)


def test_tied_remat_checks_its_plan_and_arguments():
    unit, x = _TiedUnit(8, nnx.Rngs(0)), jax.random.normal(jax.random.key(0), (4, 8))
    twin = nnx.clone(unit)  # the same draws: "none" is the unit's own call
    with pytest.raises(rn.PlanError, match=r"\['mlp_hiden'\] never occur"):
        jax.grad(lambda x: jnp.sum(rnnx.tied_remat(unit, x, policy={"save": ["mlp_hiden"]})))(x)
    with pytest.raises(TypeError, match=r"`unit` must be an nnx.Module instance, got function"):
        rnnx.tied_remat(lambda x: x, x, policy="full")
    assert rel_err(rnnx.tied_remat(unit, x, policy="none"), twin(x)) == 0.0
