"""``train.update_in_backward``: the trainer's step with the optimizer update inside the backward.

The fused step (train/fused.py, rn.fused_update_step) against the two-phase step
(train.state.make_train_step) on the scanned transformer: the same state after 10 steps for each
optimizer form the config can build and each remat mode of the stack (max-scaled relative error
<= 1e-6, in float64), bf16 compute with its own bound; through the trainer a fused and a
two-phase run resume each other's checkpoints; the options it cannot run with are refused
(exit 2) naming the option.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import models
import remat_nn as rn
from models import transformer as tf
from tests.gradients import rel_err
from tests.trainer_cli import ROOT, run_in_process
from train import fused as fused_lib
from train import loop, run_dir
from train import state as state_lib
from train.config import Optim, load_config

V, T, B = 32, 8, 4


def _model(**options):
    kw = dict(vocab_size=V, d_model=16, n_heads=2, n_layers=3, d_ff=32, max_len=T) | options
    return tf.Transformer(**kw)


def _steps(model, optim: Optim, *, compute_dtype=jnp.float32, state_dtype=jnp.float32, n=3):
    """The fused and the two-phase state after ``n`` steps, from one init, on fixed batches."""
    tx, schedule = state_lib.make_optimizer(optim, 10)
    example = jax.ShapeDtypeStruct((B, T), jnp.int32)
    state = jax.jit(state_lib.make_init(model, tx, example, seed=0))()
    state = jax.tree.map(
        lambda x: x.astype(state_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state
    )
    spec = models.get("transformer")
    steps = {
        "fused": fused_lib.make_fused_train_step(  # the clip (optim.clip_norm) is its own
            spec.layer_stack(model),
            state_lib.make_optimizer(optim, 10, clip=False)[0],
            schedule,
            compute_dtype=compute_dtype,
            clip_norm=optim.clip_norm,
        ),
        "two_phase": state_lib.make_train_step(
            model, tx, schedule, compute_dtype=compute_dtype, has_batch_stats=False
        ),
    }
    tokens = jax.random.randint(jax.random.key(1), (n, B, T + 1), 0, V)
    out = {}
    for name, step in steps.items():
        s, step = jax.tree.map(jnp.copy, state), jax.jit(step, donate_argnums=0)
        for i in range(n):
            s, m = step(s, {"x": tokens[i, :, :-1], "y": tokens[i, :, 1:]})
        out[name] = (s, m)
    return out


def _state_err(got, want) -> float:
    assert int(got.step) == int(want.step) and np.array_equal(got.rng, want.rng)
    return max(
        float(rn.relative_error(got.params, want.params, floor=1e-2)),
        float(rn.relative_error(got.opt_state, want.opt_state, floor=1e-2)),
    )


def _assert_same_run(out, label: str) -> None:
    (fused, fm), (ref, rm) = out["fused"], out["two_phase"]
    err = _state_err(fused, ref)
    print(f"{label}: params and optimizer state max-scaled rel err {err:.3g}")
    assert err <= 1e-6
    assert abs(float(fm["loss"]) - float(rm["loss"])) <= 1e-6 * abs(float(rm["loss"]))


def test_fused_step_equals_two_phase_step():
    # adamw with a weight-decay mask by path and a warm-up + cosine schedule, each block under a
    # per-name plan, rotary positions. (sgd with momentum, Nesterov and weight decay under the
    # default plan, full, runs through the trainer below; no remat with bf16 compute.)
    # In float64 (state and compute), so the comparison sees the steps' order of operations and
    # not float32 round-off, which adam's normalisation amplifies on leaves whose gradient is
    # round-off (the key bias: softmax ignores it) or small.
    optim = Optim(
        name="adamw", lr=1e-2, weight_decay=0.1, decay_exclude=["bias", "scale"], warmup_steps=1
    )
    with jax.enable_x64(True):
        model = _model(
            dtype=jnp.float64, remat=rn.plan({"save": ["query_proj"]}), position="rotary"
        )
        out = _steps(model, optim, compute_dtype=jnp.float64, state_dtype=jnp.float64, n=10)
    (fused, fm), (ref, rm) = out["fused"], out["two_phase"]
    # A leaf whose exact gradient is 0 (the key bias: softmax ignores it) holds round-off only,
    # which adam normalises: a leaf's scale is at least 1e-2 of its tree's largest, as in the
    # project's other comparisons of gradients computed two ways.
    err = _state_err(fused, ref)
    print(f"10 steps float64, params and optimizer state max-scaled rel err {err:.3g}")
    assert jax.tree.structure(fused) == jax.tree.structure(ref)
    assert err <= 1e-6
    assert int(fused.step) == 10
    for k in ("loss", "accuracy", "grad_norm", "lr"):
        assert abs(float(fm[k]) - float(rm[k])) <= 1e-6 * max(abs(float(rm[k])), 1.0), k
    assert bool(fm["finite"])


@pytest.mark.parametrize("reconstruct", [True, False])
def test_reversible_transformer_fused_step_equals_two_phase_step(reconstruct):
    # reversible=true: additive couplings (attention F, MLP G) in one scan. With reconstruct the
    # fused step rebuilds each coupling's input from its output (the coupling's inverse fused
    # with its VJP) instead of saving it, as the two-phase step's reversible backward does.
    # float64 as above.
    optim = Optim(name="adamw", lr=1e-2, weight_decay=0.1, warmup_steps=1)
    with jax.enable_x64(True):
        model = _model(
            dtype=jnp.float64,
            reversible=True,
            reconstruct=reconstruct,
            recon_dtype=jnp.float64,
            remat=None,
        )
        out = _steps(model, optim, compute_dtype=jnp.float64, state_dtype=jnp.float64, n=10)
    _assert_same_run(out, f"reversible (reconstruct={reconstruct}), 10 steps float64")


def test_clip_norm_fused_step_equals_two_phase_step():
    # optim.clip_norm: the two-phase step chains optax.clip_by_global_norm; the fused step runs
    # the optimizer without it (optax.identity in its place: the same state) and clips by the
    # global norm from a first backward pass. A bound the gradients exceed, so the clip acts.
    optim = Optim(name="adamw", lr=1e-2, weight_decay=0.1, warmup_steps=1, clip_norm=0.1)
    with jax.enable_x64(True):
        model = _model(dtype=jnp.float64)
        out = _steps(model, optim, compute_dtype=jnp.float64, state_dtype=jnp.float64, n=10)
    assert float(out["two_phase"][1]["grad_norm"]) > 0.1  # clipped
    assert float(out["fused"][1]["grad_norm"]) == pytest.approx(
        float(out["two_phase"][1]["grad_norm"]), rel=1e-6
    )
    _assert_same_run(out, "clip_norm=0.1, 10 steps float64")


def test_nested_transformer_fused_step_equals_two_phase_step():
    # scan_levels=2 (blocks in rn.remat_scan, two levels): the fused step saves every k-th
    # block's input (k = the nesting's inner length, 4 of 7 here: segments of 4 and 3) and
    # recomputes a segment's in the backward. float64 as above.
    optim = Optim(name="adamw", lr=1e-2, weight_decay=0.1, warmup_steps=1)
    with jax.enable_x64(True):
        model = _model(dtype=jnp.float64, n_layers=7, scan_levels=2, remat=None)
        assert models.get("transformer").layer_stack(model).save_every == 4
        # One checkpointed scan (scan_levels=1) saves every block's input, as the model does.
        assert models.get("transformer").layer_stack(model.clone(scan_levels=1)).save_every is None
        out = _steps(model, optim, compute_dtype=jnp.float64, state_dtype=jnp.float64, n=10)
    _assert_same_run(out, "scan_levels=2, 7 blocks, 10 steps float64")


def test_reversible_transformer_fused_step_keeps_no_layer_inputs():
    # The donated fused step's temp: flat in depth when the couplings are inverted, one layer's
    # input (both halves) more per layer when they are saved (reconstruct=false).
    spec, (b, t, d) = models.get("transformer"), (8, 64, 64)
    example = jax.ShapeDtypeStruct((b, t), jnp.int32)
    temp = {}
    for reconstruct in (True, False):
        for depth in (2, 8):
            model = tf.Transformer(
                vocab_size=V, d_model=d, n_heads=2, n_layers=depth, d_ff=2 * d, max_len=t,
                reversible=True, reconstruct=reconstruct, remat=None,
            )  # fmt: skip
            tx, schedule = state_lib.make_optimizer(Optim(name="adamw", lr=1e-2), 10)
            state = jax.eval_shape(state_lib.make_init(model, tx, example, seed=0))
            step = fused_lib.make_fused_train_step(
                spec.layer_stack(model), tx, schedule, compute_dtype=jnp.float32
            )
            lowered = jax.jit(step, donate_argnums=0).lower(state, {"x": example, "y": example})
            temp[reconstruct, depth] = lowered.compile().memory_analysis().temp_size_in_bytes
    layer_input = b * t * d * 4 * 2
    print(f"temp by (reconstruct, depth): {temp}; one layer's input {layer_input} B")
    assert temp[True, 8] - temp[True, 2] < layer_input / 4
    assert temp[False, 8] - temp[False, 2] >= 6 * layer_input


def test_transformer_fused_step_holds_one_block_backward_and_the_inputs():
    # A block under `full` is recomputed from its saved input: its backward working set is the
    # plain block's VJP with the forward finished before the backward starts (measured alone
    # here, as the reference). The fused step holds that, the L saved inputs, the cotangent
    # carry and the input read from the stack. When the cotangent could start the backward
    # during the recomputation (the block under remat, or no barrier), XLA computed
    # cotangents early and held them across it: 589,760 B more here (2 layers, T 128, d 64).
    spec, (b, t, d, depth) = models.get("transformer"), (4, 128, 64, 2)
    model = tf.Transformer(
        vocab_size=V, d_model=d, n_heads=4, n_layers=depth, d_ff=4 * d, max_len=t,
        remat=tf.remat_plan("full"),
    )  # fmt: skip
    example = jax.ShapeDtypeStruct((b, t), jnp.int32)
    tx, schedule = state_lib.make_optimizer(Optim(name="sgd", lr=1e-2), 10)
    state = jax.eval_shape(state_lib.make_init(model, tx, example, seed=0))
    step = fused_lib.make_fused_train_step(
        spec.layer_stack(model), tx, schedule, compute_dtype=jnp.float32
    )
    lowered = jax.jit(step, donate_argnums=0).lower(state, {"x": example, "y": example})
    temp = lowered.compile().memory_analysis().temp_size_in_bytes

    block = tf.Block(4, 4 * d, False, 0.0, jnp.float32, train=True)
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state.params)
    x = jax.ShapeDtypeStruct((b, t, d), jnp.float32)

    def block_backward(p, x, dy):
        _, pullback = jax.vjp(lambda p, x: block.apply({"params": p}, x)[0], p, x)
        dy, pullback = jax.lax.optimization_barrier((dy, pullback))
        return pullback(dy)

    alone = jax.jit(block_backward).lower(layer["blocks"], x, x).compile().memory_analysis()
    bound = alone.temp_size_in_bytes + alone.output_size_in_bytes + (depth + 2) * 4 * b * t * d
    print(f"fused temp {temp} B; bound {bound} B (block backward alone {alone.temp_size_in_bytes}"
          f" + {alone.output_size_in_bytes} B, {depth + 2} inputs)")  # fmt: skip
    assert temp <= bound


def test_fused_step_equals_two_phase_step_bf16_compute():
    # bf16 forward and backward, float32 master weights and update, no remat: the two steps
    # round the same bf16 products; measured bit for bit equal here, held to the float32 bound.
    model = _model(dtype=jnp.bfloat16, remat=None)
    out = _steps(model, Optim(name="adamw", lr=1e-2), compute_dtype="bfloat16")
    (fused, _), (ref, _) = out["fused"], out["two_phase"]
    err = float(rn.relative_error((fused.params, fused.opt_state), (ref.params, ref.opt_state)))
    print(f"bf16 compute: 3 steps, params and optimizer state max-scaled rel err {err:.3g}")
    assert err <= 1e-6
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(fused.params))


def _stage_steps(model, optim: Optim, n=3, name="revnet38"):
    """The fused and the two-phase state of a float64 CNN of stages (registered as ``name``)
    after ``n`` steps (call under x64)."""
    tx, schedule = state_lib.make_optimizer(optim, 10)
    example = jax.ShapeDtypeStruct((B, 8, 8, 3), jnp.float64)
    state = jax.jit(state_lib.make_init(model, tx, example, seed=0))()
    state = jax.tree.map(lambda x: x.astype(jnp.float64) if x.dtype == jnp.float32 else x, state)
    steps = {
        "fused": fused_lib.make_fused_train_step(
            models.get(name).stage_stacks(model), tx, schedule, compute_dtype=jnp.float64
        ),
        "two_phase": state_lib.make_train_step(
            model, tx, schedule, compute_dtype=jnp.float64, has_batch_stats=True
        ),
    }
    x = jax.random.normal(jax.random.key(1), (n, B, 8, 8, 3), jnp.float64)
    y = jax.random.randint(jax.random.key(2), (n, B), 0, 10)
    out = {}
    for name, step in steps.items():
        s, step = jax.tree.map(jnp.copy, state), jax.jit(step, donate_argnums=0)
        for i in range(n):
            s, m = step(s, {"x": x[i], "y": y[i]})
        out[name] = (s, m)
    return out


def _stage_model(name, **options):
    """A quarter-width float64 RevNet-38 or ResNet-32 (scan_units and ``options``), each unit
    under ``full``; or the NNX RevNet, width 4, two couplings per stage (its downsampling unit
    under ``full``)."""
    from models import nnx_revnet, resnet, revnet

    if name == "nnx_revnet":
        return nnx_revnet.build(width=4, depth=2, in_channels=3, dtype="float64")
    full = rn.plan({"default": "recompute"})
    if name == "revnet38":
        arch = revnet.ARCHS[name].scaled(0.25)
        return revnet.RevNet(arch, dtype=jnp.float64, recon_dtype=jnp.float64, remat=full)
    arch = resnet.ARCHS[name].scaled(0.25)
    return resnet.ResNet(arch, dtype=jnp.float64, remat=full, scan_units=True, **options)


_SGD_NESTEROV = Optim(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
_ADAMW = Optim(name="adamw", lr=1e-2, weight_decay=0.1, warmup_steps=1)


@pytest.mark.parametrize(
    ("name", "options", "optim"),
    [
        pytest.param(name, {}, optim, id=f"{optim_id}-{name}")
        for name in ("revnet38", "resnet32", "nnx_revnet")
        for optim_id, optim in (("sgd_nesterov", _SGD_NESTEROV), ("adamw", _ADAMW))
    ]
    # scan_levels=2 (each stage's units in a nested rn.remat_scan): the fused step saves the
    # input of every k-th unit of a stage (save_every 3, 2, 2 for stacks of 5, 4, 4 units).
    + [pytest.param("resnet32", {"scan_levels": 2}, _ADAMW, id="adamw-resnet32-scan_levels_2")],
)
def test_cnn_fused_step_equals_two_phase_step_with_batch_stats(name, options, optim, monkeypatch):
    # Stages of stacks with BatchNorm (models.StageStacks, fused_update_stages): a RevNet's
    # coupling stacks, a ResNet's scanned units after each stage's first unit. The fused step's
    # new batch_stats are the forward pass's, as the two-phase step's mutable apply returns
    # them; weight decay masked off biases and BatchNorm scales (the config's). The NNX RevNet's
    # convolutions have biases, and those a BatchNorm follows hold round-off only (an exact
    # gradient of 0): compared on a floor of 1e-2 of the largest leaf
    # (tests/models/test_cnn_stages.py).
    floor = 1e-2 if name == "nnx_revnet" else 0.0
    real, save_every = rn.fused_update_stages, []

    def recorded(embed, stages, *args, **kwargs):  # what the trainer hands the fused step
        save_every.append([s.save_every for s in stages])
        return real(embed, stages, *args, **kwargs)

    monkeypatch.setattr(rn, "fused_update_stages", recorded)
    with jax.enable_x64(True):
        out = _stage_steps(_stage_model(name, **options), optim, name=name)
        (fused, fm), (ref, rm) = out["fused"], out["two_phase"]
        errs = [
            rel_err(getattr(fused, k), getattr(ref, k), floor=floor)
            for k in ("params", "opt_state")
        ]
        errs.append(rel_err(fused.batch_stats, ref.batch_stats))
    print(f"{name}/4 {options} {optim.name}, 3 steps float64: params/opt_state/batch_stats {errs}")
    stages = 2 if name == "nnx_revnet" else 3
    assert save_every == [[3, 2, 2] if options else [None] * stages]
    assert jax.tree.structure(fused) == jax.tree.structure(ref)
    assert max(errs) <= 1e-6
    assert int(fused.step) == 3 and abs(float(fm["loss"]) - float(rm["loss"])) <= 1e-9


def test_resnet_cli_run_updates_in_the_backward(tmp_path):
    # configs/resnet.yaml with scan_units (its stacks) and the fused step, at a quarter width.
    args = ["--config", str(ROOT / "configs/resnet.yaml"), "train.update_in_backward=true"]
    args += ["train.steps=3", "train.plot=false", "model.options.width=0.25", "data.batch_size=16"]
    code, out = run_in_process(
        [*args, f"run_dir={tmp_path / 'a'}", "model.options.scan_units=true"]
    )
    assert code == 0, out
    assert "done: 3 steps" in out
    code, out = run_in_process([*args, f"run_dir={tmp_path / 'b'}"])  # unscanned: no stacks
    assert code == 2, out
    assert "scan_units=false" in out and "Fix: model.options.scan_units=true" in out


def test_revnet_cli_run_updates_in_the_backward(tmp_path):
    # configs/revnet.yaml as its header runs it, with the fused step, at a quarter width.
    code, out = run_in_process(
        [
            "--config",
            str(ROOT / "configs/revnet.yaml"),
            f"run_dir={tmp_path}",
            "train.update_in_backward=true",
            "train.steps=3",
            "train.plot=false",
            "model.options.width=0.25",
            "data.batch_size=16",
        ]
    )
    assert code == 0, out
    assert "done: 3 steps" in out


# --- through the trainer ---------------------------------------------------------------------


def _cfg(run_dir, *overrides):
    return load_config(
        ROOT / "configs/debug.yaml",
        [
            f"run_dir={run_dir}",
            "model.options.max_len=16",
            "data.seq_len=16",
            "data.batch_size=8",
            "train.steps=6",
            "train.plot=false",
            "train.tensorboard=false",
            "train.eval_every=0",
            "train.eval_batches=1",
            "checkpoint.every=2",
            # sgd: adam would turn the key bias's round-off gradient into whole steps (see above)
            "optim.name=sgd",
            "optim.lr=0.02",
            "optim.nesterov=true",
            "optim.weight_decay=1e-3",
            *overrides,
        ],
    )


def test_fused_and_two_phase_runs_resume_each_others_checkpoints(tmp_path):
    # Two-phase to step 2, fused to 4, two-phase to 6, in one run directory: each step resumes
    # the other's checkpoint. The fused leg runs under the default remat plan (full).
    want = loop.run(_cfg(tmp_path / "two_phase")).state
    legs = ("", "train.update_in_backward=true", "")
    for i, leg in enumerate(legs):
        cfg = _cfg(tmp_path / "chain", *filter(None, [leg]))
        if i:  # the CLI resumes with the other step without --allow-config-change
            old = yaml.safe_load((tmp_path / "chain" / "config.yaml").read_text())
            unsafe, safe = run_dir.config_diff(old, cfg.model_dump(mode="json"))
            assert not unsafe and len(safe) == 1, (unsafe, safe)
        got = loop.run(cfg, stop_after=2)
        assert got.resumed_from == (2 * i or None) and got.step == 2 * i + 2
    err = _state_err(got.state, want)
    print(f"two-phase, fused, two-phase legs of 2 steps vs one two-phase run: rel err {err:.3g}")
    assert err <= 1e-6


def _cnn_cfg(config, path, *overrides):
    """configs/<config>.yaml at a quarter width for 3 short steps, no evaluation or plots."""
    return load_config(
        ROOT / f"configs/{config}.yaml",
        [
            f"run_dir={path}",
            "model.options.width=0.25",
            "data.batch_size=16",
            "train.steps=3",
            "train.plot=false",
            "train.tensorboard=false",
            "train.eval_every=0",
            "checkpoint.keep_best=0",
            *overrides,
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, options",
    [
        # With the default drift check: it reports in the steps' metrics, so JAX's persistent
        # compilation cache keeps both steps and the four runs compile each once.
        ("revnet", []),
        ("resnet", ["model.options.scan_units=true"]),
        # (the NNX RevNet's width is channels, not a scale)
        ("nnx_revnet", ["model.options.width=4"]),
    ],
    ids=["revnet", "resnet", "nnx_revnet"],
)
def test_cnn_fused_and_two_phase_runs_resume_each_others_checkpoints(tmp_path, config, options):
    # As above for a RevNet and a ResNet (configs/<name>.yaml at a quarter width), legs of one
    # step: the checkpoints carry the BatchNorm statistics, which the fused leg updates as the
    # two-phase legs do. Not bit for bit: in float32 the fused step differs from the two-phase
    # step in the last bits, and BatchNorm over the digits' constant border pixels amplifies
    # round-off over steps: the same RevNet under plain autodiff (reversible=false) differs
    # from the two-phase run as much (measured: 1.3e-5 in the optimizer state after 3 steps,
    # 3e-2 in the parameters after 5, as the fused run).
    def cfg(path, *overrides):
        return _cnn_cfg(config, path, *options, "checkpoint.every=1", *overrides)

    want = loop.run(cfg(tmp_path / "two_phase")).state
    for i, leg in enumerate(("", "train.update_in_backward=true", "")):
        got = loop.run(cfg(tmp_path / "chain", *filter(None, [leg])), stop_after=1)
        assert got.resumed_from == (i or None) and got.step == i + 1
    err = max(
        _state_err(got.state, want),
        float(rn.relative_error(got.state.batch_stats, want.batch_stats)),
    )
    print(f"{config}: two-phase, fused, two-phase legs vs one two-phase run: rel err {err:.3g}")
    assert err <= 1e-4


def test_dry_run_reports_the_fused_steps_memory(tmp_path):
    code, out = run_in_process(
        [
            "--config",
            str(ROOT / "configs/debug.yaml"),
            "--dry-run",
            f"run_dir={tmp_path}",
            "train.update_in_backward=true",
            "data.seq_len=16",
        ]
    )
    assert code == 0, out
    assert "optimizer update inside the backward: train.update_in_backward" in out


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["train.grad_accum=2"], "train.grad_accum=2 sums a full gradient"),
        (["train.on_nonfinite=skip"], "train.on_nonfinite=skip would undo an update"),
        (["model.options.scan_layers=false"], "scan_layers=false"),
        (["model.options.dropout=0.1"], "dropout=0.1"),
    ],
)
def test_options_it_cannot_run_with_exit_2_naming_them(tmp_path, overrides, named):
    code, out = run_in_process(
        [
            "--config",
            str(ROOT / "configs/debug.yaml"),
            f"run_dir={tmp_path}",
            "train.update_in_backward=true",
            "data.seq_len=16",
            *overrides,
        ]
    )
    assert code == 2, out
    assert "train.update_in_backward=true (the optimizer update inside the backward" in out
    assert named in out
    assert not (tmp_path / "checkpoints").exists()


def test_fused_step_on_an_fsdp_mesh_keeps_the_stack_sharded_and_equals_one_device(tmp_path):
    # mesh.fsdp=2 shards the parameters and optimizer state, the stack included, and the batch
    # over all 8 devices: the fused step's per-layer VJP and update on sharded slices must give
    # the state of the fused step on one device (replicated weights' cotangents reduced over the
    # batch's devices). The step's output shardings are the trainer's (jit out_shardings): the
    # shard checks below say the state stays split, not how the step gets there.
    fused = "train.update_in_backward=true"
    sharded = loop.run(
        _cfg(tmp_path / "fsdp", fused, "mesh.data=4", "mesh.fsdp=2", "mesh.fsdp_min_size=0")
    )
    single = loop.run(_cfg(tmp_path / "one", fused, "mesh.data=1", "mesh.fsdp=1"))
    stack = sharded.state.params["blocks"]
    kernels = [x for x in jax.tree.leaves(stack) if x.ndim >= 3]
    assert kernels and all(
        "fsdp" in x.sharding.spec and len(x.sharding.device_set) == 8 for x in kernels
    )
    moments = [x for x in jax.tree.leaves(sharded.state.opt_state) if x.ndim >= 3]
    assert moments and all("fsdp" in x.sharding.spec for x in moments)
    # Each device holds half of every stacked kernel and moment (fsdp=2), not a gathered copy.
    for x in kernels + moments:
        assert {s.data.nbytes for s in x.addressable_shards} == {x.nbytes // 2}
    err = _state_err(sharded.state, single.state)
    print(f"fused step, fsdp=2 x data=4 vs one device, after 6 steps: rel err {err:.3g}")
    assert err <= 1e-5


def test_resnet_fused_step_on_an_fsdp_mesh_equals_one_device(tmp_path):
    # rn.fused_update_stages on data=4 x fsdp=2 (8 devices): the stages' stacks and moments
    # split over fsdp, the batch over all 8 (BatchNorm's statistics over the global batch, as
    # jit's SPMD semantics give them), against the same fused run on one device. Bound as the
    # resume test's: BatchNorm over the digits' constant border amplifies float32 round-off of
    # the reordered sums (measured 4.3e-6 after 3 steps); a cotangent not summed over the
    # devices would be off by O(1).
    def cfg(path, *overrides):
        fused = ("model.options.scan_units=true", "train.update_in_backward=true")
        return _cnn_cfg("resnet", path, *fused, *overrides)

    sharded = loop.run(cfg(tmp_path / "fsdp", "mesh.data=4", "mesh.fsdp=2", "mesh.fsdp_min_size=0"))
    single = loop.run(cfg(tmp_path / "one", "mesh.data=1", "mesh.fsdp=1"))
    stacked = [x for x in jax.tree.leaves(sharded.state.params) if x.ndim == 5]  # (L, kh, kw, ..)
    assert stacked and all("fsdp" in x.sharding.spec for x in stacked)
    for x in stacked:  # each device holds half of every stacked kernel, not a gathered copy
        assert {s.data.nbytes for s in x.addressable_shards} == {x.nbytes // 2}
    err = max(
        _state_err(sharded.state, single.state),
        rel_err(sharded.state.batch_stats, single.state.batch_stats),
    )
    print(f"resnet fused step, fsdp=2 x data=4 vs one device, after 3 steps: rel err {err:.3g}")
    assert err <= 1e-4


def _family_model(family: str, fallback: str):
    from models import nnx_revnet, revnet

    if family == "transformer":
        return _model(reversible=True, drift_fallback=fallback)
    if family == "revnet":
        return revnet.RevNet(revnet.ARCHS["revnet38"].scaled(0.25), drift_fallback=fallback)
    return nnx_revnet.build(width=4, depth=2, drift_fallback=fallback)


@pytest.mark.parametrize("fallback", ["none", "recompute", "error"])
@pytest.mark.parametrize("family", ["transformer", "revnet", "nnx_revnet"])
def test_the_models_drift_fallback_is_what_the_fused_step_runs(family, fallback, monkeypatch):
    """``model.options.drift_fallback`` reaches ``rn.fused_update_step`` /
    ``rn.fused_update_stages`` through the model's stacks and the trainer (it once stopped at
    both: every fused step ran the default ``"error"``, whatever the model said), and the
    checks report in the step's metrics (``report_drift``: no host callback in the step)."""
    seen, reported = [], []

    def step(*args, fallback="error", **kwargs):
        seen.append(fallback)
        reported.append(kwargs.get("report_drift"))

    def stages(embed, stages, *args, **kwargs):
        seen.extend(s.fallback for s in stages if s.backward is not None or s.inverse is not None)
        reported.append(kwargs.get("report_drift"))

    monkeypatch.setattr(rn, "fused_update_step", step)
    monkeypatch.setattr(rn, "fused_update_stages", stages)
    model = _family_model(family, fallback)
    parts = fused_lib._parts(models.get(family), model)
    tx, schedule = state_lib.make_optimizer(Optim(), 10)
    fused_lib.make_fused_train_step(parts, tx, schedule, compute_dtype=jnp.float32)
    assert seen and set(seen) == {fallback}, seen
    assert reported and set(reported) == {True}
