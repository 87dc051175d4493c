"""Where a run starts (step 3 of :func:`train.loop.run`): the newest verified checkpoint's state
and data position, restored onto this run's mesh, or a fresh state (the model's init, or
``init_from`` another run); and what a resumed run says before it steps (already complete; a
learning rate already 0).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from train import donation, init_from
from train import state as state_lib
from train.checkpoint import Checkpointer
from train.config import Config
from train.errors import CheckpointError
from train.experiment import Experiment, schedule_steps
from train.metrics_file import trim_metrics
from train.state import TrainState

__all__ = ["Resume", "already_complete", "restore_or_init", "warn_if_schedule_spent"]


@dataclass(frozen=True)
class Resume:
    """Where a run starts: the step, the data iterator's grain state, and its checkpoint."""

    step: int = 0
    data_state: dict[str, Any] | None = None
    checkpoint: int | None = None


def restore_or_init(
    exp: Experiment, ckpt: Checkpointer, *, allow_dtype_cast: bool, allow_config_change: bool
) -> tuple[TrainState, Resume]:
    """The newest verified checkpoint's state, or a fresh one.

    Resumes in this order:

    1. find the newest *verified* checkpoint (orbax renames a step directory into place only
       when its save finished; its manifest must match its leaves' shapes, dtypes and
       checksums; a step that does not verify is moved aside, see train/checkpoint.py);
    2. restore the state onto this run's mesh shardings (any device count);
    3. re-materialise it on device, so the first step donates like every other (jax#18617);
    4. restore the data iterator's grain state, so batches continue exactly;
    5. drop lines of metrics.jsonl past the restored step (logged after that checkpoint; all
       of them when starting at step 0), rewriting it atomically (train/metrics_file.py).

    Raises:
      CheckpointError: steps exist but none verifies, or the newest does not fit the config.
      DonationError: one buffer at two leaves of the state.
    """
    # Find, restore and re-materialise: the newest verified step, restored onto this mesh with
    # every leaf re-made in an XLA-owned buffer one at a time (peak: the state plus one leaf), so
    # the first step donates.
    try:
        found = ckpt.restore_latest(
            exp.abstract,
            allow_dtype_cast=allow_dtype_cast,
            allow_config_change=allow_config_change,
            donatable=True,
        )
    except CheckpointError as e:
        if exp.plan_file is None or "does not fit this config's train state" not in str(e):
            raise
        # remat: policy: auto builds the model the plan file names (a variant may change the
        # parameters): a plan file that is not the checkpoints' builds another model.
        raise CheckpointError(
            f"{e}\nWith remat: {{policy: auto}} the model is built from {exp.plan_file} (its "
            "variant and model_options): if that file was removed, edited or copied from "
            "another run, the model built differs from the one the checkpoints were trained "
            "with. Fix: put back the run's own remat_plan.yaml, or --restart (plans again and "
            "trains from step 0)."
        ) from None
    if found is None:
        state, resume = _fresh_start(exp)
        if exp.is_main:  # lines of a run killed before its first save: logged again
            trim_metrics(exp.run_dir / "metrics.jsonl", resume.step)
    else:
        state, meta, latest = found
        # grain's iterator state: the batches continue where the checkpoint left them.
        resume = Resume(int(meta["step"]), dict(meta["data_state"]), latest)
        if exp.is_main:  # steps after the checkpoint run again: their lines are logged again
            trim_metrics(exp.run_dir / "metrics.jsonl", resume.step)
        exp.say(f"resumed from {ckpt.directory / str(latest)} (step {resume.step})")
    # One buffer at two leaves would be donated twice; say which leaves, before the first step.
    donation.check_distinct_buffers(state)
    return state, resume


def _fresh_start(exp: Experiment) -> tuple[TrainState, Resume]:
    # The model's init, or (init_from) another run's checkpoint taken into it.
    state = jax.jit(exp.init, out_shardings=exp.state_shardings)()
    source = exp.cfg.init_from
    if source is None:
        return state, Resume()
    state = init_from.init_state(source, exp.abstract, state)
    step = int(state.step)
    exp.say(f"initialised from {init_from.source_step(source.path)} ({source.what}, step {step})")
    return state, Resume(step=step)


def warn_if_schedule_spent(exp: Experiment, step: int) -> None:
    # A resumed run whose learning rate is already 0 would take its remaining steps without
    # changing a parameter (an extension of a run whose cosine decayed to 0).
    cfg = exp.cfg
    _, schedule = state_lib.make_optimizer(cfg.optim, schedule_steps(cfg))
    if step == 0 or float(schedule(step)) != 0.0 or not exp.is_main:
        return
    print(
        f"WARNING: the learning rate is 0 at step {step}: the {cfg.optim.schedule} schedule "
        f"ended at optim.schedule_steps={schedule_steps(cfg)} with optim.final_lr_fraction="
        f"{cfg.optim.final_lr_fraction}, so steps {step + 1}..{cfg.train.steps} will not change "
        "the parameters. Fix: a new schedule from here in a new run directory with init_from: "
        f"{{path: {exp.run_dir}, what: params}} (fresh optimizer state and warm-up), or "
        "optim.final_lr_fraction > 0; a longer optim.schedule_steps would raise the lr again "
        "mid-run.",
        file=sys.stderr,
        flush=True,
    )


def already_complete(cfg: Config, step: int, run_dir: Path) -> str:
    extend = f"train.steps=<more> optim.schedule_steps={schedule_steps(cfg)}"
    if cfg.optim.schedule == "constant":
        extend = "train.steps=<more>"
    return (
        f"run already complete: step {step}/{cfg.train.steps} in {run_dir}; nothing to do. To "
        f"train further on the same learning-rate schedule rerun with {extend}; --restart "
        "trains again from step 0."
    )
