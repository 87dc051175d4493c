"""The train loop: ``run(cfg)`` trains, evaluates, checkpoints and logs one configured run.

Read top to bottom: setup, then the step loop with its checkpoint and log sections, then the
end of the run. The whole train state is donated to the step (``state, metrics =
train_step(state, batch)`` reuses the old state's buffers); the trainer proves it, from XLA's
alias bytes when compiling and from the deleted input buffers after the first step.

Before anything is written, the run directory is locked (a second trainer exits naming the
holder) and a config that changed since the checkpoints were written is refused with the diff.

Resume order (on start, unless ``restart``):
  1. find the newest *verified* checkpoint (orbax only renames a step directory into place when
     its save finished, and a step's manifest, written after that, must match its leaves' shapes,
     dtypes and checksums; a step that does not verify is moved aside, see train/checkpoint.py);
  2. restore the state onto this run's mesh shardings (any device count);
  3. re-materialise it on device, so the first step donates like every other (jax#18617);
  4. move the data iterator to the restored position, so batches continue exactly;
  5. drop lines of metrics.jsonl past the restored step (logged after that checkpoint).

The host syncs only at log, eval and checkpoint steps; in between, steps are dispatched
asynchronously and their metrics stay on device.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.experimental import multihost_utils
from tqdm import tqdm

import models
from train import autoplan, faults, integrity
from train import data as data_lib
from train import sharding as sharding_lib
from train import state as state_lib
from train.checkpoint import Checkpointer
from train.config import Config, dump_config
from train.integrity import CheckpointError, ConfigChangedError, RunLockedError
from train.state import TrainState

__all__ = [
    "CheckpointError", "ConfigChangedError", "NonFiniteError", "RunLockedError", "RunResult", "run",
]  # fmt: skip


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
      eval: the last evaluation (``loss``, ``accuracy``), if any.
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
      dry_run: build everything, print parameters and memory (remat plan residuals and XLA's
        compiled memory of the step), and return without training.
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
      state_lib.DonationError: the step did not donate the state.
    """
    kwargs = dict(restart=restart, dry_run=dry_run, stop_after=stop_after, out=out,
                  allow_config_change=allow_config_change, allow_dtype_cast=allow_dtype_cast,
                  max_consecutive_skips=max_consecutive_skips)  # fmt: skip
    if dry_run or jax.process_index() != 0:
        return _run(cfg, **kwargs)
    run_dir = cfg.resolved_run_dir.absolute()
    lock = integrity.RunLock(run_dir)  # held until the run returns
    try:
        if not restart:  # refused before anything is built
            _check_config_change(run_dir, cfg, allow=allow_config_change, say=_printer(out, True))
        return _run(cfg, **kwargs)
    finally:
        lock.release()


def _run(
    cfg: Config, *, restart: bool, dry_run: bool, stop_after: int | None,
    out: Callable[[str], None] | None, allow_config_change: bool, allow_dtype_cast: bool,
    max_consecutive_skips: int,
) -> RunResult:  # fmt: skip
    t_start = time.perf_counter()

    # ============================== setup ==============================
    is_main = jax.process_index() == 0
    if cfg.train.compile_cache and not jax.config.jax_compilation_cache_dir:
        jax.config.update(
            "jax_compilation_cache_dir", str(Path(cfg.train.compile_cache).absolute())
        )
    spec = models.get(cfg.model.name)
    dataset = data_lib.load(cfg.data, task=spec.task)
    options = _model_options(cfg, spec, dataset)
    model = models.build(cfg.model.name, **options)

    mesh = sharding_lib.make_mesh(cfg.mesh)
    global_bs = _global_batch_size(cfg, mesh.size)
    batch_sh = sharding_lib.batch_sharding(mesh)
    repl = sharding_lib.replicated(mesh)

    tx, schedule = state_lib.make_optimizer(cfg.optim, cfg.train.steps)
    example = dataset.example_batch(1)
    init = state_lib.make_init(
        model, tx, jax.ShapeDtypeStruct(example["x"].shape, example["x"].dtype), seed=cfg.train.seed
    )
    abstract = unsharded = jax.eval_shape(init)
    state_sh = sharding_lib.state_shardings(abstract, mesh, min_size=cfg.mesh.fsdp_min_size)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh
    )
    has_bn = bool(jax.tree.leaves(abstract.batch_stats))
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params))
    say = _printer(out, is_main)
    say(
        f"model {cfg.model.name}: {n_params:,} params | data {dataset.name}: "
        f"{dataset.num_examples('train')} train / {dataset.num_examples('test')} test examples | "
        f"mesh {dict(mesh.shape)} on {jax.process_count()} process(es), "
        f"{jax.devices()[0].platform} | global batch {global_bs} ({global_bs // mesh.size}/device)"
    )
    compute_dtype = jnp.dtype(cfg.train.compute_dtype)
    if autoplan.is_auto(cfg.remat):
        # `remat: {policy: auto, budget: ...}`: plan once, on one device's batch, and keep the
        # plan in the run directory so a resumed run compiles the same step.
        plan_file = cfg.resolved_run_dir.absolute() / autoplan.PLAN_FILE
        if restart and is_main and not dry_run:
            plan_file.unlink(missing_ok=True)
        the_plan = autoplan.load_or_plan(
            cfg.remat,
            run_dir=plan_file.parent,
            build=lambda p: models.build(cfg.model.name, **_with_plan(options, p)),
            abstract_state=unsharded,
            batch={
                k: jax.ShapeDtypeStruct((global_bs // mesh.size, *v.shape[1:]), v.dtype)
                for k, v in example.items()
            },  # fmt: skip
            compute_dtype=compute_dtype,
            has_batch_stats=has_bn,
            say=say,
            write=is_main and not dry_run,
        )
        options = _with_plan(options, the_plan)
        model = models.build(cfg.model.name, **options)  # same parameters, the chosen plan
    _check_offload(options, cfg.train.offload_on_cpu, say)
    step_fn = state_lib.make_train_step(
        model, tx, schedule, compute_dtype=compute_dtype, has_batch_stats=has_bn,
        skip_nonfinite=cfg.train.on_nonfinite == "skip",
    )  # fmt: skip
    batch_abstract = {
        k: jax.ShapeDtypeStruct((global_bs, *v.shape[1:]), v.dtype, sharding=batch_sh)
        for k, v in example.items()
    }
    jit_kwargs = dict(
        in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, repl), donate_argnums=0
    )
    # Compiled ahead of time, once: the same executable runs every step and is checked for
    # donation before the first one.
    train_step = jax.jit(step_fn, **jit_kwargs).lower(abstract, batch_abstract).compile()
    eval_step = jax.jit(
        state_lib.make_eval_step(model, compute_dtype=compute_dtype, has_batch_stats=has_bn),
        in_shardings=(state_sh, batch_sh, repl),
        out_shardings=repl,
        donate_argnums=2,
    )
    alias_bytes = None
    if cfg.train.verify_donation:
        alias_bytes = state_lib.verify_donation(train_step, abstract)

    if alias_bytes is not None:
        say(f"donation: XLA aliases {_fmt_bytes(alias_bytes)} per device (the whole train state)")

    if dry_run:
        _dry_run_report(say, cfg, step_fn, jit_kwargs, init, state_sh, abstract, dataset,
                        global_bs, batch_sh, compute_dtype, has_bn, model)  # fmt: skip
        return RunResult(0, None, run_dir=cfg.resolved_run_dir, seconds=_since(t_start))

    run_dir = cfg.resolved_run_dir.absolute()
    metrics_path = run_dir / "metrics.jsonl"
    if is_main:
        if restart and run_dir.exists():
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            metrics_path.unlink(missing_ok=True)
            (run_dir / "plot.png").unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    _sync("run_dir")
    ckpt = Checkpointer(
        run_dir / "checkpoints", cfg.checkpoint,
        config_hash=integrity.config_hash(cfg.model_dump(mode="json")),
        warn=lambda s: print(s, file=sys.stderr, flush=True),
    )  # fmt: skip
    if ckpt.removed_tmp:
        say(f"removed unfinished saves of a killed run: {', '.join(ckpt.removed_tmp)}")

    # Resume (the order is in the module docstring).
    start, resumed_from, position, latest = 0, None, 0, None
    found = ckpt.restore_latest(abstract, allow_dtype_cast=allow_dtype_cast)  # 1, 2
    if found is not None:
        restored, meta, latest = found
        state = state_lib.copy_state(restored, state_sh)  # 3: fresh buffers, donatable
        del restored
        start = resumed_from = int(meta["step"])
        position = int(meta["data_position"])  # 4
        if is_main:
            _truncate_metrics(metrics_path, start)  # 5
        say(f"resumed from {ckpt.directory / str(latest)} (step {start})")
    else:
        state = jax.jit(init, out_shardings=state_sh)()
    # One buffer at two leaves would be donated twice; say which leaves, before the first step.
    state_lib.check_distinct_buffers(state)
    if start >= cfg.train.steps:
        ckpt.close()
        say(f"run already complete: step {start}/{cfg.train.steps} in {run_dir}; nothing to do "
            "(raise train.steps to continue, or --restart to train again)")  # fmt: skip
        return RunResult(start, state, run_dir=run_dir, resumed_from=start, seconds=_since(t_start))
    nan_steps = faults.nan_steps()  # fault injection: these steps get a NaN batch
    if nan_steps and not jnp.issubdtype(example["x"].dtype, jnp.floating):
        raise ValueError(f"{faults.ENV}: nan@<step> needs float inputs; {dataset.name} has ints")
    batches = data_lib.Batches(
        dataset, global_batch=global_bs, seed=cfg.train.seed, position=position,
        process_index=jax.process_index(), process_count=jax.process_count(),
    )  # fmt: skip
    metrics_file = open(metrics_path, "a") if is_main else None  # closed in the finally below

    def evaluate(state: TrainState) -> dict[str, float]:
        sums = jax.device_put(state_lib.eval_zeros(), repl)
        for local in data_lib.eval_batches(
            dataset, global_batch=global_bs, max_batches=cfg.train.eval_batches,
            process_index=jax.process_index(), process_count=jax.process_count(),
        ):  # fmt: skip
            sums = eval_step(state, sharding_lib.global_batch(local, batch_sh), sums)
        s = jax.device_get(sums)
        count = max(float(s["count"]), 1.0)
        return {"loss": float(s["loss_sum"]) / count, "accuracy": float(s["correct"]) / count}

    def record(kind: str, step: int, values: dict[str, Any]) -> None:
        if metrics_file is not None:
            metrics_file.write(json.dumps({"split": kind, "step": step, **values}) + "\n")
            metrics_file.flush()

    # A signal only sets a flag; the loop saves at the next step boundary and stops.
    stop_signal: list[int] = []
    restore_handlers = _install_signal_handlers(stop_signal)

    total = cfg.train.steps
    end = total if stop_after is None else min(total, start + stop_after)
    bar = tqdm(
        total=total, initial=start, disable=not _progress_enabled(cfg, is_main),
        dynamic_ncols=True, unit="step",
    )  # fmt: skip
    if not bar.disable:
        say = _printer(out or tqdm.write, is_main)
    pending: list[dict[str, jax.Array]] = []  # device metrics since the last drain
    window: list[dict[str, float]] = []  # host metrics since the last log line
    skipped = consecutive_skips = 0
    last_lr = [float("nan")]  # lr of the latest drained step
    last_eval: dict[str, float] | None = None
    last_eval_step = -1
    last_ckpt = latest
    t_log, step_log = time.perf_counter(), start

    def drain(step: int) -> None:
        # The only host sync of the loop: fetch pending step metrics, check they are finite.
        nonlocal skipped, consecutive_skips
        host = jax.device_get(pending)
        pending.clear()
        if host:
            last_lr[0] = float(host[-1]["lr"])
        for i, m in enumerate(host):
            if not bool(m["finite"]):
                bad = step - len(host) + i + 1
                if cfg.train.on_nonfinite == "halt":
                    raise NonFiniteError(
                        f"loss or gradient is not finite at step {bad} (loss={float(m['loss'])}, "
                        f"grad_norm={float(m['grad_norm'])}). Halted without saving; the last "
                        f"good checkpoint is step {last_ckpt} in {ckpt.directory}. Fix: lower "
                        "optim.lr, set optim.clip_norm, or train.on_nonfinite=skip."
                    )
                skipped += 1
                consecutive_skips += 1
                if consecutive_skips >= max_consecutive_skips:
                    raise NonFiniteError(
                        f"loss or gradient is not finite at step {bad}: {consecutive_skips} "
                        f"consecutive steps skipped (train.on_nonfinite=skip). Halted; the last "
                        f"good checkpoint is step {last_ckpt} in {ckpt.directory}. Fix: lower "
                        "optim.lr or set optim.clip_norm."
                    )
                continue
            consecutive_skips = 0
            window.append({k: float(v) for k, v in m.items()})

    step = start
    try:
        while step < end and not stop_signal:
            # ============================== step ==============================
            batch = sharding_lib.global_batch(next(batches), batch_sh)
            if step + 1 in nan_steps:
                batch = {**batch, "x": batch["x"] * jnp.nan}
            first = step == start and cfg.train.verify_donation
            donated = jax.tree_util.tree_leaves_with_path(state) if first else None
            state, metrics = train_step(state, batch)  # donates `state`: its buffers are reused
            del batch
            if donated is not None:
                state_lib.verify_donated_inputs_deleted(donated)
                del donated
            step += 1
            pending.append(metrics)
            bar.update(1)
            is_log = step % cfg.train.log_every == 0 or step == end
            is_eval = step == total or (cfg.train.eval_every and step % cfg.train.eval_every == 0)
            is_ckpt = step % cfg.checkpoint.every == 0 or step == end
            if is_log or is_eval or is_ckpt:
                drain(step)

            # ============================== log ==============================
            if is_log:
                now = time.perf_counter()
                rate = (step - step_log) / max(now - t_log, 1e-9)
                line = {
                    "loss": _mean(window, "loss"),
                    "accuracy": _mean(window, "accuracy"),
                    "grad_norm": _mean(window, "grad_norm"),
                    "lr": last_lr[0],
                    "steps_per_sec": rate,
                    "examples_per_sec": rate * global_bs,
                    "epoch": batches.epoch,
                    "skipped": skipped,
                }
                window.clear()
                t_log, step_log = now, step
                record("train", step, line)
                say(
                    f"step {step:>6}/{total} | loss {line['loss']:.4f} | acc "
                    f"{line['accuracy']:.3f} | lr {line['lr']:.3g} | {rate:.2f} steps/s | "
                    f"{rate * global_bs:.0f} ex/s" + (f" | skipped {skipped}" if skipped else "")
                )
                bar.set_postfix(loss=f"{line['loss']:.3f}", acc=f"{line['accuracy']:.3f}")
            if is_eval:
                last_eval, last_eval_step = evaluate(state), step
                record("eval", step, last_eval)
                say(
                    f"eval @ {step}: loss {last_eval['loss']:.4f} | accuracy "
                    f"{last_eval['accuracy']:.4f}"
                )
                t_log = time.perf_counter()  # eval time does not count against steps/s

            # ============================== checkpoint ==============================
            if is_ckpt:
                # Steps up to here were checked finite by drain(); the eval (if this step had
                # one) ranks the checkpoint for keep_best.
                ranked = None
                if last_eval is not None and last_eval_step == step:
                    ranked = {f"eval_{k}": v for k, v in last_eval.items()}
                if ckpt.save(step, state, data_position=batches.position, metrics=ranked,
                             force=step == end):  # fmt: skip
                    last_ckpt = step

        if stop_signal:
            drain(step)
            if ckpt.save(step, state, data_position=batches.position, force=True):
                last_ckpt = step
            name = signal.Signals(stop_signal[0]).name
            say(f"{name}: saved checkpoint at step {step}; rerun the same command to resume")
    finally:
        bar.close()
        restore_handlers()
        try:
            ckpt.wait()  # raises if the last save failed (e.g. disk full)
        finally:
            ckpt.close()
            if metrics_file is not None:
                metrics_file.close()

    # ============================== end ==============================
    if is_main and cfg.train.plot and step == total:
        from train.plot import plot_run

        say(f"plot: {plot_run(run_dir)}")
    seconds = _since(t_start)
    if last_eval is not None and step == total:
        say(
            f"done: {step} steps in {seconds:.1f}s | test accuracy {last_eval['accuracy']:.4f} | "
            f"run directory {run_dir}"
        )
    return RunResult(
        step=step,
        state=state,
        eval=last_eval,
        interrupted=signal.Signals(stop_signal[0]).name if stop_signal else None,
        run_dir=run_dir,
        resumed_from=resumed_from,
        seconds=seconds,
    )


# --- helpers ------------------------------------------------------------------------------------


def _model_options(cfg: Config, spec: Any, dataset: data_lib.Dataset) -> dict[str, Any]:
    # Options the data decides (classes, vocabulary, image size and channels) are filled in when
    # the model has them and the config does not set them; a set value must agree with the data.
    opts = cfg.model_options()
    fields = spec.options.model_fields
    from_data: dict[str, int | None] = {"num_classes": dataset.num_classes,
                                        "vocab_size": dataset.vocab_size}  # fmt: skip
    if dataset.task == "classify":
        from_data["image_size"] = dataset.train_x.shape[1]
        from_data["in_channels"] = dataset.train_x.shape[3]
    for key, value in from_data.items():
        if value is None or key not in fields:
            continue
        too_small = key in ("num_classes", "vocab_size") and opts.get(key, value) < value
        differs = key in ("image_size", "in_channels") and opts.get(key, value) != value
        if too_small or differs:
            raise ValueError(
                f"model.options.{key}={opts[key]} does not fit the data ({dataset.name}: {value}). "
                f"Fix: drop model.options.{key} (it is filled from the data)."
            )
        opts.setdefault(key, value)
    return opts


def _check_offload(options: dict[str, Any], mode: str, say: Callable[[str], None]) -> None:
    # Host offload lowers and runs on CPU but moves nothing there (XLA:CPU has one memory).
    remat = options.get("remat")
    if not isinstance(remat, str) or jax.default_backend() != "cpu":
        return
    from models.transformer import remat_plan

    plan = remat_plan(remat, options.get("custom_plan"))
    if plan is None or not plan.offload:
        return
    msg = (
        f"remat plan offloads {list(plan.offload)} to {plan.offload_dst}, but the cpu backend "
        "has a single memory: the program runs with the same gradients and nothing moves, so "
        "expect no memory saving here (set train.offload_on_cpu=error to refuse)"
    )
    if mode == "error":
        raise ValueError(f"{msg.split(' (set')[0]}. Fix: run on GPU/TPU, or save those names.")
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    say(f"warning: {msg}")


def _with_plan(options: dict[str, Any], plan: Any) -> dict[str, Any]:
    # A planner candidate (an rn.Plan, or "none" for no remat) as the model's remat options.
    if isinstance(plan, str):
        return {**options, "remat": plan, "custom_plan": None}
    return {**options, "remat": "custom", "custom_plan": plan.to_dict()}


def _global_batch_size(cfg: Config, num_devices: int) -> int:
    if cfg.data.batch_size_per_device is not None:
        return cfg.data.batch_size_per_device * num_devices
    bs = cfg.data.batch_size or 0
    if bs % num_devices:
        raise ValueError(
            f"data.batch_size={bs} does not split over the mesh's {num_devices} devices. Fix: a "
            f"multiple of {num_devices}, or set data.batch_size_per_device."
        )
    return bs


def _printer(out: Callable[[str], None] | None, is_main: bool) -> Callable[[str], None]:
    sink = out or (lambda s: print(s, flush=True))
    return sink if is_main else (lambda s: None)


def _progress_enabled(cfg: Config, is_main: bool) -> bool:
    if not is_main or cfg.train.progress == "off":
        return False
    return cfg.train.progress == "on" or sys.stderr.isatty()


def _install_signal_handlers(flag: list[int]) -> Callable[[], None]:
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}

    def handler(signum: int, frame: Any) -> None:
        flag.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    return restore


def _check_config_change(
    run_dir: Path, cfg: Config, *, allow: bool, say: Callable[[str], None]
) -> None:
    # Only checkpoints make a changed config matter: without them the run starts afresh.
    ckpts = run_dir / "checkpoints"
    if not (run_dir / "config.yaml").exists() or not ckpts.is_dir():
        return
    if not any(p.name.isdigit() for p in ckpts.iterdir()):
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


def _truncate_metrics(path: Path, step: int) -> None:
    if not path.exists():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    path.write_text("".join(line + "\n" for line in keep))


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _mean(rows: list[dict[str, float]], key: str) -> float:
    # Mean over the finite steps of the window; NaN if every step was skipped.
    return float(np.mean([r[key] for r in rows])) if rows else float("nan")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _since(t: float) -> float:
    return time.perf_counter() - t


def _dry_run_report(
    say, cfg, step_fn, jit_kwargs, init, state_sh, abstract, dataset, global_bs, batch_sh,
    compute_dtype, has_bn, model,
) -> None:  # fmt: skip
    import remat_nn as rn

    state = jax.jit(init, out_shardings=state_sh)()
    say("parameters:")
    for path, x in _param_groups(state.params):
        say(f"  {path:<40} {x:>12,}")
    say(f"  {'total':<40} {sum(math.prod(p.shape) for p in jax.tree.leaves(state.params)):>12,}")
    local = dataset.examples(np.arange(global_bs) % dataset.num_examples("train"))
    batch = sharding_lib.global_batch(local, batch_sh)
    loss_fn = state_lib.make_loss_fn(model, compute_dtype=compute_dtype, has_batch_stats=has_bn)
    key = jax.random.key(0)

    def loss_of_params(params):
        return loss_fn(params, state.batch_stats, batch, key)[0]

    plan = cfg.remat if cfg.remat is not None else cfg.model.options.get("remat")
    say(f"remat plan: {plan if plan is not None else '(the model default)'}")
    say("memory report (residuals saved for the backward pass):")
    say(str(rn.memory_report(loss_of_params, state.params)))
    say("XLA compiled memory of the train step (per device, state donated):")
    say(str(rn.compiled_memory(step_fn, abstract, _abstract(batch), jit_kwargs=jit_kwargs)))


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _param_groups(params: Any) -> Iterator[tuple[str, int]]:
    # Parameter counts per top-level module.
    if isinstance(params, dict):
        for k, v in params.items():
            yield str(k), sum(math.prod(x.shape) for x in jax.tree.leaves(v))
