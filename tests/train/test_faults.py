"""Crash, corruption and misuse of the trainer, each injected for real into ``python -m train``.

Runs train a tiny MLP (tests/train/tiny_models.py) on the embedded digits data: 8 steps, a
checkpoint every 2, on one device (``mesh.data=1 mesh.fsdp=1``, so this process's 8 fake devices and
a child's one compute the same bits). Only a run that is SIGKILLed or signals itself is a child
process (``python -m train``, tests/trainer_cli.py ``launch``); every other run, the reruns after a
kill included, calls the same ``main`` in this process (``run_in_process``: exit code and output as
a child's). Faults come from ``REMAT_NN_FAULT`` (train/faults.py), damage is done to the files on
disk, and "bitwise equal" compares the final checkpoint's arrays with an uninterrupted run's.
This process and the children share one JAX compilation cache.
The slow multi-kill test runs only with ``REMAT_NN_SLOW_TESTS=1``.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.train import tiny_models
from tests.trainer_cli import launch, run_in_process
from train import manifest as manifest_lib
from train import run_dir as run_dir_lib
from train.faults import KILL_POINTS

MODEL = tiny_models.FAULT_MLP
REGISTER = "tests.train.tiny_models:register_fault_mlp"


@pytest.fixture(scope="module", autouse=True)
def fault_model_registered():
    with tiny_models.registered(MODEL):
        yield


def argv(run_dir, *extra: str) -> list[str]:
    return [
        f"model.name={MODEL}",
        "data.source=digits",
        "data.batch_size=32",
        "train.steps=8",
        "train.log_every=1",
        "train.eval_every=0",
        "train.plot=false",
        "checkpoint.every=2",
        "checkpoint.keep=3",
        "optim.warmup_steps=2",
        "mesh.data=1",  # one device, here and in a child (launched with 1)
        "mesh.fsdp=1",
        f"run_dir={run_dir}",
        *extra,
    ]


def train(run_dir, *extra: str, fault: str | None = None) -> tuple[int, str]:
    """Runs the trainer to its end in this process: (exit code, output).

    ``fault`` may only be one the process survives (``enospc``, ``nan``).
    """
    return run_in_process(argv(run_dir, *extra), fault=fault)


def train_in_child(run_dir, *extra: str, fault: str | None = None) -> tuple[int, str]:
    """Runs the trainer in a fresh process to its end or its crash: (exit code, output).

    For the faults that SIGKILL the process or send it a signal.
    """
    env = {"REMAT_NN_FAULT": fault} if fault else None
    proc = launch(argv(run_dir, *extra), register=REGISTER, env=env)
    out = proc.communicate(timeout=120)[0]
    return proc.returncode, out


def steps(run_dir) -> list[str]:
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir() if p.name[0] != ".")


def saved(run_dir, step: int) -> dict:
    """The arrays of a checkpoint step as a flat {path: ndarray}."""
    with warnings.catch_warnings():
        # Orbax warns it takes the shardings from the checkpoint: the same single CPU device here.
        warnings.filterwarnings("ignore", "Sharding info not provided", UserWarning)
        tree = ocp.PyTreeCheckpointer().restore(Path(run_dir) / "checkpoints" / str(step) / "state")
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


# Fields of a metrics line that measure time, not what was computed.
TIMING = ("steps_per_sec", "examples_per_sec")


def metric_lines(run_dir) -> list[dict]:
    """metrics.jsonl without its timing fields (every line must be whole JSON)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in lines]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert a[k].dtype == b[k].dtype, k


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 8-step run (checkpoints 4, 6, 8)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    code, out = train(run_dir)
    assert code == 0, out
    return run_dir


def copy_of(reference: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir, ignore=shutil.ignore_patterns(".lock"))
    (run_dir / "config.yaml").write_text(
        (reference / "config.yaml").read_text().replace(str(reference), str(run_dir))
    )
    return run_dir


# --- SIGKILL at each point of a save (or restore), then the same command -------------------------


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_then_rerun_resumes_bitwise(point, tmp_path, reference):
    run_dir = tmp_path / "run"
    if point == "during_restore":
        assert train(run_dir, "--stop-after", "4")[0] == 0
    code, out = train_in_child(run_dir, fault=f"{point}@4")
    assert code == -signal.SIGKILL, out
    assert f"SIGKILL at {point}@4" in out

    code, out = train(run_dir)
    assert code == 0, out
    resumed = "(step 4)" if point in ("during_restore",) else "(step 2)"
    assert resumed in out, out
    assert not [n for n in steps(run_dir) if "tmp" in n]
    assert_bitwise_equal(saved(run_dir, 8), saved(reference, 8))
    assert metric_lines(run_dir) == metric_lines(reference)  # no line lost or repeated


@pytest.mark.skipif(
    os.environ.get("REMAT_NN_SLOW_TESTS") != "1",
    reason="slow (about a minute): set REMAT_NN_SLOW_TESTS=1 to run the three-kill test",
)
def test_three_seeded_random_kills_still_bitwise_equal(tmp_path, reference):
    rng = random.Random(1234)
    run_dir = tmp_path / "run"
    done = 0
    for _ in range(3):
        # A random kill point at a random checkpoint step still ahead of the run.
        point = rng.choice(KILL_POINTS[:-1])
        step = rng.choice([s for s in (2, 4, 6, 8) if s > done])
        code, out = train_in_child(run_dir, fault=f"{point}@{step}")
        assert code == -signal.SIGKILL, out
        verified = [int(n) for n in steps(run_dir) if n.isdigit()]
        done = max(verified, default=0)
    code, out = train(run_dir)
    assert code == 0, out
    assert_bitwise_equal(saved(run_dir, 8), saved(reference, 8))


def test_kill_after_the_rename_before_the_manifest_with_keep_1_resumes_the_step_before(
    tmp_path, reference
):
    # #31 item 2: step 4 is deleted only once step 6 is complete, so a kill between orbax's
    # rename of 6 and its manifest leaves 4 to resume from (it used to restart at step 0).
    run_dir = tmp_path / "run"
    code, out = train_in_child(
        run_dir, "checkpoint.keep=1", fault="after_finalize_before_cleanup@6"
    )
    assert code == -signal.SIGKILL, out
    code, out = train(run_dir, "checkpoint.keep=1")
    assert code == 0 and "(step 4)" in out and "starting at step 0" not in out, out
    assert steps(run_dir) == ["6.corrupt-no-manifest", "8"]
    assert_bitwise_equal(saved(run_dir, 8), saved(reference, 8))
    assert metric_lines(run_dir) == metric_lines(reference)


def test_kill_before_the_first_save_and_a_torn_line_leave_no_duplicate(tmp_path, reference):
    # #31 item 4: lines of a run killed before its first checkpoint are logged again by the
    # rerun (from step 0), not kept twice; a line torn by the kill is skipped with a warning.
    run_dir = tmp_path / "run"
    code, out = train_in_child(run_dir, fault="before_save@2")
    assert code == -signal.SIGKILL, out
    assert [r["step"] for r in metric_lines(run_dir)] == [1, 2]
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"split": "train", "st')  # what a kill in the middle of a write leaves
    code, out = train(run_dir)
    assert code == 0, out
    assert "skipping its last line 3, torn by a crash" in out, out
    assert metric_lines(run_dir) == metric_lines(reference)


def test_kill_during_the_metrics_rewrite_loses_no_line(tmp_path, reference):
    # #31 item 4: resuming from step 4 rewrites metrics.jsonl without the lines of steps 5-8;
    # a kill halfway through leaves the file as it was (the rewrite goes to a temporary file).
    run_dir = copy_of(reference, tmp_path)
    for n in ("6", "8"):
        shutil.rmtree(run_dir / "checkpoints" / n)
    before = (run_dir / "metrics.jsonl").read_text()
    code, out = train_in_child(run_dir, fault="during_metrics_rewrite@4")
    assert code == -signal.SIGKILL and "SIGKILL at during_metrics_rewrite@4" in out, out
    assert (run_dir / "metrics.jsonl").read_text() == before
    code, out = train(run_dir)
    assert code == 0 and "(step 4)" in out, out
    assert metric_lines(run_dir) == metric_lines(reference)
    assert_bitwise_equal(saved(run_dir, 8), saved(reference, 8))


def test_plot_skips_a_torn_last_line(tmp_path, reference):
    from train.plot import main as plot_main

    run_dir = copy_of(reference, tmp_path)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"split": "ev')
    assert plot_main([str(run_dir)]) == 0
    assert (run_dir / "plot.png").stat().st_size > 0


# --- SIGTERM --------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_signal_checkpoints_at_that_step_exits_128_plus_n_and_resumes_bitwise(
    sig, tmp_path, reference
):
    # The process signals itself once step 5 is taken (a fault point, not a race with a parent).
    code, out = train_in_child(
        tmp_path / "run", "checkpoint.every=1000", fault=f"{sig.name.lower()}@5"
    )
    assert code == 128 + sig, out
    assert steps(tmp_path / "run") == ["5"] and f"{sig.name}: saved checkpoint at step 5" in out

    code, out = train(tmp_path / "run")
    assert code == 0 and "(step 5)" in out, out
    assert_bitwise_equal(saved(tmp_path / "run", 8), saved(reference, 8))


# --- a finished run, --restart ------------------------------------------------------------------


def test_rerunning_a_finished_run_exits_0_and_changes_nothing(tmp_path, reference):
    run_dir = copy_of(reference, tmp_path)
    metrics = (run_dir / "metrics.jsonl").read_text()
    code, out = train(run_dir)
    assert code == 0, out
    assert f"run already complete: step 8/8 in {run_dir}; nothing to do" in out, out
    assert "optim.schedule_steps=8" in out and "--restart" in out, out  # how to go further
    assert "(step 8)" in out and not re.search(r"^step +\d+/8 \|", out, re.M), out  # no step
    assert steps(run_dir) == ["4", "6", "8"] and (run_dir / "metrics.jsonl").read_text() == metrics
    assert_bitwise_equal(saved(run_dir, 8), saved(reference, 8))


def test_restart_trains_from_step_0_replacing_checkpoints_and_metrics(tmp_path, reference):
    # A config the checkpoints do not fit is refused on resume; --restart starts over with it.
    run_dir = copy_of(reference, tmp_path)
    assert train(run_dir, "model.options.width=32")[0] == 4
    code, out = train(run_dir, "model.options.width=32", "--restart")
    assert code == 0, out
    assert "resumed from" not in out and "step      1/8" in out, out
    assert steps(run_dir) == ["4", "6", "8"]
    assert saved(run_dir, 8)["['params']['Dense_0']['kernel']"].shape == (64, 32)
    train_steps = [
        json.loads(line)["step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["split"] == "train"
    ]
    assert train_steps == list(range(1, 9))  # the old run's metrics are gone, not appended to

    # The same config again: from step 0, the same bytes as the uninterrupted run.
    code, out = train(copy_of(reference, tmp_path / "again"), "--restart")
    assert code == 0 and "resumed from" not in out, out
    assert_bitwise_equal(saved(tmp_path / "again" / "run", 8), saved(reference, 8))


# --- damaged checkpoints --------------------------------------------------------------------------


def _largest_data_file(step_dir: Path) -> Path:
    return max(
        (p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )


def flip_byte(step_dir: Path) -> None:
    f = _largest_data_file(step_dir)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def truncate(step_dir: Path) -> None:
    f = _largest_data_file(step_dir)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def delete_metadata(step_dir: Path) -> None:
    (step_dir / "state" / "_METADATA").unlink()


# The largest data file holds a Dense_0 kernel (of the params or of an optimizer trace).
KERNEL = r"leaf \[[^;]*\['Dense_0'\]\['kernel'\]"


@pytest.mark.parametrize(
    "damage, reason",
    [
        (
            flip_byte,
            rf"checksum: {KERNEL} does not match its manifest \(crc32 0x[0-9a-f]{{8}}, "
            r"manifest 0x[0-9a-f]{8}\)|unreadable: " + KERNEL,
        ),
        (truncate, rf"unreadable: {KERNEL}: "),
        (delete_metadata, r"unreadable: state/_METADATA is missing"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_damaged_newest_step_falls_back_naming_the_reason_and_leaf(
    damage, reason, tmp_path, reference
):
    run_dir = copy_of(reference, tmp_path)
    damage(run_dir / "checkpoints" / "8")
    code, out = train(run_dir, "train.steps=8")
    assert code == 0, out
    (line,) = [line for line in out.splitlines() if line.startswith("  step 8: ")]
    assert re.match(rf"  step 8: (?:{reason})", line), line
    kind = line.split(": ")[1]  # checksum / unreadable
    assert line.endswith(f"; moved to 8.corrupt-{kind}") and f"8.corrupt-{kind}" in steps(run_dir)
    assert "(step 6)" in out, out
    assert_bitwise_equal(saved(run_dir, 8), saved(reference, 8))  # 8 retrained


def test_step_without_manifest_falls_back_to_the_newest_valid_one(tmp_path, reference):
    # The README's promise: a step whose manifest is missing is set aside, saying why, and the
    # run resumes from the newest step that verifies (not from step 0).
    run_dir = copy_of(reference, tmp_path)
    (run_dir / "checkpoints" / "8" / manifest_lib.MANIFEST).unlink()
    code, out = train(run_dir)
    assert code == 0, out
    assert "  step 8: no-manifest: no manifest.json" in out, out
    assert "moved to 8.corrupt-no-manifest" in out and "(step 6)" in out, out
    assert "starting at step 0" not in out, out
    assert_bitwise_equal(saved(run_dir, 8), saved(reference, 8))


def test_every_step_damaged_exits_nonzero_listing_each(tmp_path, reference):
    run_dir = copy_of(reference, tmp_path)
    for n in ("4", "6", "8"):
        truncate(run_dir / "checkpoints" / n)
    code, out = train(run_dir)
    assert code == 4, out
    assert "no checkpoint in" in out and "verifies" in out
    for n in ("4", "6", "8"):
        assert f"  step {n}: " in out, out
    assert "resumed from" not in out and "step      1/8" not in out  # never starts from scratch
    # #31 item 3: the same command again finds every step set aside: still refused.
    code, out = train(run_dir)
    assert code == 4 and "held complete checkpoints of this run" in out, out
    assert "resumed from" not in out and "step      1/8" not in out, out
    assert steps(run_dir) == [
        "4.corrupt-unreadable",
        "6.corrupt-unreadable",
        "8.corrupt-unreadable",
    ]


# --- a checkpoint that does not fit the config ---------------------------------------------------


@pytest.mark.parametrize(
    "change, expect",
    [
        (
            "model.options.width=32",
            "['params']['Dense_0']['kernel']: saved (64, 16) float32, expected (64, 32) float32",
        ),
        (
            "model.options.param_dtype=bfloat16",
            "['params']['Dense_0']['kernel']: saved (64, 16) float32, expected (64, 16) bfloat16",
        ),
        (
            "model.options.depth=2",
            "['params']['Dense_2']['kernel']: saved (absent), expected (16, 10) float32",
        ),
    ],
)
def test_restore_mismatch_lists_leaves_saved_vs_expected(change, expect, tmp_path, reference):
    run_dir = copy_of(reference, tmp_path)
    code, out = train(run_dir, change, "train.steps=10")
    assert code == 4 and "config differs" in out and change.split("=")[0] in out, out

    code, out = train(run_dir, change, "train.steps=10", "--allow-config-change")
    assert code == 4 and "does not fit this config's train state" in out, out
    assert expect in out, out
    assert steps(run_dir) == ["4", "6", "8"]  # a mismatch is not damage: nothing moved aside


def test_dtype_cast_only_with_opt_in(tmp_path, reference):
    run_dir = copy_of(reference, tmp_path)
    bf16 = ("model.options.param_dtype=bfloat16", "train.steps=10", "--allow-config-change")
    code, out = train(run_dir, *bf16, "--allow-dtype-cast")
    assert code == 0 and "casting" in out and "(step 8)" in out, out
    assert saved(run_dir, 10)["['params']['Dense_0']['kernel']"].dtype == jnp.bfloat16


# --- disk full, lock, NaN ------------------------------------------------------------------------


def test_disk_full_names_the_last_valid_step(tmp_path, reference):
    run_dir = tmp_path / "run"
    code, out = train(run_dir, fault="enospc@4")
    assert code == 4, out
    assert "disk full" in out and "last valid checkpoint is step 2" in out, out
    assert "2" in steps(run_dir) and "4" not in steps(run_dir)
    code, out = train(run_dir)
    assert code == 0 and "(step 2)" in out, out
    assert_bitwise_equal(saved(run_dir, 8), saved(reference, 8))


def test_second_process_on_the_run_directory_exits_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    lock = run_dir_lib.RunLock(run_dir)  # this test process is the first trainer
    try:
        code, out = train_in_child(run_dir)  # a second process: it must name this one
        assert code == 5 and f"pid {os.getpid()}" in out and "in use" in out, out
        # Refused before anything is built (no data loaded, no step compiled) or written.
        assert f"model {MODEL}" not in out and not (run_dir / "checkpoints").exists(), out
    finally:
        lock.release()


def test_nan_with_halt_exits_naming_the_step_and_keeps_finite_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    code, out = train(run_dir, fault="nan@3")
    assert code == 3 and "not finite at step 3" in out, out
    assert steps(run_dir) == ["2"]
    assert all(np.isfinite(x).all() for x in saved(run_dir, 2).values() if x.dtype.kind == "f")


def test_nan_with_skip_leaves_params_and_opt_state_unchanged(tmp_path):
    run_dir = tmp_path / "run"
    skip = ("train.on_nonfinite=skip", "train.steps=4", "checkpoint.every=1", "checkpoint.keep=9")
    code, out = train(run_dir, *skip, fault="nan@3")
    assert code == 0 and "skipped 1" in out, out
    s2, s3, s4 = (saved(run_dir, n) for n in (2, 3, 4))
    kept = [k for k in s2 if k.startswith(("['params']", "['opt_state']"))]
    assert kept
    assert_bitwise_equal({k: s2[k] for k in kept}, {k: s3[k] for k in kept})
    assert not np.array_equal(
        s3["['params']['Dense_0']['kernel']"], s4["['params']['Dense_0']['kernel']"]
    )

    code, out = train(tmp_path / "k", *skip, "--max-consecutive-skips", "2", fault="nan@2,nan@3")
    assert code == 3 and "2 consecutive steps skipped" in out and "step 3" in out, out


def register_read_only_checkpoints() -> None:
    """In a child: the model, and a file system that refuses orbax's step directories (what
    ``os.makedirs`` raises on a read-only one; a full inode table gives ENOSPC the same way)."""
    tiny_models.register_fault_mlp()
    real = os.makedirs

    def makedirs(name, *args, **kwargs):
        if ".orbax-checkpoint-tmp" in str(name):
            raise OSError(errno.EROFS, "Read-only file system", str(name))
        return real(name, *args, **kwargs)

    os.makedirs = makedirs


def test_save_that_cannot_create_its_directory_exits_4_promptly(tmp_path):
    # #31 item 5: orbax's save threads wait for a "directory created" signal that a failed
    # creation never sends, so interpreter shutdown used to wait minutes after the message.
    started = time.monotonic()
    register = "tests.train.test_faults:register_read_only_checkpoints"
    proc = launch(argv(tmp_path / "run"), register=register)
    try:
        out = proc.communicate(timeout=90)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running 90 s after it started:\n{proc.communicate()[0]}")
    assert proc.returncode == 4 and "saving checkpoint step 2" in out, out
    assert "Read-only file system" in out, out
    assert time.monotonic() - started < 60, out


# --- refused before anything is written (#31 item 6) ---------------------------------------------


def test_refused_resume_keeps_config_yaml_so_the_original_command_still_resumes(
    tmp_path, reference
):
    run_dir = copy_of(reference, tmp_path)
    config = (run_dir / "config.yaml").read_text()
    code, out = train(run_dir, "model.options.width=32", "--allow-config-change")
    assert code == 4 and "does not fit this config's train state" in out, out
    assert (run_dir / "config.yaml").read_text() == config
    code, out = train(run_dir)
    assert code == 0 and "run already complete" in out, out


def test_restart_with_a_batch_larger_than_the_data_deletes_nothing(tmp_path, reference):
    run_dir = copy_of(reference, tmp_path)
    code, out = train(run_dir, "data.batch_size=20000", "--restart")
    assert code == 2 and "fewer than one global batch of 20000" in out, out
    assert steps(run_dir) == ["4", "6", "8"] and (run_dir / "metrics.jsonl").exists()
    assert f"model {MODEL}" not in out  # refused before the step was compiled


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["model.name=transformer", "data.source=text", "data.path=/nonexistent"], "/nonexistent"),
        (["model.name=transformer", "data.source=text", f"data.path={sys.executable}"], "UTF-8"),
        (["mesh.data=64"], "does not fit the 8 devices"),
        (["optim.lr=.inf"], "optim.lr: Input should be a finite number"),
        (["checkpoint.keep_best=1"], "checkpoint.keep_best: 1 needs evaluations"),
        (["--max-consecutive-skips", "-1"], "--max-consecutive-skips=-1"),
        (["run_dir=/dev/null/run"], "cannot be created or written"),
    ],
    ids=["missing-path", "not-utf8", "mesh", "lr-inf", "keep-best", "skips", "run-dir"],
)
def test_bad_input_exits_2_naming_it_without_a_traceback(tmp_path, extra, expect):
    code, out = train(tmp_path / "run", *extra)
    assert code == 2 and expect in out and "Traceback" not in out, out


def test_bad_jax_num_processes_exits_2(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    code, out = train(tmp_path / "run")
    assert code == 2 and "JAX_NUM_PROCESSES='two'" in out, out


def test_sigterm_at_the_last_step_is_done_and_exits_0(tmp_path, reference):
    code, out = train_in_child(tmp_path / "run", fault="sigterm@8")
    assert code == 0 and "done: 8 steps" in out, out
    assert_bitwise_equal(saved(tmp_path / "run", 8), saved(reference, 8))
