"""Trainer features users of MaxText / Levanter / flax examples expect: gradient accumulation,
initialising from another run, time-based checkpoints, TensorBoard scalars, the lr-0 warning,
a pluggable loss, the profiler window.

Runs use a tiny dense model (tests/train/tiny_models.py: no BatchNorm, no dropout: an example's
output depends on that example only, so accumulating micro-batches is exactly one large batch) on
the embedded digits data, a few steps each, in this process.
"""

from __future__ import annotations

import gzip
import json
import shutil
import struct

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.gradients import rel_err
from tests.train import tiny_models
from train import autoplan, init_from, loop
from train import state as state_lib
from train.checkpoint import Checkpointer
from train.config import Optim, load_config
from train.experiment import build_experiment

DENSE = tiny_models.DENSE
TinyDense = tiny_models.TinyDense


@pytest.fixture(scope="module", autouse=True)
def dense_model_registered():
    with tiny_models.registered(DENSE):
        yield


def make_cfg(run_dir, *overrides: str):
    return load_config(
        None,
        [
            f"model.name={DENSE}",
            "data.source=digits",
            "data.batch_size=32",
            "train.steps=4",
            "train.log_every=2",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.plot=false",
            "train.verify_donation=false",
            "checkpoint.every=2",
            "checkpoint.keep=2",
            "checkpoint.async_save=false",
            f"run_dir={run_dir}",
            *overrides,
        ],
    )


# ------------------------------ gradient accumulation ------------------------------


def _dense_problem(batch_size: int = 32):
    model = TinyDense()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(0, 1, (batch_size, 8, 8, 1)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, batch_size), jnp.int32)
    params = model.init(jax.random.key(0), x[:1])["params"]
    return model, params, {"x": x, "y": y}


def test_accumulated_gradient_is_the_large_batch_gradient():
    model, params, batch = _dense_problem()
    loss_fn = state_lib.make_loss_fn(model, compute_dtype=jnp.float32, has_batch_stats=False)
    key = jax.random.key(1)
    (want_loss, (want_acc, _)), want = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        params, {}, batch, key
    )
    for k in (2, 8):
        fn = jax.jit(state_lib.accumulated_value_and_grad(loss_fn, k))
        (loss, (acc, _)), grads = fn(params, {}, batch, key)
        assert rel_err(grads, want) <= 1e-6, k
        assert rel_err(loss, want_loss) <= 1e-6 and rel_err(acc, want_acc) <= 1e-6


def _adamw_steps(k: int, dtype, *, steps: int = 4, reverse: bool = False):
    # `steps` adamw updates (the trainer's optimizer, weight decay on) of TinyDense on batches of
    # 32, each gradient over k micro-batches; `reverse`: every batch with its rows reversed.
    # An optax loss, so that under x64 everything is `dtype` (the trainer's casts logits to
    # float32).
    model = TinyDense()
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.uniform(0, 1, (steps, 32, 8, 8, 1)), dtype)  # (steps, B, H, W, C)
    ys = jnp.asarray(rng.integers(0, 10, (steps, 32)), jnp.int32)
    if reverse:
        xs, ys = xs[:, ::-1], ys[:, ::-1]
    params = model.init(jax.random.key(0), xs[0, :1])["params"]
    params = jax.tree.map(lambda p: p.astype(dtype), params)

    def loss_fn(params, batch_stats, batch, key):
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return jnp.mean(loss), ({}, batch_stats)

    tx, _ = state_lib.make_optimizer(Optim(lr=0.05, warmup_steps=2, weight_decay=0.1), steps)
    grad_fn = state_lib.accumulated_value_and_grad(loss_fn, k)

    def step(carry, batch):
        params, opt_state = carry
        grads = grad_fn(params, {}, batch, jax.random.key(1))[1]
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    run = jax.jit(lambda p: jax.lax.scan(step, (p, tx.init(p)), {"x": xs, "y": ys})[0][0])
    return run(params)


def test_grad_accum_adamw_steps_are_the_large_batch_steps_up_to_round_off():
    # Accumulating sums the examples in another order; adam's m / sqrt(v) passes a gradient's
    # relative round-off on to the update. In float64 the 4 steps agree to round-off; in
    # float32 they differ by as much as the large batch differs from itself with its examples
    # in reverse order (the same mathematical update).
    with jax.enable_x64(True):
        want = _adamw_steps(1, jnp.float64)
        assert jax.tree.leaves(want)[0].dtype == jnp.float64
        assert rel_err(_adamw_steps(4, jnp.float64), want) <= 1e-14
    want = _adamw_steps(1, jnp.float32)
    reordered = rel_err(_adamw_steps(1, jnp.float32, reverse=True), want)
    accumulated = rel_err(_adamw_steps(4, jnp.float32), want)
    assert 0 < reordered <= 1e-6 and accumulated <= 4 * reordered, (accumulated, reordered)


def test_grad_accum_run_takes_the_large_batch_steps(tmp_path):
    # The whole trainer on 8 devices: 4 steps of batch 32 as 4 micro-batches of 8 (one example per
    # device) reach the parameters of 4 steps of batch 32 in one pass.
    common = ("optim.lr=0.05", "checkpoint.every=100")
    one = loop.run(make_cfg(tmp_path / "one", *common))
    accum = loop.run(make_cfg(tmp_path / "accum", *common, "train.grad_accum=4"))
    assert rel_err(accum.state.params, one.state.params) <= 1e-6
    assert rel_err(accum.state.opt_state, one.state.opt_state) <= 1e-6
    lines = [json.loads(s) for s in (tmp_path / "accum" / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(s) for s in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lines] == pytest.approx([r["loss"] for r in want], rel=1e-6)


def test_grad_accum_that_does_not_split_over_the_devices_is_refused(tmp_path):
    # 32 splits into 8 micro-batches of 4, but 4 examples do not split over 8 devices.
    with pytest.raises(loop.SetupError, match=r"train.grad_accum=8 .* multiple of 64"):
        loop.run(make_cfg(tmp_path / "bad", "train.grad_accum=8"), dry_run=True)


def test_dry_run_memory_is_the_micro_batch_step(tmp_path):
    # The step compiled (and measured by --dry-run) holds one micro-batch's activations.
    temp = {}
    for k in (1, 8):
        lines: list[str] = []
        knobs = ("data.batch_size=1024", "mesh.data=1", "model.options.width=256")
        knobs = (*knobs, f"train.grad_accum={k}")
        cfg = make_cfg(tmp_path / f"dry{k}", *knobs)
        loop.run(cfg, dry_run=True, out=lines.append)
        text = "\n".join(lines)
        temp[k] = _temp_bytes(text)
        if k > 1:
            assert "8 micro-batches of 128" in text
    assert temp[8] < temp[1] / 4, temp


def test_planner_plans_the_micro_batch(tmp_path, monkeypatch):
    # remat: {policy: auto} budgets the backward of one device's micro-batch.
    seen = {}

    class Planned(Exception):
        pass

    def capture(remat, *, batch, **kwargs):
        seen.update(batch)
        raise Planned

    monkeypatch.setattr(autoplan, "load_or_plan", capture)
    auto = ("model.name=revnet38", "remat={policy: auto, budget: 1MiB}", "data.batch_size=64")
    auto = (*auto, "train.grad_accum=4")
    with pytest.raises(Planned):
        loop.run(make_cfg(tmp_path / "auto", *auto), dry_run=True)
    assert seen["x"].shape == (64 // 8 // 4, 8, 8, 1) and seen["y"].shape == (2,)


def _temp_bytes(text: str) -> float:
    # The "temp: 1.5 MiB" line of the compiled memory the dry run prints last.
    value, unit = text.rsplit("temp: ", 1)[1].split("\n", 1)[0].split()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


# ------------------------------ init_from ------------------------------


def _initial_state(cfg):
    # The state a run of cfg starts from (its run directory has no checkpoint).
    exp = build_experiment(cfg, say=lambda s: None)
    ckpt = Checkpointer(exp.run_dir / "checkpoints", cfg.checkpoint, config_hash="", warn=print)
    try:
        return loop.restore_or_init(exp, ckpt, allow_dtype_cast=False, allow_config_change=False)
    finally:
        ckpt.close()


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("source")
    result = loop.run(make_cfg(run_dir, "optim.name=adamw"))
    return run_dir, jax.device_get(result.state)


def test_init_from_params_takes_the_model_variables_only(tmp_path, source_run):
    src, final = source_run
    cfg = make_cfg(tmp_path / "ft", "optim.name=adamw", f"init_from={{path: {src}}}")
    state, resume = _initial_state(cfg)
    fresh = jax.device_get(jax.jit(state_lib.make_init(TinyDense(), _adamw(), _x(), seed=0))())
    assert resume.step == 0 and int(state.step) == 0
    assert jax.tree.all(jax.tree.map(np.array_equal, jax.device_get(state.params), final.params))
    opt = jax.device_get(state.opt_state)
    assert jax.tree.all(jax.tree.map(np.array_equal, opt, fresh.opt_state))
    assert np.array_equal(jax.device_get(state.rng), fresh.rng)


def test_init_from_all_takes_the_whole_state_and_its_step(tmp_path, source_run):
    src, final = source_run
    cfg = make_cfg(
        tmp_path / "all",
        "optim.name=adamw",
        "train.steps=8",
        f"init_from={{path: {src}, what: all}}",
    )
    state, resume = _initial_state(cfg)
    assert resume.step == 4 and resume.data_state is None
    assert jax.tree.all(jax.tree.map(np.array_equal, jax.device_get(state), final))


def test_init_from_a_model_that_differs_names_the_leaf(tmp_path, source_run):
    src, _ = source_run
    wide = make_cfg(tmp_path / "w", "model.options.width=32", f"init_from={{path: {src}}}")
    with pytest.raises(
        loop.CheckpointError,
        match=r"\['params'\]\['Dense_0'\]\['kernel'\]: saved \(64, 16\) float32, "
        r"expected \(64, 32\)",
    ):
        _initial_state(wide)
    sgd = make_cfg(tmp_path / "s", f"init_from={{path: {src}, what: all}}")  # adamw's state saved
    with pytest.raises(
        loop.CheckpointError, match=r"(?s)train state.*\['opt_state'\].*what=params"
    ):
        _initial_state(sgd)
    with pytest.raises(loop.CheckpointError, match="init_from.path=.*no finished checkpoint"):
        init_from.source_step(tmp_path / "none")


def test_init_from_a_damaged_source_is_refused(tmp_path, source_run):
    src, _ = source_run
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    step_dir = init_from.source_step(copy)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    leaf = manifest["leaves"]["['params']['Dense_1']['bias']"]
    leaf["crc32"] = leaf["crc32"] ^ 1
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        loop.CheckpointError, match=r"is damaged: .*\['params'\]\['Dense_1'\]\['bias'\]"
    ):
        _initial_state(make_cfg(tmp_path / "d", f"init_from={{path: {copy}}}"))


def _adamw():
    return state_lib.make_optimizer(make_cfg("x", "optim.name=adamw").optim, 4)[0]


def _x():
    return jax.ShapeDtypeStruct((1, 8, 8, 1), jnp.float32)


# ------------------------------ time-based checkpoints ------------------------------


def test_every_minutes_checkpoints_by_wall_time(tmp_path, monkeypatch):
    # A clock that advances 30 s per read: read at the start, after each step and after each
    # save, so one minute has passed after steps 2 and 4 (and step 6 is the end).
    ticks = iter(range(0, 10_000, 30))
    monkeypatch.setattr(loop, "_clock", lambda: float(next(ticks)))
    knobs = ("train.steps=6", "checkpoint.every=100", "checkpoint.keep=10")
    loop.run(make_cfg(tmp_path / "timed", *knobs, "checkpoint.every_minutes=1"))
    saved = sorted(
        int(p.name) for p in (tmp_path / "timed" / "checkpoints").iterdir() if p.name.isdigit()
    )
    assert saved == [2, 4, 6]


# ------------------------------ TensorBoard ------------------------------


def _scalars(run_dir) -> list[tuple[str, int, float]]:
    # Every scalar of the run's event files, read back record by record (TFRecord framing:
    # length u64, its crc u32, the Event proto, its crc u32).
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted((run_dir / "tensorboard").iterdir()):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + n])
            at += 12 + n + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_scalars_continue_one_stream_after_a_resume(tmp_path):
    knobs = ("train.steps=6", "train.log_every=1", "train.eval_every=3")
    full = tmp_path / "full"
    loop.run(make_cfg(full, *knobs))
    run_dir = tmp_path / "resumed"
    loop.run(make_cfg(run_dir, *knobs), stop_after=4)
    # As if killed after logging steps 3 and 4 but before the checkpoint at 4 was written.
    shutil.rmtree(run_dir / "checkpoints" / "4")
    loop.run(make_cfg(run_dir, *knobs))
    got = _scalars(run_dir)
    # Each tag's steps once and in order, in the order TensorBoard reads the files.
    for tag in {t for t, _, _ in got}:
        steps = [s for t, s, _ in got if t == tag]
        assert steps == sorted(set(steps)), (tag, steps)
    want = _scalars(full)
    assert sorted((t, s) for t, s, _ in got) == sorted((t, s) for t, s, _ in want)
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    from_jsonl = {(f"{r['split']}/loss", r["step"]): r["loss"] for r in lines}
    assert {(t, s): v for t, s, v in got if t.endswith("/loss")} == pytest.approx(from_jsonl)


# ------------------------------ extending a run whose lr reached 0 ------------------------------


def test_extending_a_run_whose_lr_reached_zero_warns(tmp_path, capsys):
    run_dir = tmp_path / "ext"
    loop.run(make_cfg(run_dir))  # cosine to 0 over 4 steps
    capsys.readouterr()
    kept = ("train.steps=6", "optim.schedule_steps=4")
    loop.run(make_cfg(run_dir, *kept), stop_after=1)
    err = capsys.readouterr().err
    assert "WARNING: the learning rate is 0 at step 4" in err and "steps 5..6" in err
    # Not with a floor above 0.
    loop.run(make_cfg(run_dir, *kept, "optim.final_lr_fraction=0.1"), allow_config_change=True)
    assert "learning rate is 0" not in capsys.readouterr().err


# ------------------------------ profiler window ------------------------------


def test_profile_window_writes_a_trace(tmp_path):
    lines: list[str] = []
    run_dir = tmp_path / "prof"
    loop.run(make_cfg(run_dir, "train.profile={start: 1, steps: 2}"), out=lines.append)
    traces = list((run_dir / "profile" / "plugins" / "profile").iterdir())
    assert len(traces) == 1, traces
    names = {p.name for p in traces[0].iterdir()}
    assert "perfetto_trace.json.gz" in names and any(n.endswith(".xplane.pb") for n in names)
    # Steps 2 and 3 of 4 ran in the window (jax 0.10 records two nested events per call).
    with gzip.open(traces[0] / "perfetto_trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert sum(e.get("name") == "PjitFunction(jit(step))" for e in events) == 2 * 2
    assert any("profile: trace written to" in s for s in lines)


# ------------------------------ pluggable loss: regression ------------------------------


class Regressor(fnn.Module):
    num_outputs: int = 1

    @fnn.compact
    def __call__(self, x, train: bool = False):
        # x (B, F) -> predictions (B, num_outputs)
        return fnn.Dense(self.num_outputs)(fnn.tanh(fnn.Dense(32)(x)))


def build_regressor(num_outputs: int = 1) -> Regressor:
    return Regressor(num_outputs=num_outputs)


def triple_mse(outputs, targets):
    """A loss of one's own (model.loss=module:function): 3 x mse, metric max_err."""
    err = outputs - targets
    return 3.0 * jnp.mean(err**2, axis=1), {"max_err": jnp.max(jnp.abs(err), axis=1)}


def _regression_cfg(run_dir, *overrides):
    return make_cfg(
        run_dir,
        "model.name=null",
        "model.module=tests.train.test_train_features:build_regressor",
        "model.task=regress",
        "data.source=synthetic",
        "data.synthetic.num_examples=256",
        "data.synthetic.outputs=2",
        "checkpoint.best_metric=eval_loss",
        "optim.name=adamw",
        "optim.lr=0.03",
        "train.log_every=1",
        "train.eval_batches=null",
        "checkpoint.every=100",
        *overrides,
    )


def test_regression_trains_with_mse_on_generated_data(tmp_path):
    result = loop.run(_regression_cfg(tmp_path / "reg", "train.steps=60", "train.eval_every=60"))
    lines = [json.loads(s) for s in (tmp_path / "reg" / "metrics.jsonl").read_text().splitlines()]
    first = lines[0]
    assert "mae" in first and "accuracy" not in first
    # The eval loss is the mean squared error of the final parameters on the test split,
    # computed here from scratch; it went from the targets' scale to near the noise (0.01).
    exp_data = loop.data_lib.load(make_cfg("x", *_regression_data()).data, task="regress")
    pred = Regressor(num_outputs=2).apply({"params": result.state.params}, exp_data.test_x)
    want = float(np.mean((np.asarray(pred) - exp_data.test_y) ** 2))
    assert result.eval["loss"] == pytest.approx(want, rel=1e-5)
    assert result.eval["loss"] < 0.1 * first["loss"], (first["loss"], result.eval["loss"])


def _regression_data():
    return ("data.source=synthetic", "data.synthetic.num_examples=256", "data.synthetic.outputs=2")


def test_a_loss_function_of_ones_own(tmp_path):
    # Same init and first batch: the first step's loss (taken before the update) is 3 x mse's.
    mse_run = _regression_cfg(tmp_path / "mse", "train.steps=1")
    own = _regression_cfg(
        tmp_path / "own", "train.steps=1", "model.loss=tests.train.test_train_features:triple_mse"
    )
    loop.run(mse_run)
    result = loop.run(own)
    read = lambda d: json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[0])
    assert read("own")["loss"] == pytest.approx(3 * read("mse")["loss"], rel=1e-6)
    assert "max_err" in read("own") and set(result.eval) == {"loss", "max_err"}
    with pytest.raises(loop.SetupError, match="best_metric=eval_accuracy .*best_metric=eval_loss"):
        loop.run(
            own.model_copy(
                update={
                    "checkpoint": own.checkpoint.model_copy(
                        update={"best_metric": "eval_accuracy", "keep_best": 1}
                    )
                }
            ),
            dry_run=True,
        )
    with pytest.raises(loop.SetupError, match="model.loss='nope'"):
        loop.run(make_cfg(tmp_path / "bad", "model.loss=nope"), dry_run=True)


def test_npz_regression_data_is_tabular(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((40, 5)), rng.standard_normal(40)
    np.savez(tmp_path / "t.npz", x_train=x, y_train=y)
    cfg = make_cfg(tmp_path, "data.source=npz", f"data.path={tmp_path / 't.npz'}")
    ds = loop.data_lib.load(cfg.data, task="regress")
    assert ds.task == "regress" and ds.num_outputs == 1
    assert ds.train_x.shape == (32, 5) and ds.test_y.shape == (8, 1)
    assert ds.train_x.dtype == ds.train_y.dtype == np.float32
    # The rows stay paired: every (features, target) pair is one of the file's.
    pairs = {tuple(np.float32(r)) + (np.float32(t),) for r, t in zip(x, y, strict=True)}
    assert all(tuple(r) + (t[0],) in pairs for r, t in zip(ds.train_x, ds.train_y, strict=True))
