"""``train.profile: {start, steps}``: a ``jax.profiler`` trace of a window of train steps.

The trace goes to ``<run_dir>/profile/plugins/profile/<time>/``: ``<host>.xplane.pb`` for
TensorBoard's profile tab (``pip install tensorboard tensorboard-plugin-profile``, then
``tensorboard --logdir <run_dir>/profile``) and ``perfetto_trace.json.gz`` to open in the
Perfetto UI (ui.perfetto.dev, "Open trace file"). The window opens when ``start`` steps have been
taken in this invocation's range (a run resumed past ``start`` is not traced) and closes after
``steps`` more, once they have finished on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from train.config import Profile

__all__ = ["DIRNAME", "ProfileWindow"]

DIRNAME = "profile"


class ProfileWindow:
    """Starts and stops the trace around steps ``start + 1 .. start + steps``."""

    def __init__(self, spec: Profile | None, run_dir: Path, *, say: Callable[[str], None]):
        self.spec, self.directory, self.say = spec, run_dir / DIRNAME, say
        self.active = False

    def at(self, step: int, state: Any) -> None:
        """Called with the steps taken so far, before the next one is dispatched."""
        if self.spec is None:
            return
        if not self.active and step == self.spec.start:
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True
        elif self.active and step >= self.spec.start + self.spec.steps:
            self.close(state)

    def close(self, state: Any) -> None:
        """Stops the trace if it runs (after the loop, too: the window may end with the run)."""
        if not self.active:
            return
        with contextlib.suppress(RuntimeError):  # a state donated to a step that failed
            jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.active = False
        self.say(f"profile: trace written to {self.directory}")
