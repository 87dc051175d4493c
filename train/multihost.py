"""What every process of a multi-process run must agree on: start-up verdicts and when to stop.

A collective (a checkpoint save, a gradient all-reduce) hangs until every process joins it, so a
decision one process takes alone (a failed check, a signal) must become every process's decision
at the same step. On a single process each function here is the plain local decision.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from train.errors import (
    CheckpointError,
    CheckpointUnavailableError,
    ConfigChangedError,
    RunLockedError,
    SetupError,
)

__all__ = [
    "StopSignals",
    "check_same_config",
    "is_main",
    "process_0_decides",
    "share_verdict",
    "sync",
    "worst_verdict",
]

# Start-up failures every process re-raises as the same class (any other: RuntimeError); a
# subclass before its base.
_SHARED_ERRORS: tuple[type[Exception], ...] = (
    RunLockedError,
    ConfigChangedError,
    CheckpointUnavailableError,
    CheckpointError,
    SetupError,
)
_MESSAGE_BYTES = 16384


def is_main() -> bool:
    """Whether this is process 0: the one that writes the run directory and reports."""
    return jax.process_index() == 0


def process_0_decides(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a broadcast); ``flag`` itself on one process."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def share_verdict(failure: BaseException | None, *, what: str) -> None:
    """Makes process 0's decision every process's: all raise the same error, or none does.

    Process 0 broadcasts whether (and how) its check failed; the others raise the same error
    class with process 0's message. On a single process it re-raises ``failure``.
    """
    if jax.process_count() == 1 or is_main():
        code, text = _encode_failure(failure)
    else:
        code, text = 0, ""
    if jax.process_count() > 1:
        payload = np.zeros(_MESSAGE_BYTES + 1, np.int32)
        raw = text.encode()[:_MESSAGE_BYTES]
        payload[0] = code
        payload[1 : 1 + len(raw)] = np.frombuffer(raw, np.uint8)
        payload = np.asarray(multihost_utils.broadcast_one_to_all(payload))
        code = int(payload[0])
        text = bytes(payload[1:].astype(np.uint8)).rstrip(b"\0").decode(errors="replace")
    if failure is not None:
        raise failure
    if code:
        kind = _SHARED_ERRORS[code - 1] if code <= len(_SHARED_ERRORS) else RuntimeError
        raise kind(f"process 0 failed at {what}: {text}")


def check_same_config(config_hash: str) -> None:
    """Raises SetupError on every process unless all were launched with the same config.

    Compares :func:`train.run_dir.config_hash` (the keys that change the computation) of every
    process: one all-gather of 64 bytes. A no-op on a single process.
    """
    if jax.process_count() == 1:
        return
    mine = np.frombuffer(config_hash.encode().ljust(64)[:64], np.uint8)
    hashes = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), 64)
    differ = [i for i, h in enumerate(hashes) if not np.array_equal(h, hashes[0])]
    if differ:
        raise SetupError(
            f"processes {differ} were launched with another config than process 0 (config hash "
            f"{bytes(hashes[differ[0]]).decode()[:12]} vs {bytes(hashes[0]).decode()[:12]}): "
            "they would train different models in one run. Fix: start every process with the "
            "same --config and overrides (only distributed.* may differ)."
        )


def _encode_failure(failure: BaseException | None) -> tuple[int, str]:
    if failure is None:
        return 0, ""
    for i, kind in enumerate(_SHARED_ERRORS):
        if isinstance(failure, kind):
            return i + 1, str(failure)
    return len(_SHARED_ERRORS) + 1, f"{type(failure).__name__}: {failure}"


class StopSignals:
    """SIGTERM / SIGINT ask the loop to checkpoint and stop at a step every process agrees on.

    One process: a handler records the signal; the loop stops after the step in flight.
    Several processes: a signal reaches one process, but the save is collective, so all must
    stop at the same step. JAX's preemption service (started by ``jax.distributed``) catches
    SIGTERM on any process and agrees the step
    (``multihost_utils.reached_preemption_sync_point``, asked at every step, as MaxText does);
    SIGINT is forwarded to it as this process's SIGTERM. The signal reported (and so the exit
    code) is agreed too: the largest signal number any process recorded, SIGTERM by default.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._multi = jax.process_count() > 1
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            # Under jax.distributed, SIGTERM belongs to JAX's preemption notifier.
            mine = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
            for sig in mine:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum
        if self._multi:
            os.kill(os.getpid(), signal.SIGTERM)

    def stop_at(self, step: int) -> bool:
        """Whether to checkpoint and stop after ``step`` steps (the same on every process)."""
        if self._multi:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.received is not None

    def agreed_name(self) -> str:
        """The signal that stopped the run, the same on every process."""
        signum = self.received or 0
        if self._multi:
            signum = int(np.max(multihost_utils.process_allgather(np.int32(signum))))
        return signal.Signals(signum or signal.SIGTERM).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def sync(name: str) -> None:
    """A barrier: every process waits here until all have arrived."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def worst_verdict(code: int) -> tuple[int, int | None]:
    """The largest of every process's ``code`` and the first process that found it.

    One small all-gather, so every process takes the same decision (e.g. on a checkpoint step);
    the process is None when the worst is this process's own code.
    """
    if jax.process_count() == 1:
        return code, None
    codes = np.asarray(multihost_utils.process_allgather(np.int32(code))).reshape(-1)
    worst = int(codes.max())
    if worst == code:
        return code, None
    return worst, int(np.argmax(codes))
