"""``python -m train --config configs/revnet.yaml [key.sub=value ...]``: train one configured run.

Rerunning the same command resumes from the run directory's latest complete checkpoint
(``--restart`` starts over). SIGTERM / SIGINT save a checkpoint and exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

__all__ = ["exit_process", "main"]

_EPILOG = """\
overrides:
  Any option below as key.sub=value (YAML values: 3, 1e-3, true, [a, b], {save: [x]}), e.g.
    python -m train --config configs/debug.yaml train.steps=50 optim.lr=3e-3 mesh.fsdp=2

exit codes: 0 done (or stopped by --stop-after, or already complete), 1 anything else (a bug or
  an environment failure: the traceback is printed), 2 invalid config or arguments, or a config
  that does not fit the data, devices or machine, 3 non-finite loss, or a reversible layer whose
  rebuilt input drifted (the message names the step), 4 checkpoint problem (none verifies, it
  does not fit the config, a save failed, or the config changed since the run started; never a
  silent start from step 0 in a run directory that held a checkpoint), 5 the run directory is
  locked by another process, 6 the storage failed while a checkpoint was read (nothing set
  aside: rerun when it is back), 128+N stopped by signal N after saving a checkpoint. With
  several processes, all exit with the same code.

fault injection (tests): REMAT_NN_FAULT=<point>@<step>, see train/faults.py.

multi-process: start one process per host with the same command. Under Slurm (srun) or Open
  MPI (mpirun) with several tasks the processes find each other; on a TPU pod or Kubernetes add
  --distributed-auto; elsewhere add --coordinator HOST:PORT --num-processes N --process-id I
  (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID in the environment).
  A SIGTERM to any process (a preemption) makes all of them save the same step and exit 143.

config options:
"""


def _parser() -> argparse.ArgumentParser:
    from train.config import describe_options

    p = argparse.ArgumentParser(
        prog="python -m train",
        description=__doc__,
        epilog=_EPILOG + describe_options(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML config file (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the model, print parameters, the remat plan's memory report and XLA's "
        "compiled memory of the train step, and exit without training",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="delete this run's checkpoints and metrics and start from step 0",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        metavar="N",
        help="take at most N steps in this invocation, checkpoint and exit",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume even though config keys that change the computation differ from the run "
        "directory's config.yaml (keys tagged [resume-safe] below may always change)",
    )
    p.add_argument(
        "--allow-dtype-cast",
        action="store_true",
        help="restore checkpoint leaves saved in another dtype by casting them",
    )
    p.add_argument(
        "--max-consecutive-skips",
        type=int,
        default=10,
        metavar="K",
        help="train.on_nonfinite=skip: halt after K non-finite steps in a row (default 10)",
    )
    p.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process: process 0's address")
    p.add_argument("--num-processes", type=int, metavar="N", help="multi-process: process count")
    p.add_argument("--process-id", type=int, metavar="I", help="multi-process: this process's id")
    p.add_argument(
        "--distributed-auto",
        action="store_true",
        help="multi-process: let jax.distributed.initialize() find the cluster (TPU pods, "
        "Kubernetes; Slurm and Open MPI launches of several tasks are detected without it)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    from train.config import ConfigError, load_config

    overrides = list(args.overrides)
    for flag, key in (
        (args.coordinator, "distributed.coordinator_address"),
        (args.num_processes, "distributed.num_processes"),
        (args.process_id, "distributed.process_id"),
    ):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: invalid config\n{e}", file=sys.stderr)
        return 2
    if args.stop_after is not None and args.stop_after < 1:
        print("error: --stop-after must be a positive number of steps", file=sys.stderr)
        return 2
    if args.max_consecutive_skips < 1:
        print(
            f"error: --max-consecutive-skips={args.max_consecutive_skips}: must be a positive "
            "number of steps (train.on_nonfinite=skip halts after that many bad steps in a row)",
            file=sys.stderr,
        )
        return 2

    # Before any JAX computation: multi-process setup.
    from train.errors import SetupError, TrainError
    from train.sharding import initialize_distributed

    try:
        initialize_distributed(cfg.distributed, auto=args.distributed_auto)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import remat_nn as rn
    from train.loop import run

    try:
        result = run(
            cfg,
            restart=args.restart,
            dry_run=args.dry_run,
            stop_after=args.stop_after,
            allow_config_change=args.allow_config_change,
            allow_dtype_cast=args.allow_dtype_cast,
            max_consecutive_skips=args.max_consecutive_skips,
        )
    except TrainError as e:
        # Only the errors that name a fix are reported without a traceback, with their exit
        # code; anything else is a bug or an environment failure and propagates (exit 1 with
        # its traceback).
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return e.exit_code
    except rn.PlanError as e:
        # A plan name the traced model never produces (a model.module's names are known only
        # when traced): the config's plan, or one the module itself names.
        written = cfg.remat_request.key == "remat"
        where = "remat" if written else f"model.module={cfg.model.module!r}"
        print(f"error: invalid config\n  {where}: {e}", file=sys.stderr)
        return 2
    if result.interrupted and result.step < cfg.train.steps:  # a signal at the last step: done
        import signal

        return 128 + int(signal.Signals[result.interrupted])
    return 0


def exit_process(code: int, *, grace_seconds: float = 5.0) -> None:
    """Exits the process with ``code``, promptly even when a failed save left threads behind.

    Orbax's save threads wait for a "directory created" signal that a save failing to create
    its directory (a read-only or full file system) never sends; interpreter shutdown would wait
    for them for orbax's coordination timeout. After an error (``code != 0``) threads still
    running after ``grace_seconds`` are abandoned: the output is flushed and the process ends.
    """
    if code:
        deadline = time.monotonic() + grace_seconds
        others = [t for t in threading.enumerate() if t is not threading.current_thread()]
        # Polled, not joined: orbax's threads override join() to raise their own errors.
        while any(t.is_alive() and not t.daemon for t in others):
            if time.monotonic() > deadline:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            time.sleep(0.05)
    raise SystemExit(code)


if __name__ == "__main__":
    exit_process(main())
