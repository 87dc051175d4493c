"""Trainer overhead: steps/s of ``python -m train`` against a bare ``jax.jit`` loop.

The trainer runs in-process through its public entry, ``train.loop.run(cfg)``, with logging and
checkpointing at their default intervals (``train.log_every`` 50, ``checkpoint.every`` 100;
evaluation only at the end, which the trainer's steps/s excludes). Its rate comes from
``metrics.jsonl``: steps over the wall time of the logged windows after the first (the first
holds the donation check). The bare loop takes the same model, optimizer, train step and
batches from the train package's own builders and runs ``jax.jit(step, donate_argnums=0)`` over
the same number of steps with nothing else, timed once at the end. Paired: each round runs the
trainer (a fresh run), the bare loop and the bare loop again (a second state: the noise) in a
fresh random order; the ratio is the median over rounds of the two rates of the same round.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import models  # noqa: E402
from benchmarks._common import AGAIN, Paired, Result, Target, rounds_text, verdict  # noqa: E402
from train import data as data_lib  # noqa: E402
from train import experiment as experiment_lib  # noqa: E402
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


class _Bare:
    """A plain donated jit loop on the trainer's model, step and batches."""

    def __init__(self, cfg) -> None:
        spec = models.get(cfg.model.name)
        dataset = data_lib.load(cfg.data, task=spec.task)
        model = models.build(cfg.model.name, **experiment_lib.model_options(cfg, spec, dataset))
        tx, schedule = state_lib.make_optimizer(cfg.optim, cfg.train.steps)
        example = dataset.example_batch(1)
        init = state_lib.make_init(
            model, tx, jax.ShapeDtypeStruct(example["x"].shape, example["x"].dtype), seed=0
        )
        self.init = jax.jit(init)
        self.state = self.init()
        has_bn = bool(jax.tree.leaves(self.state.batch_stats))
        step_fn = state_lib.make_train_step(
            model,
            tx,
            schedule,
            compute_dtype=jnp.dtype(cfg.train.compute_dtype),
            has_batch_stats=has_bn,
        )
        self.step = jax.jit(step_fn, donate_argnums=0)
        self._batches = functools.partial(
            data_lib.Batches, dataset, global_batch=cfg.data.batch_size, seed=0
        )
        self.batches = self._batches()

    def again(self) -> _Bare:
        """A second loop from the start: the same jitted init and step (one compile each), a
        state and batches of its own."""
        other = copy.copy(self)
        other.state, other.batches = self.init(), self._batches()
        return other

    def steps(self, n: int) -> None:
        metrics = None
        for _ in range(n):
            batch = {k: jnp.asarray(v) for k, v in next(self.batches).items()}
            self.state, metrics = self.step(self.state, batch)
        jax.block_until_ready((self.state, metrics))

    def rate(self, n: int) -> float:
        """Steps/s over ``n`` steps."""
        t0 = time.perf_counter()
        self.steps(n)
        return n / (time.perf_counter() - t0)


def run(quick: bool = False) -> Result:
    total, rounds = (60, 1) if quick else (125, 3)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"run_dir={tmp}/run",
            f"train.steps={total}",
            "train.eval_every=0",
            "checkpoint.keep_best=0",  # the config keeps the best by eval; no evals here
            "train.eval_batches=1",
            "train.plot=false",
            "train.progress='off'",
        ]
        if quick:  # tiny: log / checkpoint intervals scaled down to fit 60 steps
            overrides = [
                *overrides,
                "model.options.d_model=32",
                "model.options.n_layers=2",
                "data.batch_size=8",
                "data.seq_len=32",
                "model.options.max_len=32",
                "train.log_every=10",
                "checkpoint.every=30",
            ]
        cfg = load_config(CONFIG, overrides)
        bare = _Bare(cfg)
        again = bare.again()
        for b in (bare, again):
            b.steps(3)  # compile and warm up
        samples: dict[str, list[float]] = {"trainer": [], "bare": [], AGAIN: []}
        walls, kept, covered = [], [], 0
        rng = random.Random(0)
        for i in range(rounds):
            for k in rng.sample(list(samples), len(samples)):
                if k == "trainer":
                    run_cfg = load_config(CONFIG, [*overrides, f"run_dir={tmp}/run{i}"])
                    t0 = time.perf_counter()
                    result = loop_lib.run(run_cfg, restart=True, out=lambda s: None)
                    walls.append(time.perf_counter() - t0)
                    rate, covered = _trainer_rate(Path(tmp) / f"run{i}" / "metrics.jsonl")
                    kept = sorted(p.name for p in (Path(tmp) / f"run{i}" / "checkpoints").iterdir())
                else:
                    n = covered or (total - cfg.train.log_every)
                    rate = (bare if k == "bare" else again).rate(n if k == "bare" else n // 2)
                samples[k].append(1 / rate)
    times = Paired(samples, "bare")
    frac = times.ratio("bare", "trainer")  # trainer rate / bare rate = bare time / trainer time
    rate, bare_rate = 1 / times.seconds("trainer"), 1 / times.seconds("bare")
    noise = times.noise
    above = ""
    if frac > 1:
        above = " (above 1 within the noise)"
        if frac - 1 > noise:
            above = " (above 1 by more than the noise: the trainer cannot be faster)"
    print(f"trainer {rate:.2f} steps/s, bare {bare_rate:.2f} steps/s ({frac:.1%})", flush=True)
    lines = [
        f"`python -m train --config {CONFIG}` (in-process: `train.loop.run`), "
        f"{total} steps per run, logging every {cfg.train.log_every} and checkpointing every "
        f"{cfg.checkpoint.every} steps (orbax; kept: {', '.join(kept)}), evaluation only "
        f"at the end; against a bare `jax.jit(step, donate_argnums=0)` loop over the same "
        f"model, optimizer, step function and batches. {rounds_text(rounds)}, each running a fresh "
        f"trainer run, {covered} bare steps and {covered // 2} bare steps of a second state (the "
        "noise: bare vs itself) in a fresh random order."
        + (" Quick: a 2-layer d_model 32 model, shorter intervals." if quick else ""),
        "",
        "| loop | steps timed per round | steps/s (median over rounds) |",
        "|---|--:|--:|",
        f"| trainer (logged windows after the first) | {covered} | {rate:.2f} |",
        f"| bare jit loop | {covered} | {bare_rate:.2f} |",
        "",
        f"Trainer / bare = {frac:.1%}{above} (median over rounds of the ratio within a round; "
        f"noise {times.noise_text()}). A trainer run took {min(walls):.1f} s to "
        f"{max(walls):.1f} s for {result.step} steps (setup, compile, final eval and save "
        "included).",
    ]
    fig, ax = plt.subplots(figsize=(5, 2.4))
    ax.barh(["bare jit loop", "python -m train"], [bare_rate, rate], color=["tab:gray", "tab:blue"])
    ax.set_xlabel("steps / s")
    ax.set_title(f"Trainer overhead: {frac:.1%} of a bare jit loop", fontsize=8)
    # The bare loop is the trainer's upper bound: a trainer measured faster beyond the noise
    # says the two were not timed alike (load that changed between them), not that it is met.
    judged = verdict(frac, 0.97, noise, at_most=False)
    if frac - 1 > noise:
        judged = "inconclusive (trainer faster than its upper bound beyond the noise)"
    targets = [
        Target(
            "trainer steps/s >= 97% of a bare jit loop",
            judged,
            f"{frac:.1%}{above} ({rate:.2f} vs {bare_rate:.2f} steps/s, medians)",
            times.noise_text(),
        )
    ]
    return Result("trainer", "\n".join(lines), {"trainer.png": fig}, targets)
