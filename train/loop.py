"""The train loop: ``run(cfg)`` trains, evaluates, checkpoints and logs one configured run.

A run takes five named steps, read in :func:`run` top to bottom:

1. :func:`train.run_dir.start` — lock the run directory (a second trainer exits naming the
   holder) and refuse a config that changed since the checkpoints were written (with the diff).
   Process 0 decides and every process learns the verdict, so on failure all processes exit at
   once with the same error instead of waiting for the coordinator's timeout.
2. :func:`train.experiment.build_experiment` — data, model, mesh, optimizer, and the train step
   compiled ahead of time with the whole :class:`TrainState` donated (proved from XLA's alias
   bytes). With ``restart`` it compiles before the old run is deleted; otherwise after step 3,
   only if steps are left (:func:`train.experiment.compiled`), so a finished run compiles nothing.
3. :func:`train.resume.restore_or_init` — resume from the newest verified checkpoint (unless
   ``restart``), in the order its docstring gives.
4. :func:`train_loop` — step, log, eval and checkpoint sections. The host syncs only at log,
   eval and checkpoint steps; in between, steps are dispatched asynchronously and their metrics
   stay on device. SIGTERM / SIGINT stop the loop at a step boundary every process agrees on
   (:class:`train.multihost.StopSignals`), where it checkpoints.
5. :func:`finish` — the plot and the summary line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from train import data as data_lib
from train import donation, faults, multihost, run_dir
from train import sharding as sharding_lib
from train import state as state_lib
from train.checkpoint import Checkpointer
from train.config import Config
from train.dry_run import dry_run_report
from train.errors import (
    CheckpointError,
    ConfigChangedError,
    DriftError,
    NonFiniteError,
    RunLockedError,
    SetupError,
)
from train.experiment import Experiment, build_experiment, compiled
from train.metrics_file import MetricsLog
from train.profile import ProfileWindow
from train.resume import Resume, already_complete, restore_or_init, warn_if_schedule_spent
from train.save_timer import SaveTimer
from train.state import TrainState

# With the errors run() raises (defined in train.errors), for its callers.
__all__ = [
    "CheckpointError",
    "ConfigChangedError",
    "NonFiniteError",
    "RunLockedError",
    "RunResult",
    "SetupError",
    "evaluate",
    "finish",
    "restore_or_init",
    "run",
    "train_loop",
]


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
      DriftError: a reversible layer's rebuilt input drifted with ``drift_fallback: error``.
      CheckpointError: no checkpoint verifies, one does not fit the config, or a save failed.
      ConfigChangedError: the config changed since the checkpoints were written.
      RunLockedError: another process trains into the same run directory.
      SetupError: the config does not fit the data, the devices or the machine.
      DonationError: the step did not donate the state.
    """
    t_start = time.perf_counter()
    say = _printer(out, multihost.is_main())
    if dry_run:
        exp = compiled(build_experiment(cfg, say=say, out=out, restart=False, dry_run=True))
        dry_run_report(exp)
        return RunResult(0, None, run_dir=exp.run_dir, seconds=_since(t_start))

    lock = run_dir.start(cfg, restart=restart, allow_config_change=allow_config_change, say=say)
    try:
        exp = build_experiment(cfg, say=say, out=out, restart=restart, dry_run=False)
        # A restart compiles the step before the old run's checkpoints are deleted; a resumed
        # run once it knows steps are left (below).
        if restart:
            exp = compiled(exp)
        run_dir.prepare(exp.run_dir, restart=restart)
        ckpt = Checkpointer(
            exp.run_dir / "checkpoints",
            cfg.checkpoint,
            config_hash=run_dir.config_hash(cfg.model_dump(mode="json")),
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
            if resume.step >= cfg.train.steps:
                run_dir.record_config(exp.run_dir, cfg)
                say(already_complete(cfg, resume.step, exp.run_dir))
                return RunResult(
                    resume.step,
                    state,
                    run_dir=exp.run_dir,
                    resumed_from=resume.step,
                    seconds=_since(t_start),
                )
            exp = compiled(exp)  # a config the step refuses stops here: nothing recorded
            run_dir.record_config(exp.run_dir, cfg)
            warn_if_schedule_spent(exp, resume.step)
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


# ============================== 3. restore ==============================


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
        self.recomputed = 0  # reversible layers recomputed by drift_fallback=recompute (total)
        self.lr = float("nan")  # lr of the latest drained step

    def drain(self, step: int, *, last_good: str) -> None:
        """Fetches pending metrics (the loop's only host sync) and checks they are finite.

        Raises:
          NonFiniteError: a non-finite step with ``halt``, or too many skipped in a row.
          DriftError: a step whose reversible layers failed their drift check.
        """
        host = jax.device_get(self.pending)
        self.pending.clear()
        if host:
            self.lr = float(host[-1]["lr"])
        for i, m in enumerate(host):
            _refuse_drifted(m, step - len(host) + i + 1, last_good)
            self.recomputed += int(m.get("drift_recomputed", 0))
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


def _refuse_drifted(metrics: dict[str, np.ndarray], step: int, last_good: str) -> None:
    """Raises :class:`DriftError` if step ``step``'s reversible layers failed their drift check
    (``drift_failed``: how many checks did, see :func:`remat_nn.report_drift_to`)."""
    failed = int(metrics.get("drift_failed", 0))
    if failed:
        raise DriftError(
            f"step {step}: {failed} drift check(s) failed: a layer input a reversible stack's "
            "backward pass rebuilt drifted past its tolerance (drift_rtol), so the gradient "
            f"would be wrong. Halted without saving; the last good checkpoint is {last_good}. Fix: "
            "model.options.drift_fallback=recompute (recompute a drifted layer's input from the "
            "nearest kept value), anchors or normalized branches (model.options), or "
            "model.options.reversible=false where the model has it."
        )


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

    Each step: the donated train step, then (when due) the log, eval and checkpoint sections.
    ``state`` is donated to the first step: do not use it after the call.
    """
    total = exp.cfg.train.steps
    end = total if stop_after is None else min(total, resume.step + stop_after)
    nan_steps = _nan_steps(exp)
    session = _Session(exp, resume, end=end, max_consecutive_skips=max_consecutive_skips)
    step, last_ckpt = resume.step, resume.checkpoint
    last_eval: dict[str, float] | None = None
    interrupted: str | None = None
    try:
        while step < end:
            verify = step == resume.step and exp.cfg.train.verify_donation
            state = session.step(state, step, nan=step + 1 in nan_steps, verify_donation=verify)
            step += 1
            due = session.due(step)
            if due.log or due.eval or due.ckpt:
                where = f"step {last_ckpt} in {ckpt.directory}" if last_ckpt is not None else "none"
                session.metrics.drain(step, last_good=where)
            if due.log:
                session.log_train(step)
            if due.eval:
                last_eval = session.evaluate(step, state)
            if due.ckpt and session.save(
                ckpt, step, state, evaluation=last_eval if due.eval else None, due=due
            ):
                last_ckpt = step
            if due.stopping:
                interrupted = session.stopped(step)
                break
    finally:
        session.close(state)
    return Outcome(step, state, last_eval, interrupted)


def _nan_steps(exp: Experiment) -> set[int]:
    # Fault injection: these steps get a NaN batch.
    nan_steps = faults.nan_steps()
    if nan_steps and not jnp.issubdtype(exp.dataset.example_batch(1)["x"].dtype, jnp.floating):
        raise SetupError(
            f"{faults.ENV}: nan@<step> needs float inputs; {exp.dataset.name} has ints"
        )
    return nan_steps


@dataclass(frozen=True)
class _Due:
    """What follows a step: a log line, an eval, a checkpoint; and why it is saved."""

    log: bool
    eval: bool
    ckpt: bool
    stopping: bool  # a signal: checkpoint and stop
    force: bool  # save whatever checkpoint.every says (the last step, a signal, the timer)


class _Session:
    """What :func:`train_loop` opens for its steps: the batches, metrics, log file, signal
    handlers, save timer, profiler and progress bar; :meth:`close` closes them."""

    def __init__(self, exp: Experiment, resume: Resume, *, end: int, max_consecutive_skips: int):
        cfg = exp.cfg
        self.exp, self.end = exp, end
        self.batches = data_lib.Batches(
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
        self.metrics = _StepMetrics(
            halt=cfg.train.on_nonfinite == "halt", max_consecutive_skips=max_consecutive_skips
        )
        self.log = MetricsLog(exp.run_dir, enabled=exp.is_main, tensorboard=cfg.train.tensorboard)
        self.stop = multihost.StopSignals()
        self.timer = SaveTimer(cfg.checkpoint.every_minutes, clock=_clock)
        self.profile = ProfileWindow(cfg.train.profile, exp.run_dir, say=exp.say)
        self.bar = tqdm(
            total=cfg.train.steps,
            initial=resume.step,
            disable=not _progress_enabled(cfg, exp.is_main),
            dynamic_ncols=True,
            unit="step",
        )
        self.say = exp.say if self.bar.disable else _printer(exp.out or tqdm.write, exp.is_main)
        self.t_log, self.step_log = time.perf_counter(), resume.step

    def step(self, state: TrainState, step: int, *, nan: bool, verify_donation: bool) -> TrainState:
        """Takes step ``step + 1``; its metrics stay on device until the next drain."""
        self.profile.at(step, state)
        batch = sharding_lib.global_batch(next(self.batches), self.exp.batch_sharding)
        if nan:
            batch = {**batch, "x": batch["x"] * jnp.nan}
        donated = jax.tree_util.tree_leaves_with_path(state) if verify_donation else None
        state, step_metrics = self.exp.train_step(state, batch)  # donates `state`
        del batch
        if donated is not None:
            donation.verify_donated_inputs_deleted(donated)
            del donated
        self.metrics.pending.append(step_metrics)
        self.bar.update(1)
        faults.signal_if(step + 1)
        return state

    def due(self, step: int) -> _Due:
        """What follows step ``step``; asks every process whether a signal stops the run here."""
        cfg = self.exp.cfg
        stopping = self.stop.stop_at(step)
        is_log = step % cfg.train.log_every == 0 or step == self.end or stopping
        every_eval = cfg.train.eval_every
        is_eval = step == cfg.train.steps or bool(every_eval and step % every_eval == 0)
        timed = self.timer.due(synced=is_log)
        last = step == self.end or stopping
        is_ckpt = step % cfg.checkpoint.every == 0 or last or timed
        return _Due(log=is_log, eval=is_eval, ckpt=is_ckpt, stopping=stopping, force=last or timed)

    def log_train(self, step: int) -> None:
        """The train line: means over the window's finite steps, and the throughput."""
        exp, metrics = self.exp, self.metrics
        now = time.perf_counter()
        rate = (step - self.step_log) / max(now - self.t_log, 1e-9)
        line = {
            "loss": metrics.mean("loss"),
            **{k: metrics.mean(k) for k in exp.metric_names},
            "grad_norm": metrics.mean("grad_norm"),
            "lr": metrics.lr,
            "steps_per_sec": rate,
            "examples_per_sec": rate * exp.global_batch,
            "epoch": self.batches.epoch,
            "skipped": metrics.skipped,
            **({"drift_recomputed": metrics.recomputed} if metrics.recomputed else {}),
        }
        metrics.window.clear()
        self.t_log, self.step_log = now, step
        self.log.record("train", step, line)
        self.say(
            f"step {step:>6}/{exp.cfg.train.steps} | loss {line['loss']:.4f} | "
            + "".join(f"{_short(k)} {line[k]:.3f} | " for k in exp.metric_names)
            + f"lr {line['lr']:.3g} | {rate:.2f} steps/s | "
            f"{rate * exp.global_batch:.0f} ex/s"
            + (f" | skipped {metrics.skipped}" if metrics.skipped else "")
            + (f" | recomputed {metrics.recomputed} layers" if metrics.recomputed else "")
        )
        self.bar.set_postfix(
            loss=f"{line['loss']:.3f}",
            **{_short(k): f"{line[k]:.3f}" for k in exp.metric_names},
        )

    def evaluate(self, step: int, state: TrainState) -> dict[str, float]:
        result = evaluate(self.exp, state)
        self.log.record("eval", step, result)
        self.say(f"eval @ {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in result.items()))
        self.t_log = time.perf_counter()  # eval time does not count against steps/s
        return result

    def save(
        self,
        ckpt: Checkpointer,
        step: int,
        state: TrainState,
        *,
        evaluation: dict[str, float] | None,
        due: _Due,
    ) -> bool:
        """Saves step ``step`` (its steps were checked finite by the drain); True if it did.

        This step's eval (if it had one) ranks the checkpoint for keep_best.
        """
        ranked = None if evaluation is None else {f"eval_{k}": v for k, v in evaluation.items()}
        saved = ckpt.save(
            step,
            state,
            data_state=self.batches.get_state(),
            metrics=ranked,
            force=due.force,
        )
        if saved:
            self.timer.saved()
        return saved

    def stopped(self, step: int) -> str:
        """The signal that stopped the run (agreed by every process), once it is saved."""
        name = self.stop.agreed_name()
        self.say(f"{name}: saved checkpoint at step {step}; rerun the same command to resume")
        return name

    def close(self, state: TrainState) -> None:
        self.profile.close(state)
        self.batches.close()
        self.bar.close()
        self.stop.restore()
        self.log.close()


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
