"""The train loop: ``run(cfg)`` trains, evaluates, checkpoints and logs one configured run.

A run takes five named steps, each a function below, read top to bottom:

1. :func:`start` — lock the run directory (a second trainer exits naming the holder) and refuse
   a config that changed since the checkpoints were written (with the diff). Process 0 decides
   and every process learns the verdict, so on failure all processes exit at once with the same
   error instead of waiting for the coordinator's timeout.
2. :func:`build_experiment` — data, model, mesh, optimizer, and the train step compiled ahead of
   time with the whole :class:`TrainState` donated (proved from XLA's alias bytes).
3. :func:`restore_or_init` — resume, in this order (unless ``restart``):
     a. find the newest *verified* checkpoint (orbax renames a step directory into place only
        when its save finished; its manifest must match its leaves' shapes, dtypes and
        checksums; a step that does not verify is moved aside, see train/checkpoint.py);
     b. restore the state onto this run's mesh shardings (any device count);
     c. re-materialise it on device, so the first step donates like every other (jax#18617);
     d. restore the data iterator's grain state, so batches continue exactly (a checkpoint
        written before the grain pipeline holds only a position and is refused: its data order
        cannot be continued);
     e. drop lines of metrics.jsonl past the restored step (logged after that checkpoint; all
        of them when starting at step 0), rewriting it atomically (train/metrics_file.py).
4. :func:`train_loop` — step, log, eval and checkpoint sections. The host syncs only at log,
   eval and checkpoint steps; in between, steps are dispatched asynchronously and their metrics
   stay on device. SIGTERM / SIGINT stop the loop at a step boundary every process agrees on
   (:class:`train.multihost.StopSignals`), where it checkpoints.
5. :func:`finish` — the plot and the summary line.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from tqdm import tqdm

from train import data as data_lib
from train import faults, init_from, integrity, multihost
from train import sharding as sharding_lib
from train import state as state_lib
from train.checkpoint import Checkpointer
from train.config import Config, dump_config
from train.dry_run import dry_run_report
from train.errors import SetupError
from train.experiment import Experiment, build_experiment, schedule_steps
from train.integrity import CheckpointError, ConfigChangedError, RunLockedError
from train.metrics_file import trim_metrics
from train.profile import ProfileWindow
from train.save_timer import SaveTimer
from train.state import TrainState

__all__ = [
    "CheckpointError",
    "ConfigChangedError",
    "NonFiniteError",
    "RunLockedError",
    "RunResult",
    "SetupError",
    "finish",
    "restore_or_init",
    "run",
    "start",
    "train_loop",
]


class NonFiniteError(RuntimeError):
    """The loss or gradient became NaN/Inf and ``train.on_nonfinite`` is ``halt``.

    The last checkpoint (saved before the bad step, and only after its steps were checked) is
    kept. Fix: lower ``optim.lr``, add ``optim.clip_norm``, warm up longer, or set
    ``train.on_nonfinite=skip`` to drop the bad updates. Also raised by ``skip`` after
    ``max_consecutive_skips`` bad steps in a row.
    """


@dataclass
class RunResult:
    """What :func:`run` returns.

    Attributes:
      step: steps taken in total (including resumed ones).
      state: the final train state (device arrays); None for a dry run.
      eval: the last evaluation (``loss`` and the loss function's metrics), if any.
      interrupted: the signal name that stopped the run early, if any.
      run_dir: the run directory.
      resumed_from: the step restored at start, if the run resumed.
      seconds: wall time of this invocation.
    """

    step: int
    state: TrainState | None
    eval: dict[str, float] | None = None
    interrupted: str | None = None
    run_dir: Path = field(default_factory=Path)
    resumed_from: int | None = None
    seconds: float = 0.0


def run(
    cfg: Config,
    *,
    restart: bool = False,
    dry_run: bool = False,
    stop_after: int | None = None,
    out: Callable[[str], None] | None = None,
    allow_config_change: bool = True,
    allow_dtype_cast: bool = False,
    max_consecutive_skips: int = 10,
) -> RunResult:
    """Trains ``cfg`` to ``cfg.train.steps``, resuming from its run directory's checkpoints.

    Args:
      cfg: the validated config.
      restart: delete the run directory's checkpoints and metrics and start from step 0.
      dry_run: build everything, print parameters, weight decay, matmul dtypes and memory (remat
        plan residuals and XLA's compiled memory of the step), and return without training.
      stop_after: take at most this many steps in this invocation, then checkpoint and return
        (as a preemption would); rerun to continue.
      out: where log lines go (default: print, or above the progress bar).
      allow_config_change: resume even if keys that change the computation differ from the run
        directory's config.yaml (the CLI refuses unless ``--allow-config-change``).
      allow_dtype_cast: restore checkpoint leaves saved in another dtype by casting them.
      max_consecutive_skips: with ``train.on_nonfinite=skip``, halt after this many bad steps in
        a row.

    Returns:
      A :class:`RunResult`.

    Raises:
      NonFiniteError: a NaN/Inf loss with ``train.on_nonfinite=halt`` (or too many skips).
      CheckpointError: no checkpoint verifies, one does not fit the config, or a save failed.
      ConfigChangedError: the config changed since the checkpoints were written.
      RunLockedError: another process trains into the same run directory.
      SetupError: the config does not fit the data, the devices or the machine.
      state_lib.DonationError: the step did not donate the state.
    """
    t_start = time.perf_counter()
    say = _printer(out, multihost.is_main())
    if dry_run:
        exp = build_experiment(cfg, say=say, out=out, restart=False, dry_run=True)
        dry_run_report(exp)
        return RunResult(0, None, run_dir=exp.run_dir, seconds=_since(t_start))

    lock = start(cfg, restart=restart, allow_config_change=allow_config_change, say=say)
    try:
        exp = build_experiment(cfg, say=say, out=out, restart=restart, dry_run=False)
        _prepare_run_dir(exp, restart=restart)
        ckpt = Checkpointer(
            exp.run_dir / "checkpoints",
            cfg.checkpoint,
            config_hash=integrity.config_hash(cfg.model_dump(mode="json")),
            warn=lambda s: print(s, file=sys.stderr, flush=True),
        )
        try:
            if ckpt.removed_tmp:
                say(f"removed unfinished saves of a killed run: {', '.join(ckpt.removed_tmp)}")
            state, resume = restore_or_init(
                exp,
                ckpt,
                allow_dtype_cast=allow_dtype_cast,
                allow_config_change=allow_config_change,
            )
            _record_config(exp)
            if resume.step >= cfg.train.steps:
                say(_already_complete(cfg, resume.step, exp.run_dir))
                return RunResult(
                    resume.step,
                    state,
                    run_dir=exp.run_dir,
                    resumed_from=resume.step,
                    seconds=_since(t_start),
                )
            _warn_if_schedule_spent(exp, resume.step)
            outcome = train_loop(
                exp,
                ckpt,
                state,
                resume,
                stop_after=stop_after,
                max_consecutive_skips=max_consecutive_skips,
            )
        finally:
            try:
                ckpt.wait()  # raises if the last save failed (e.g. disk full)
            finally:
                ckpt.close()
        return finish(exp, outcome, resumed_from=resume.checkpoint, seconds=_since(t_start))
    finally:
        if lock is not None:
            lock.release()


# ============================== 1. start-up ==============================


def start(
    cfg: Config, *, restart: bool, allow_config_change: bool, say: Callable[[str], None]
) -> integrity.RunLock | None:
    """Locks the run directory and checks the config, on process 0; shared with every process.

    Returns:
      The lock (held by process 0 until the run returns; None elsewhere).

    Raises:
      RunLockedError, ConfigChangedError: on every process, when process 0's check fails.
    """
    run_dir = cfg.resolved_run_dir.absolute()
    lock, failure = None, None
    if multihost.is_main():
        try:
            lock = integrity.RunLock(run_dir)
            if not restart:  # refused before anything is built
                _check_config_change(run_dir, cfg, allow=allow_config_change, say=say)
        except Exception as e:
            failure = e
            if lock is not None:
                lock.release()
    try:
        multihost.share_verdict(failure, what="start-up")
        multihost.check_same_config(integrity.config_hash(cfg.model_dump(mode="json")))
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


def _check_config_change(
    run_dir: Path, cfg: Config, *, allow: bool, say: Callable[[str], None]
) -> None:
    # Only checkpoints make a changed config matter: without them the run starts afresh. A run
    # directory that ever held one is checked even when every step was set aside since.
    ckpts = run_dir / "checkpoints"
    if not (run_dir / "config.yaml").exists() or not ckpts.is_dir():
        return
    if not integrity.checkpointed(ckpts) and not any(p.name.isdigit() for p in ckpts.iterdir()):
        return
    old = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    unsafe, safe = integrity.config_diff(old, cfg.model_dump(mode="json"))
    if unsafe and not allow:
        raise ConfigChangedError(
            f"the config differs from the one {run_dir} was trained with (config.yaml):\n"
            + "\n".join(unsafe)
            + "\nFix: rerun with the old values, use another run_dir or --restart, or pass "
            "--allow-config-change to resume with the new ones."
        )
    if unsafe or safe:
        say("config changed since the last run (resuming):\n" + "\n".join(unsafe + safe))


def _prepare_run_dir(exp: Experiment, *, restart: bool) -> None:
    # Process 0 clears a restarted run; the others wait for it.
    if exp.is_main:
        if restart and exp.run_dir.exists():
            shutil.rmtree(exp.run_dir / "checkpoints", ignore_errors=True)
            (exp.run_dir / "metrics.jsonl").unlink(missing_ok=True)
            (exp.run_dir / "plot.png").unlink(missing_ok=True)
        exp.run_dir.mkdir(parents=True, exist_ok=True)
    multihost.sync("run_dir")


def _record_config(exp: Experiment) -> None:
    # Once the checkpoints were accepted under this config: a refused resume leaves the config
    # the run was trained with, so the original command still resumes.
    if exp.is_main:
        integrity.write_text(exp.run_dir / "config.yaml", dump_config(exp.cfg))


# ============================== 3. restore ==============================


@dataclass(frozen=True)
class Resume:
    """Where a run starts: the step, the data iterator's grain state, and its checkpoint."""

    step: int = 0
    data_state: dict[str, Any] | None = None
    checkpoint: int | None = None


def restore_or_init(
    exp: Experiment, ckpt: Checkpointer, *, allow_dtype_cast: bool, allow_config_change: bool
) -> tuple[TrainState, Resume]:
    """The newest verified checkpoint's state (steps a-e of the module docstring), or a fresh one.

    Raises:
      CheckpointError: steps exist but none verifies, or the newest does not fit the config.
      state_lib.DonationError: one buffer at two leaves of the state.
    """
    # a, b, c: the newest verified step, restored onto this mesh with every leaf re-made in an
    # XLA-owned buffer one at a time (peak: the state plus one leaf), so the first step donates.
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
        if "data_state" not in meta:  # d
            raise CheckpointError(
                f"checkpoint step {latest} in {ckpt.directory} was written by the data loader "
                f"before grain: it holds only data_position={meta.get('data_position')}, and "
                "the grain pipeline orders the examples differently, so the run cannot continue "
                "with the batches it would have seen. Fix: --restart (train again from step 0 "
                "with this version), or finish the run with the remat_nn version that wrote it."
            )
        resume = Resume(int(meta["step"]), dict(meta["data_state"]), latest)
        if exp.is_main:
            trim_metrics(exp.run_dir / "metrics.jsonl", resume.step)  # e
        exp.say(f"resumed from {ckpt.directory / str(latest)} (step {resume.step})")
    # One buffer at two leaves would be donated twice; say which leaves, before the first step.
    state_lib.check_distinct_buffers(state)
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


def _warn_if_schedule_spent(exp: Experiment, step: int) -> None:
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


def _already_complete(cfg: Config, step: int, run_dir: Path) -> str:
    extend = f"train.steps=<more> optim.schedule_steps={schedule_steps(cfg)}"
    if cfg.optim.schedule == "constant":
        extend = "train.steps=<more>"
    return (
        f"run already complete: step {step}/{cfg.train.steps} in {run_dir}; nothing to do. To "
        f"train further on the same learning-rate schedule rerun with {extend}; --restart "
        "trains again from step 0."
    )


# ============================== 4. the loop ==============================


@dataclass
class Outcome:
    """How :func:`train_loop` ended."""

    step: int
    state: TrainState
    eval: dict[str, float] | None
    interrupted: str | None


class _StepMetrics:
    """Step metrics: on device until a host sync (:meth:`drain`), then a window until logged."""

    def __init__(self, *, halt: bool, max_consecutive_skips: int):
        self.halt, self.max_consecutive_skips = halt, max_consecutive_skips
        self.pending: list[dict[str, jax.Array]] = []  # device metrics since the last drain
        self.window: list[dict[str, float]] = []  # finite host metrics since the last log line
        self.skipped = self.consecutive_skips = 0
        self.lr = float("nan")  # lr of the latest drained step

    def drain(self, step: int, *, last_good: str) -> None:
        """Fetches pending metrics (the loop's only host sync) and checks they are finite.

        Raises:
          NonFiniteError: a non-finite step with ``halt``, or too many skipped in a row.
        """
        host = jax.device_get(self.pending)
        self.pending.clear()
        if host:
            self.lr = float(host[-1]["lr"])
        for i, m in enumerate(host):
            if bool(m["finite"]):
                self.consecutive_skips = 0
                self.window.append({k: float(v) for k, v in m.items()})
                continue
            bad = step - len(host) + i + 1
            if self.halt:
                raise NonFiniteError(
                    f"loss or gradient is not finite at step {bad} (loss={float(m['loss'])}, "
                    f"grad_norm={float(m['grad_norm'])}). Halted without saving; the last good "
                    f"checkpoint is {last_good}. Fix: lower optim.lr, set optim.clip_norm, or "
                    "train.on_nonfinite=skip."
                )
            self.skipped += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.max_consecutive_skips:
                raise NonFiniteError(
                    f"loss or gradient is not finite at step {bad}: {self.consecutive_skips} "
                    f"consecutive steps skipped (train.on_nonfinite=skip). Halted; the last good "
                    f"checkpoint is {last_good}. Fix: lower optim.lr or set optim.clip_norm."
                )

    def mean(self, key: str) -> float:
        # Mean over the finite steps of the window; NaN if every step was skipped.
        return float(np.mean([r[key] for r in self.window])) if self.window else float("nan")


def evaluate(exp: Experiment, state: TrainState) -> dict[str, float]:
    """The loss and its metrics on the test split (at most ``train.eval_batches`` batches)."""
    sums = jax.device_put(state_lib.eval_zeros(exp.metric_names), exp.replicated)
    for local in data_lib.eval_batches(
        exp.dataset,
        global_batch=exp.global_batch,
        max_batches=exp.cfg.train.eval_batches,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    ):
        sums = exp.eval_step(state, sharding_lib.global_batch(local, exp.batch_sharding), sums)
    s = jax.device_get(sums)
    count = max(float(s["count"]), 1.0)
    return {k: float(s[k]) / count for k in ("loss", *exp.metric_names)}


class _MetricsFile:
    """metrics.jsonl, one JSON line per log or eval (process 0 only)."""

    def __init__(self, path: Path, *, enabled: bool):
        self._f = open(path, "a") if enabled else None  # noqa: SIM115 (closed by close())

    def record(self, split: str, step: int, values: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"split": split, "step": step, **values}) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


class _Tee:
    """metrics.jsonl and the TensorBoard scalars (train.tensorboard), written together."""

    def __init__(self, *logs: Any):
        self.logs = logs

    def record(self, split: str, step: int, values: dict[str, Any]) -> None:
        for log in self.logs:
            log.record(split, step, values)

    def close(self) -> None:
        for log in self.logs:
            log.close()


def _with_tensorboard(exp: Experiment, log: _MetricsFile) -> _MetricsFile | _Tee:
    if not (exp.is_main and exp.cfg.train.tensorboard):
        return log
    from train.tensorboard import TensorBoard

    return _Tee(log, TensorBoard(exp.run_dir, exp.run_dir / "metrics.jsonl"))


def train_loop(
    exp: Experiment,
    ckpt: Checkpointer,
    state: TrainState,
    resume: Resume,
    *,
    stop_after: int | None = None,
    max_consecutive_skips: int = 10,
) -> Outcome:
    """Steps from ``resume`` to ``train.steps`` (or ``stop_after`` more, or a signal).

    ``state`` is donated to the first step: do not use it after the call.
    """
    cfg = exp.cfg
    total = cfg.train.steps
    end = total if stop_after is None else min(total, resume.step + stop_after)
    nan_steps = faults.nan_steps()  # fault injection: these steps get a NaN batch
    if nan_steps and not jnp.issubdtype(exp.dataset.example_batch(1)["x"].dtype, jnp.floating):
        raise SetupError(
            f"{faults.ENV}: nan@<step> needs float inputs; {exp.dataset.name} has ints"
        )
    batches = data_lib.Batches(
        exp.dataset,
        global_batch=exp.global_batch,
        seed=cfg.train.seed,
        augment=cfg.data.augment,
        state=resume.data_state,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        prefetch=cfg.data.prefetch,
        read_threads=cfg.data.read_threads,
    )
    metrics = _StepMetrics(
        halt=cfg.train.on_nonfinite == "halt", max_consecutive_skips=max_consecutive_skips
    )
    log = _with_tensorboard(exp, _MetricsFile(exp.run_dir / "metrics.jsonl", enabled=exp.is_main))
    stop = multihost.StopSignals()
    timer = SaveTimer(cfg.checkpoint.every_minutes, clock=_clock)
    profile = ProfileWindow(cfg.train.profile, exp.run_dir, say=exp.say)
    bar = tqdm(
        total=total,
        initial=resume.step,
        disable=not _progress_enabled(cfg, exp.is_main),
        dynamic_ncols=True,
        unit="step",
    )
    say = exp.say if bar.disable else _printer(exp.out or tqdm.write, exp.is_main)
    step, last_ckpt = resume.step, resume.checkpoint
    last_eval: dict[str, float] | None = None
    interrupted: str | None = None
    t_log, step_log = time.perf_counter(), step
    try:
        while step < end:
            # ============================== step ==============================
            profile.at(step, state)
            batch = sharding_lib.global_batch(next(batches), exp.batch_sharding)
            if step + 1 in nan_steps:
                batch = {**batch, "x": batch["x"] * jnp.nan}
            first = step == resume.step and cfg.train.verify_donation
            donated = jax.tree_util.tree_leaves_with_path(state) if first else None
            state, step_metrics = exp.train_step(state, batch)  # donates `state`
            del batch
            if donated is not None:
                state_lib.verify_donated_inputs_deleted(donated)
                del donated
            step += 1
            metrics.pending.append(step_metrics)
            bar.update(1)
            faults.signal_if(step)
            stopping = stop.stop_at(step)
            is_log = step % cfg.train.log_every == 0 or step == end or stopping
            every_eval = cfg.train.eval_every
            is_eval = step == total or bool(every_eval and step % every_eval == 0)
            timed = timer.due(synced=is_log)
            is_ckpt = step % cfg.checkpoint.every == 0 or step == end or stopping or timed
            if is_log or is_eval or is_ckpt:
                where = f"step {last_ckpt} in {ckpt.directory}" if last_ckpt is not None else "none"
                metrics.drain(step, last_good=where)

            # ============================== log ==============================
            if is_log:
                now = time.perf_counter()
                rate = (step - step_log) / max(now - t_log, 1e-9)
                line = {
                    "loss": metrics.mean("loss"),
                    **{k: metrics.mean(k) for k in exp.metric_names},
                    "grad_norm": metrics.mean("grad_norm"),
                    "lr": metrics.lr,
                    "steps_per_sec": rate,
                    "examples_per_sec": rate * exp.global_batch,
                    "epoch": batches.epoch,
                    "skipped": metrics.skipped,
                }
                metrics.window.clear()
                t_log, step_log = now, step
                log.record("train", step, line)
                say(
                    f"step {step:>6}/{total} | loss {line['loss']:.4f} | "
                    + "".join(f"{_short(k)} {line[k]:.3f} | " for k in exp.metric_names)
                    + f"lr {line['lr']:.3g} | {rate:.2f} steps/s | "
                    f"{rate * exp.global_batch:.0f} ex/s"
                    + (f" | skipped {metrics.skipped}" if metrics.skipped else "")
                )
                bar.set_postfix(
                    loss=f"{line['loss']:.3f}",
                    **{_short(k): f"{line[k]:.3f}" for k in exp.metric_names},
                )
            if is_eval:
                last_eval = evaluate(exp, state)
                log.record("eval", step, last_eval)
                say(f"eval @ {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in last_eval.items()))
                t_log = time.perf_counter()  # eval time does not count against steps/s

            # ============================== checkpoint ==============================
            if is_ckpt:
                # Steps up to here were checked finite by the drain; this step's eval (if it had
                # one) ranks the checkpoint for keep_best.
                ranked = None
                if is_eval and last_eval is not None:
                    ranked = {f"eval_{k}": v for k, v in last_eval.items()}
                force = step == end or stopping or timed
                if ckpt.save(
                    step,
                    state,
                    data_position=batches.position,
                    data_state=batches.get_state(),
                    metrics=ranked,
                    force=force,
                ):
                    last_ckpt = step
                    timer.saved()
            if stopping:
                interrupted = stop.agreed_name()
                say(
                    f"{interrupted}: saved checkpoint at step {step}; rerun the same command "
                    "to resume"
                )
                break
    finally:
        profile.close(state)
        batches.close()
        bar.close()
        stop.restore()
        log.close()
    return Outcome(step, state, last_eval, interrupted)


# ============================== 5. finish ==============================


def finish(
    exp: Experiment, outcome: Outcome, *, resumed_from: int | None, seconds: float
) -> RunResult:
    """Plots the curves and says the result, once the last step is taken."""
    done = outcome.step == exp.cfg.train.steps
    if exp.is_main and exp.cfg.train.plot and done:
        from train.plot import plot_run

        exp.say(f"plot: {plot_run(exp.run_dir)}")
    if outcome.eval is not None and done:
        key = "accuracy" if "accuracy" in outcome.eval else "loss"
        exp.say(
            f"done: {outcome.step} steps in {seconds:.1f}s | test {key} "
            f"{outcome.eval[key]:.4f} | run directory {exp.run_dir}"
        )
    return RunResult(
        step=outcome.step,
        state=outcome.state,
        eval=outcome.eval,
        interrupted=outcome.interrupted,
        run_dir=exp.run_dir,
        resumed_from=resumed_from,
        seconds=seconds,
    )


# --- helpers ------------------------------------------------------------------------------------


def _printer(out: Callable[[str], None] | None, is_main: bool) -> Callable[[str], None]:
    sink = out or (lambda s: print(s, flush=True))
    return sink if is_main else (lambda s: None)


def _progress_enabled(cfg: Config, is_main: bool) -> bool:
    if not is_main or cfg.train.progress == "off":
        return False
    return cfg.train.progress == "on" or sys.stderr.isatty()


def _short(metric: str) -> str:
    return {"accuracy": "acc"}.get(metric, metric)


def _clock() -> float:
    # checkpoint.every_minutes' clock (tests replace it).
    return time.monotonic()


def _since(t: float) -> float:
    return time.perf_counter() - t
