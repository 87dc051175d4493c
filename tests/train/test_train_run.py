"""The trainer end to end: resume equality, donation, sharding, device-count restore, 2 processes.

Runs use a tiny MLP (tests/train/tiny_models.py: uniform init, BatchNorm and dropout, so batch
stats and the rng are part of what must resume exactly) on the embedded digits data, a few steps
each. Runs in subprocesses register the same model.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import models
from tests.gradients import rel_err
from tests.ports import held_port
from tests.train import tiny_models
from tests.trainer_cli import launch
from train import donation, experiment, loop
from train import state as state_lib
from train.checkpoint import Checkpointer
from train.config import Checkpoint, load_config
from train.errors import DonationError

ROOT = Path(__file__).resolve().parents[2]
TINY = tiny_models.TRAIN_MLP


@pytest.fixture(scope="module", autouse=True)
def tiny_model_registered():
    with tiny_models.registered(TINY):
        yield


def make_cfg(run_dir, *overrides: str):
    return load_config(
        None,
        [
            f"model.name={TINY}",
            "data.source=digits",
            "data.batch_size=32",
            "train.steps=8",
            "train.log_every=2",
            "train.eval_every=4",
            "train.eval_batches=2",
            "train.plot=false",
            "checkpoint.every=2",
            "checkpoint.keep=2",
            "optim.warmup_steps=2",
            f"run_dir={run_dir}",
            *overrides,
        ],
    )


def cli_argv(run_dir, *overrides: str) -> list[str]:
    return [
        f"model.name={TINY}",
        "data.batch_size=32",
        "train.steps=8",
        "train.log_every=1",
        "train.eval_every=4",
        "train.eval_batches=2",
        "train.plot=false",
        "checkpoint.every=2",
        "optim.warmup_steps=2",
        f"run_dir={run_dir}",
        *overrides,
    ]


def cli(
    argv: list[str],
    *,
    devices: int,
    env: dict[str, str] | None = None,
    register: str = "tests.train.tiny_models:register_train_mlp",
    **kw,
):
    """``python -m train`` with this module's model registered, in a fresh process."""
    return launch(argv, register=register, devices=devices, env=env, **kw)


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def metrics(run_dir, split="train") -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


# --- resume --------------------------------------------------------------------------------------


def test_resumed_run_is_bit_identical(tmp_path):
    full = loop.run(make_cfg(tmp_path / "full", "train.plot=true"))
    first = loop.run(make_cfg(tmp_path / "resumed"), stop_after=4)
    assert first.step == 4 and first.resumed_from is None
    second = loop.run(make_cfg(tmp_path / "resumed"))
    assert second.resumed_from == 4 and second.step == 8

    # Params, optimizer state, batch stats, rng and step: all bit-identical.
    for a, b in zip(leaves(full.state), leaves(second.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [r["loss"] for r in metrics(tmp_path / "full")] == [
        r["loss"] for r in metrics(tmp_path / "resumed")
    ]

    run_dir = tmp_path / "full"
    assert {"config.yaml", "metrics.jsonl", "plot.png", "checkpoints"} <= {
        p.name for p in run_dir.iterdir()
    }
    kept = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert kept[-2:] == [6, 8] and len(kept) <= 3  # keep-last-2, plus the best by eval accuracy
    assert [r["step"] for r in metrics(run_dir, "eval")] == [4, 8]
    assert load_config(run_dir / "config.yaml").train.steps == 8


def test_debug_config_resumes_bit_identically(tmp_path):
    # The shipped debug config (a real registered transformer): stopped at 4 and resumed.
    def cfg(name):
        return load_config(
            ROOT / "configs/debug.yaml",
            [
                f"run_dir={tmp_path / name}",
                "train.steps=8",
                "train.plot=false",
                "checkpoint.every=4",
                "train.eval_every=0",
            ],
        )

    full = loop.run(cfg("full"))
    loop.run(cfg("resumed"), stop_after=4)
    resumed = loop.run(cfg("resumed"))
    assert resumed.resumed_from == 4
    for a, b in zip(leaves(full.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)


# --- donation ------------------------------------------------------------------------------------


def _toy_state():
    params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    return state_lib.TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=jax.tree.map(jnp.zeros_like, params),
        batch_stats={},
        rng=jax.random.key_data(jax.random.key(0)),
    )


def _toy_step(state, batch):
    params = jax.tree.map(lambda p: p - 0.1 * batch.mean(), state.params)
    return state._replace(step=state.step + 1, params=params), batch.sum()


def test_donation_is_verified_and_its_absence_fails_loudly():
    batch = jnp.ones(4)
    donated = jax.jit(_toy_step, donate_argnums=0).lower(_toy_state(), batch).compile()
    assert donation.verify_donation(donated, _toy_state()) >= 4 * 4 * 4 + 4 * 4
    state = _toy_state()
    old = jax.tree_util.tree_leaves_with_path(state)
    state, _ = donated(state, batch)
    donation.verify_donated_inputs_deleted(old)

    copied = jax.jit(_toy_step).lower(_toy_state(), batch).compile()
    with pytest.raises(DonationError, match="aliases 0 bytes"):
        donation.verify_donation(copied, _toy_state())
    kept = _toy_state()
    old = jax.tree_util.tree_leaves_with_path(kept)
    copied(kept, batch)
    with pytest.raises(DonationError, match="not consumed"):
        donation.verify_donated_inputs_deleted(old)


def states_differ(got, want) -> dict[str, float]:
    """rel_err of each float part of two train states; the step and the rng must be equal.

    Dense_0's bias gets an exact gradient of 0 (BatchNorm removes it), so it and its optimizer
    moments hold only round-off: each leaf's scale is floored at 1% of its part's largest.
    """
    assert int(got.step) == int(want.step)
    np.testing.assert_array_equal(np.asarray(got.rng), np.asarray(want.rng))
    parts = ("params", "opt_state", "batch_stats")
    return {
        part: rel_err(_floats(getattr(got, part)), _floats(getattr(want, part)), floor=1e-2)
        for part in parts
    }


def _floats(tree) -> list[np.ndarray]:
    return [x for x in leaves(tree) if x.dtype.kind == "f"]


# --- sharding -------------------------------------------------------------------------------------


def test_fsdp_sharded_run_matches_single_device_and_its_checkpoint_restores(tmp_path):
    fsdp, one = (
        ("mesh.data=4", "mesh.fsdp=2", "mesh.fsdp_min_size=0"),
        ("mesh.data=1", "mesh.fsdp=1"),
    )
    sharded = loop.run(make_cfg(tmp_path / "s", *fsdp))
    single = loop.run(make_cfg(tmp_path / "1", *one))
    kernel = sharded.state.params["Dense_0"]["kernel"]
    assert "fsdp" in kernel.sharding.spec and len(kernel.sharding.device_set) == 8
    momentum = jax.tree.leaves(sharded.state.opt_state)
    assert any("fsdp" in getattr(x.sharding, "spec", ()) for x in momentum)
    assert single.state.params["Dense_0"]["kernel"].sharding.device_set == {jax.devices()[0]}
    np.testing.assert_allclose(
        [r["loss"] for r in metrics(tmp_path / "s")],
        [r["loss"] for r in metrics(tmp_path / "1")],
        rtol=1e-5,
    )
    # Reductions split differently: the states agree to float32 round-off amplified by the
    # training steps.
    errs = states_differ(sharded.state, single.state)
    print(f"fsdp vs one device, after 8 steps: {errs}")
    assert max(errs.values()) < 1e-4, errs

    # A checkpoint written FSDP-sharded (step 4) restores onto one device (the mesh is not
    # resume-safe: allowed explicitly) and onto the FSDP mesh, and training continues the same.
    loop.run(make_cfg(tmp_path / "r1", *fsdp), stop_after=4)
    loop.run(make_cfg(tmp_path / "r8", *fsdp), stop_after=4)
    onto_one = loop.run(make_cfg(tmp_path / "r1", *one), allow_config_change=True)
    onto_fsdp = loop.run(make_cfg(tmp_path / "r8", *fsdp))
    assert onto_one.resumed_from == onto_fsdp.resumed_from == 4
    kernel = onto_one.state.params["Dense_0"]["kernel"]
    assert kernel.sharding.device_set == {jax.devices()[0]}
    assert "fsdp" in onto_fsdp.state.params["Dense_0"]["kernel"].sharding.spec
    for a, b in zip(leaves(onto_fsdp.state), leaves(sharded.state), strict=True):
        np.testing.assert_array_equal(a, b)  # same mesh: bit for bit
    errs = states_differ(onto_one.state, single.state)
    print(f"fsdp checkpoint resumed on one device vs one device throughout: {errs}")
    assert max(errs.values()) < 1e-4, errs


# --- restore onto another device count, SIGTERM ---------------------------------------------------


def test_restore_onto_one_device_and_back_with_sigterm(tmp_path):
    run_dir = tmp_path / "moved"
    # Checkpoints only where a run stops (step 4, the SIGTERM, the end): what is compared is the
    # final state, and a save every 4 steps made up most of the time.
    steps = ["train.steps=100", "checkpoint.every=1000", "train.eval_every=0"]
    reference = loop.run(make_cfg(tmp_path / "ref", *steps))

    loop.run(make_cfg(run_dir, *steps), stop_after=4)  # 8 devices, checkpoint at step 4
    # 1 device: resumes at 4, takes 3 steps, then a SIGTERM (sent by the process itself at step
    # 7) saves a checkpoint and exits.
    proc = cli(
        cli_argv(run_dir, *steps),
        devices=1,
        env={"REMAT_NN_FAULT": "sigterm@7"},
    )
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "'data': 1, 'fsdp': 1" in out and "resumed from" in out and "SIGTERM" in out
    stopped_at = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert stopped_at == 7

    back = loop.run(make_cfg(run_dir, *steps))  # 8 devices again
    assert back.resumed_from == stopped_at and back.step == 100
    errs = states_differ(back.state, reference.state)
    print(f"moved 8 -> 1 -> 8 devices vs 8 throughout, after 100 steps: {errs}")
    assert max(errs.values()) < 1e-4, errs


# --- multi-process --------------------------------------------------------------------------------


def _launch(
    run_dir,
    *extra: str,
    envs=({}, {}),
    flags=None,
    steps="train.steps=6",
    register="tests.train.tiny_models:register_train_mlp",
):
    """Two ``python -m train`` processes on localhost: [(exit code, output)] per process.

    Without ``flags`` they meet at a coordinator on a port held for them (tests/ports.py).
    """
    with contextlib.ExitStack() as stack:
        if flags is None:
            port = stack.enter_context(held_port())
            flags = [
                ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", i]
                for i in ("0", "1")
            ]
        argvs = [[*cli_argv(run_dir, steps, "train.eval_every=3"), *extra, *f] for f in flags]
        procs = [
            cli(a, devices=2, env=env, register=register)
            for a, env in zip(argvs, envs, strict=True)
        ]
        outs = []
        deadline = time.monotonic() + 150  # a hang guard, not a measurement
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


def _two_processes(run_dir, *extra: str) -> list[str]:
    results = _launch(run_dir, *extra)
    for code, out in results:
        assert code == 0, out
    return [out for _, out in results]


def _steps_saved(run_dir) -> list[int]:
    names = [p.name for p in (Path(run_dir) / "checkpoints").iterdir()]
    return sorted(int(n) for n in names if n.isdigit())


def _saved_arrays(run_dir, step: int) -> dict:
    # Written by 2 processes (4 devices): read onto this process's first device.
    path = Path(run_dir) / "checkpoints" / str(step) / "state"
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(path)
    meta = getattr(meta, "item_metadata", meta)  # StepMetadata -> the tree's metadata
    args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=one), meta.tree)
    tree = checkpointer.restore(path, restore_args=args)
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def _launch_as_slurm_would(run_dir, *extra: str) -> list[tuple[int, str]]:
    """:func:`_launch` with no coordinator flags, in a Slurm step's environment instead.

    JAX's Slurm detection: coordinator = first node of the step, port from the job id. A job
    id whose port is free is chosen and the port held until both processes have exited.
    """
    with contextlib.ExitStack() as stack:
        for job in range(4096):
            try:
                stack.enter_context(held_port(61440 + job))
                break
            except OSError:
                continue
        envs = [
            {
                "SLURM_JOB_ID": str(job),
                "SLURM_STEP_NODELIST": "localhost",
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(i),
                "SLURM_LOCALID": str(i),
            }
            for i in range(2)
        ]
        return _launch(run_dir, *extra, envs=envs, flags=[[], []])


def register_tiny_with_a_clock_of_its_own() -> None:
    """The tiny MLP, and an every_minutes clock advancing $REMAT_NN_TEST_TICK s per read."""
    tiny_models.register_train_mlp()
    tick, reads = float(os.environ["REMAT_NN_TEST_TICK"]), itertools.count()
    loop._clock = lambda: tick * next(reads)


@pytest.mark.slow
def test_two_processes_stop_together_resume_bitwise_and_save_by_process_0s_clock(tmp_path):
    # One run of two processes stopped and resumed, against an uninterrupted one (two process
    # start-ups per run, so the three claims share them):
    # - a preemption notice (SIGTERM) reaches process 1 only: both save the same step (the
    #   save is collective) and exit 128+15;
    # - the resumed run also checkpoints by time (checkpoint.every_minutes), on process 0's
    #   clock, which passes a minute between any two reads while process 1's stands still: a
    #   process deciding by its own clock would save alone and hang;
    # - it ends bit for bit equal to the uninterrupted run, whose losses equal one process's
    #   with the same 4 devices; that run's processes find each other as in a Slurm step
    #   (no coordinator given).
    long = ("train.steps=30", "checkpoint.every=1000", "train.eval_every=0", "checkpoint.keep=10")
    stopped = _launch(tmp_path / "mp", *long, envs=({}, {"REMAT_NN_FAULT": "sigterm@3"}))
    for code, out in stopped:
        assert code == 128 + signal.SIGTERM, out
    (step,) = _steps_saved(tmp_path / "mp")
    assert 3 <= step < 30
    assert f"SIGTERM: saved checkpoint at step {step}" in stopped[0][1], stopped[0][1]

    resumed = _launch(
        tmp_path / "mp",
        *long,
        "train.log_every=10",  # timed saves are decided at log steps
        "checkpoint.every_minutes=1",
        envs=({"REMAT_NN_TEST_TICK": "61"}, {"REMAT_NN_TEST_TICK": "0"}),
        register="tests.train.test_train_run:register_tiny_with_a_clock_of_its_own",
    )
    assert all(code == 0 for code, _ in resumed) and f"(step {step})" in resumed[0][1]
    assert _steps_saved(tmp_path / "mp") == sorted({step} | {s for s in (10, 20, 30) if s > step})

    reference = _launch_as_slurm_would(tmp_path / "ref", *long)
    for code, out in reference:
        assert code == 0, out
    assert "on 2 process(es)" in reference[0][1] and "'data': 4" in reference[0][1]
    assert reference[1][1].count("step") == 0  # only process 0 logs
    a, b = _saved_arrays(tmp_path / "mp", 30), _saved_arrays(tmp_path / "ref", 30)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    # Same data, same global batch, 4 devices in one process: the same losses.
    single = loop.run(make_cfg(tmp_path / "one", *long, "train.log_every=1", "mesh.data=4"))
    assert single.step == 30
    np.testing.assert_allclose(
        [r["loss"] for r in metrics(tmp_path / "ref")],
        [r["loss"] for r in metrics(tmp_path / "one")],
        rtol=1e-5,
    )


def test_start_up_refusal_on_process_0_stops_every_process_with_its_code(tmp_path):
    # Process 0 alone checks the lock and the config; the others must learn its verdict, not
    # wait for the coordinator's timeout.
    run_dir = tmp_path / "mp"
    loop.run(make_cfg(run_dir, "train.steps=6", "train.eval_every=3"), stop_after=2)
    changed = _launch(run_dir, "optim.lr=0.05")
    for code, out in changed:
        assert code == 4, out
    assert "ConfigChangedError: the config differs" in changed[0][1]
    assert "ConfigChangedError: process 0 failed at start-up" in changed[1][1]

    from train import run_dir as run_dir_lib

    lock = run_dir_lib.RunLock(run_dir)  # another trainer holds the run directory
    try:
        locked = _launch(run_dir)
    finally:
        lock.release()
    for code, out in locked:
        assert code == 5, out
    assert "RunLockedError: process 0 failed at start-up" in locked[1][1]


# --- non-finite loss, bfloat16, dry run -----------------------------------------------------------


def test_nonfinite_loss_halts_keeping_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "nan"
    loop.run(make_cfg(run_dir), stop_after=2)
    explode = ("optim.schedule=constant", "optim.warmup_steps=0", "optim.lr=1e38")
    with pytest.raises(loop.NonFiniteError, match=r"not finite at step 3 .*checkpoint is step 2"):
        loop.run(make_cfg(run_dir, *explode))
    assert Checkpointer(run_dir / "checkpoints", Checkpoint()).all_steps() == [2]

    skip = ("train.on_nonfinite=skip", "train.steps=2", "train.eval_every=0")
    skipped = loop.run(make_cfg(tmp_path / "skip", *explode, *skip))
    assert skipped.step == 2 and metrics(tmp_path / "skip")[-1]["skipped"] == 2
    assert all(np.isfinite(x).all() for x in leaves(skipped.state.params))


def test_bfloat16_compute_keeps_float32_master_weights(tmp_path):
    result = loop.run(make_cfg(tmp_path / "bf16", "train.compute_dtype=bfloat16", "train.steps=2"))
    assert {x.dtype for x in jax.tree.leaves(result.state.params)} == {jnp.dtype("float32")}
    assert np.isfinite(metrics(tmp_path / "bf16")[-1]["loss"])


def test_dry_run_prints_parameters_and_memory(tmp_path):
    lines: list[str] = []
    knobs = ("optim.weight_decay=1e-4", "train.compute_dtype=bfloat16")
    result = loop.run(make_cfg(tmp_path / "dry", *knobs), dry_run=True, out=lines.append)
    text = "\n".join(lines)
    # TinyMLP: Dense kernel + bias, BatchNorm scale + bias, Dense kernel + bias.
    assert "weight decay: 2 of 6 parameter leaves (not decayed: bias x 3, scale x 1)" in text
    (dtypes,) = [line for line in lines if line.startswith("matmul operand dtypes: {")]
    assert "bfloat16" in dtypes and "float32" not in dtypes.replace("bfloat16", ""), dtypes
    # The dry run writes only the memory timeline (no checkpoint, config or metrics).
    written = {p.name for p in (tmp_path / "dry").iterdir()}
    assert result.state is None and written == {"memory_timeline.png", "memory_timeline.json"}
    for expected in (
        "parameters:",
        "Dense_0",
        "total",
        "memory report",
        "XLA compiled memory",
        "alias",
        "donation",
    ):
        assert expected in text, text


# --- weight decay by role -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, options, example",
    [
        # (no arrays here: this module is imported by the subprocesses before jax.distributed)
        ("revnet38", {"width": 0.25}, ((1, 32, 32, 3), "float32")),
        ("resnet32", {"width": 0.25}, ((1, 32, 32, 3), "float32")),
        (
            "transformer",
            {"d_model": 32, "n_heads": 2, "n_layers": 2, "max_len": 16},
            ((1, 16), "int32"),
        ),
    ],
)
def test_weight_decay_spares_biases_and_norm_scales_whatever_their_rank(name, options, example):
    model, x = models.build(name, **options), jnp.zeros(*example)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))["params"]
    flat = {
        "/".join(str(k.key) for k in path): x
        for path, x in jax.tree_util.tree_leaves_with_path(params)
    }
    exclude = load_config(None, []).optim.decay_exclude  # the default
    decayed = set(state_lib.decayed_paths(params, exclude))
    for where, leaf in flat.items():
        role = where.rsplit("/", 1)[-1]
        assert (where in decayed) == (role in ("kernel", "embedding")), (where, leaf.shape)
    # The case the rank rule got wrong: stacked (scanned / reversible) biases and scales.
    spared = [x for p, x in flat.items() if p.rsplit("/", 1)[-1] in ("bias", "scale")]
    assert spared and (name == "resnet32" or max(x.ndim for x in spared) >= 2)
    summary = state_lib.decay_summary(params, exclude)
    assert summary.startswith(f"weight decay: {len(decayed)} of {len(flat)} parameter leaves")


def test_the_decay_mask_reaches_the_optimizer():
    from train.config import Optim

    params = {
        "mlp": {"kernel": jnp.ones((3, 4, 4)), "bias": jnp.ones((3, 4))},
        "ln": {"scale": jnp.ones((3, 4))},
    }
    zero = jax.tree.map(jnp.zeros_like, params)
    for name in ("adamw", "sgd"):
        cfg = Optim(name=name, lr=0.1, weight_decay=0.5, schedule="constant")
        tx, _ = state_lib.make_optimizer(cfg, 10)
        updates, _ = tx.update(zero, tx.init(params), params)
        new = optax.apply_updates(params, updates)
        assert float(jnp.abs(new["mlp"]["kernel"] - 1).max()) > 0, name  # decayed
        np.testing.assert_array_equal(new["mlp"]["bias"], params["mlp"]["bias"])
        np.testing.assert_array_equal(new["ln"]["scale"], params["ln"]["scale"])
    everything = Optim(name="adamw", lr=0.1, weight_decay=0.5, decay_exclude=[])
    tx, _ = state_lib.make_optimizer(everything, 10)
    new = optax.apply_updates(params, tx.update(zero, tx.init(params), params)[0])
    assert float(jnp.abs(new["ln"]["scale"] - 1).max()) > 0


# --- exit codes, extending a finished run ---------------------------------------------------------


def test_only_config_errors_exit_2_and_other_errors_keep_their_traceback(tmp_path, monkeypatch):
    from train.__main__ import main

    args = cli_argv(tmp_path / "codes")
    assert main([*args, "data.batch_size=30"]) == 2  # 30 does not split over 8 devices
    assert main([*args, "optim.lr=-1"]) == 2

    def buggy_run(*args, **kwargs):
        raise ValueError("a bug deep inside the trainer")

    monkeypatch.setattr(loop, "run", buggy_run)
    with pytest.raises(ValueError, match="a bug deep inside"):  # exit 1 with the traceback
        main(args)


def _no_compile(*args, **kwargs):
    raise AssertionError("the train step was compiled")


def loss_without_metrics(outputs, targets):
    """Cross-entropy that reports no accuracy (``model.loss`` of the test below)."""
    return optax.softmax_cross_entropy_with_integer_labels(outputs, targets), {}


def test_a_restart_the_step_refuses_keeps_the_old_run(tmp_path):
    """``--restart`` compiles the step before it deletes the old run's checkpoints, and a
    resumed run before it records its config: a config the compiled step refuses (a
    ``best_metric`` the loss does not report) changes nothing on disk. (Catches a restart
    that deletes first, now that a resumed run compiles only once it knows steps are left.)"""
    run = tmp_path / "run"
    loop.run(make_cfg(run))
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    bad = (
        f"model.loss={__name__}:loss_without_metrics",
        "checkpoint.keep_best=1",
        "checkpoint.best_metric=eval_accuracy",
    )
    for restart, steps in ((True, 8), (False, 10)):
        cfg = make_cfg(run, *bad, f"train.steps={steps}", "optim.schedule_steps=8")
        with pytest.raises(loop.SetupError, match="best_metric=eval_accuracy"):
            loop.run(cfg, restart=restart, allow_config_change=True)
        after = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
        changed = [p.name for p in before if after.get(p) != before[p]]
        print(f"restart={restart}: files changed or removed: {changed}")
        assert not changed


def test_extending_a_finished_run_keeps_its_schedule_bit_for_bit(tmp_path):
    # Cosine over 8 steps ending at half the peak lr, so the extra steps still train.
    common = ("optim.final_lr_fraction=0.5", "train.eval_every=0")
    loop.run(make_cfg(tmp_path / "ext", *common), allow_config_change=False)
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as patch:  # a finished run compiles no step
        patch.setattr(experiment, "_compile_steps", _no_compile)
        loop.run(make_cfg(tmp_path / "ext", *common), out=lines.append)
    assert "run already complete" in lines[-1] and "optim.schedule_steps=8" in lines[-1]

    # More steps alone would stretch the schedule mid-run: refused, naming the key.
    with pytest.raises(loop.ConfigChangedError, match=r"optim.schedule_steps: 8 -> 12"):
        loop.run(make_cfg(tmp_path / "ext", *common, "train.steps=12"), allow_config_change=False)
    more = (*common, "train.steps=12", "optim.schedule_steps=8")
    extended = loop.run(make_cfg(tmp_path / "ext", *more), allow_config_change=False)
    assert extended.resumed_from == 8 and extended.step == 12
    reference = loop.run(make_cfg(tmp_path / "ref", *more))
    for a, b in zip(leaves(reference.state), leaves(extended.state), strict=True):
        np.testing.assert_array_equal(a, b)
    stretched = loop.run(make_cfg(tmp_path / "str", *common, "train.steps=12"))
    pairs = zip(leaves(stretched.state), leaves(extended.state), strict=True)
    assert any((a != b).any() for a, b in pairs)  # the test would see a stretched schedule


def test_processes_launched_with_different_configs_all_exit_2(tmp_path):
    # #31 item 6: every process's config hash is compared, not only process 0's start-up checks.
    with held_port() as port:
        flags = [
            ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", i]
            for i in ("0", "1")
        ]
        flags[1].append("optim.lr=0.05")
        results = _launch(tmp_path / "mp", flags=flags)
    for code, out in results:
        assert code == 2 and "processes [1] were launched with another config" in out, out


def _logged_steps(run_dir) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_killed_peer_makes_the_survivor_abort_within_the_heartbeat_timeout(tmp_path):
    # #31 item 6: a SIGKILLed process never joins the next collective; the coordinator (process 0)
    # must declare it dead after distributed.heartbeat_timeout, not JAX's default 100 s. (A killed
    # process 0 takes the coordination service with it: process 1 then aborts at once, whatever
    # the timeout, so that case proves nothing about it.)
    timeout = 3
    bound = 4 * timeout + 10  # heartbeat period and error polling, on a loaded machine
    run_dir = tmp_path / "mp"
    long = ("train.steps=100000", "checkpoint.every=100000", "train.eval_every=0")
    argv = cli_argv(run_dir, *long, f"distributed.heartbeat_timeout={timeout}")
    with held_port() as port:
        flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]
        survivor, victim = (cli([*argv, *flags, i], devices=2) for i in ("0", "1"))
        try:
            deadline = time.monotonic() + 120  # a hang guard for the start-up
            while _logged_steps(run_dir) < 3 and time.monotonic() < deadline:
                assert survivor.poll() is None and victim.poll() is None, survivor.communicate()
                time.sleep(0.05)
            victim.kill()
            victim.communicate()
            killed_at = time.monotonic()
            try:
                out = survivor.communicate(timeout=bound)[0]
            except subprocess.TimeoutExpired:
                survivor.kill()
                survivor.communicate()
                pytest.fail(
                    f"process 0 still ran {bound} s after process 1 was SIGKILLed "
                    f"(distributed.heartbeat_timeout={timeout})"
                )
            waited = time.monotonic() - killed_at
        finally:
            for p in (survivor, victim):
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    assert _logged_steps(run_dir) >= 3, "the run never reached step 3"
    assert survivor.returncode != 0 and waited < bound, (survivor.returncode, waited, out)
    assert "tasks are unhealthy (stopped sending heartbeats):\n1\n" in out, out
