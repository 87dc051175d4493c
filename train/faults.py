"""Deterministic fault injection for the trainer's crash tests.

``REMAT_NN_FAULT=<point>@<step>[,<point>@<step> ...]`` makes the process fail at one named point of
the save of checkpoint ``<step>`` (or of its restore), the way a real crash would:

==============================  ============================================================
point                           what happens
==============================  ============================================================
before_save                     SIGKILL just before the save of ``step`` starts
during_async_write              SIGKILL in orbax's background thread while arrays are written
after_data_written              SIGKILL once every array is written to the temporary directory
before_finalize                 SIGKILL just before orbax renames the temporary directory
after_finalize_before_cleanup   SIGKILL after the rename, before the manifest is written
during_restore                  SIGKILL while restoring checkpoint ``step``
during_metrics_rewrite          SIGKILL halfway through rewriting metrics.jsonl on a resume
                                from ``step`` (trimming the lines logged after it)
enospc                          ``OSError(ENOSPC)`` from the background write of ``step``
nan                             the batch of step ``step`` is NaN, so its loss is NaN
sigterm                         the process sends itself SIGTERM once step ``step`` is taken
sigint                          the process sends itself SIGINT once step ``step`` is taken
==============================  ============================================================

The signal points make the signal tests deterministic: the signal arrives at a known step
boundary instead of whenever a parent process, racing a fast child, gets to send it.

Unset, every hook is a no-op. The variable is read once per process.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time

__all__ = ["ENV", "KILL_POINTS", "POINTS", "active", "enospc", "kill_if", "nan_steps", "signal_if"]

ENV = "REMAT_NN_FAULT"
#: Points where the process SIGKILLs itself, in the order a save then a restore reaches them.
KILL_POINTS = (
    "before_save",
    "during_async_write",
    "after_data_written",
    "before_finalize",
    "after_finalize_before_cleanup",
    "during_restore",
)
POINTS = (*KILL_POINTS, "during_metrics_rewrite", "enospc", "nan", "sigterm", "sigint")


@functools.cache
def _parsed() -> frozenset[tuple[str, int]]:
    spec = os.environ.get(ENV, "").strip()
    out = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, step = item.partition("@")
        if point not in POINTS or not step.isdigit():
            raise ValueError(
                f"{ENV}={spec!r}: {item!r} is not <point>@<step>. Fix: one of {', '.join(POINTS)} "
                "followed by @ and a step number, e.g. before_save@4."
            )
        out.add((point, int(step)))
    return frozenset(out)


def active(point: str, step: int) -> bool:
    """Whether ``REMAT_NN_FAULT`` names ``point`` at ``step``."""
    return (point, int(step)) in _parsed()


def kill_if(point: str, step: int) -> None:
    """SIGKILLs this process (no cleanup, no flush) if the fault is set."""
    if active(point, step):
        print(f"fault injection: SIGKILL at {point}@{step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def enospc(step: int) -> OSError:
    """The error a full disk gives, for the ``enospc`` fault."""
    return OSError(errno.ENOSPC, f"No space left on device (injected: enospc@{step})")


def nan_steps() -> set[int]:
    """Steps whose batch is replaced by NaNs (the ``nan`` fault)."""
    return {s for p, s in _parsed() if p == "nan"}


def signal_if(step: int) -> None:
    """Sends this process SIGTERM / SIGINT if ``sigterm@step`` / ``sigint@step`` is set."""
    for point, sig in (("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT)):
        if active(point, step):
            print(f"fault injection: {sig.name} at step {step}", flush=True)
            os.kill(os.getpid(), sig)
            if _is_multi_process():
                # Under jax.distributed the notice reaches the other processes asynchronously.
                # Pausing here, while they wait in the next collective step, lets it arrive, so
                # the step all processes agree to stop at is the next one: a repeatable test.
                time.sleep(2.0)


def _is_multi_process() -> bool:
    import jax

    return jax.process_count() > 1
