"""``checkpoint.every_minutes``: checkpoints by wall time, besides every ``checkpoint.every`` steps.

The interval counts from the loop's start and from each save. With several processes every
process must save the same step (a save is collective), so the decision is process 0's clock,
broadcast; it is taken at log steps only (``train.log_every``), where the processes sync anyway,
instead of a collective after every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax

from train import multihost

__all__ = ["SaveTimer"]


class SaveTimer:
    """Whether ``minutes`` have passed since the last save; ``minutes=None``: never.

    >>> now = iter([0.0, 30.0, 61.0])
    >>> timer = SaveTimer(1.0, clock=lambda: next(now))
    >>> timer.due(synced=True), timer.due(synced=True)
    (False, True)
    """

    def __init__(self, minutes: float | None, *, clock: Callable[[], float] = time.monotonic):
        self._seconds = None if minutes is None else 60.0 * minutes
        self._clock = clock
        self._last = clock() if self._seconds is not None else 0.0

    def due(self, *, synced: bool) -> bool:
        """Whether to save after this step; ``synced``: the processes sync at this step."""
        if self._seconds is None:
            return False
        multi = jax.process_count() > 1
        if multi and not synced:
            return False
        return multihost.process_0_decides(self._clock() - self._last >= self._seconds)

    def saved(self) -> None:
        """A checkpoint was just saved: the interval starts again."""
        if self._seconds is not None:
            self._last = self._clock()
