"""Trainer overhead: steps/s of ``python -m train`` against a bare ``jax.jit`` loop.

The trainer runs in-process through its public entry, ``train.loop.run(cfg)``, with logging and
checkpointing at their default intervals (``train.log_every`` 50, ``checkpoint.every`` 100;
evaluation only at the end, which the trainer's steps/s excludes). Its rate comes from
``metrics.jsonl``: steps over the wall time of the logged windows after the first (the first
holds the donation check). The bare loop takes the same model, optimizer, train step and
batches from the train package's own builders and runs ``jax.jit(step, donate_argnums=0)`` over
the same number of steps with nothing else, timed once at the end.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import models  # noqa: E402
from benchmarks._common import Result, Target  # noqa: E402
from train import data as data_lib  # noqa: E402
from train import loop as loop_lib  # noqa: E402
from train import state as state_lib  # noqa: E402
from train.config import load_config  # noqa: E402

CONFIG = "configs/transformer.yaml"


def _trainer_rate(metrics: Path) -> tuple[float, int]:
    """Steps/s over the logged windows after the first, and the steps they cover."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    steps = seconds = 0.0
    for prev, cur in zip(train, train[1:], strict=False):
        n = cur["step"] - prev["step"]
        steps += n
        seconds += n / cur["steps_per_sec"]
    return steps / seconds, int(steps)


def _bare_rate(cfg, steps: int, warmup: int) -> float:
    """Steps/s of a plain donated jit loop on the trainer's model, step and batches."""
    spec = models.get(cfg.model.name)
    dataset = data_lib.load(cfg.data, task=spec.task)
    model = models.build(cfg.model.name, **loop_lib._model_options(cfg, spec, dataset))
    tx, schedule = state_lib.make_optimizer(cfg.optim, cfg.train.steps)
    example = dataset.example_batch(1)
    init = state_lib.make_init(
        model, tx, jax.ShapeDtypeStruct(example["x"].shape, example["x"].dtype), seed=0
    )
    state = jax.jit(init)()
    has_bn = bool(jax.tree.leaves(state.batch_stats))
    step_fn = state_lib.make_train_step(
        model, tx, schedule, compute_dtype=jnp.dtype(cfg.train.compute_dtype),
        has_batch_stats=has_bn,
    )  # fmt: skip
    step = jax.jit(step_fn, donate_argnums=0)
    batches = data_lib.Batches(dataset, global_batch=cfg.data.batch_size, seed=0)
    for _ in range(warmup):
        state, metrics = step(state, {k: jnp.asarray(v) for k, v in next(batches).items()})
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, {k: jnp.asarray(v) for k, v in next(batches).items()})
    jax.block_until_ready((state, metrics))
    return steps / (time.perf_counter() - t0)


def run(quick: bool = False) -> Result:
    total = 60 if quick else 400
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"run_dir={tmp}/run", f"train.steps={total}", "train.eval_every=0",
                     "train.eval_batches=1", "train.plot=false",
                     "train.progress='off'"]  # fmt: skip
        if quick:  # tiny: log / checkpoint intervals scaled down to fit 60 steps
            overrides = [*overrides, "model.options.d_model=32", "model.options.n_layers=2",
                         "data.batch_size=8", "data.seq_len=32", "model.options.max_len=32",
                         "train.log_every=10", "checkpoint.every=30"]  # fmt: skip
        cfg = load_config(CONFIG, overrides)
        t0 = time.perf_counter()
        result = loop_lib.run(cfg, restart=True, out=lambda s: None)
        wall = time.perf_counter() - t0
        rate, covered = _trainer_rate(Path(tmp) / "run" / "metrics.jsonl")
        checkpoints = sorted(p.name for p in (Path(tmp) / "run" / "checkpoints").iterdir())
    bare = _bare_rate(cfg, covered, warmup=3)
    frac = rate / bare
    print(f"trainer {rate:.2f} steps/s, bare {bare:.2f} steps/s ({frac:.1%})", flush=True)
    lines = [
        f"`python -m train --config {CONFIG}` (in-process: `train.loop.run`), "
        f"{total} steps, logging every {cfg.train.log_every} and checkpointing every "
        f"{cfg.checkpoint.every} steps (orbax; kept: {', '.join(checkpoints)}), evaluation only "
        f"at the end; against a bare `jax.jit(step, donate_argnums=0)` loop over the same "
        f"model, optimizer, step function and batches."
        + (" Quick: a 2-layer d_model 32 model, shorter intervals." if quick else ""),
        "",
        "| loop | steps timed | steps/s |",
        "|---|--:|--:|",
        f"| trainer (logged windows after the first) | {covered} | {rate:.2f} |",
        f"| bare jit loop | {covered} | {bare:.2f} |",
        "",
        f"Trainer / bare = {frac:.1%}. The trainer's whole invocation took {wall:.1f} s for "
        f"{result.step} steps (setup, compile, final eval and save included).",
    ]
    fig, ax = plt.subplots(figsize=(5, 2.4))
    ax.barh(["bare jit loop", "python -m train"], [bare, rate], color=["tab:gray", "tab:blue"])
    ax.set_xlabel("steps / s")
    ax.set_title(f"Trainer overhead: {frac:.1%} of a bare jit loop", fontsize=8)
    targets = [Target("trainer steps/s >= 97% of a bare jit loop", frac >= 0.97,
                      f"{rate:.2f} / {bare:.2f} = {frac:.1%}")]  # fmt: skip
    return Result("trainer", "\n".join(lines), {"trainer.png": fig}, targets)
