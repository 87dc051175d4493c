"""The orbax handlers :class:`train.checkpoint.Checkpointer` saves with: orbax's PyTree handler
with the fault-injection points of its asynchronous save (:mod:`train.faults`, for the
reliability tests), and the registry of the two items of a step directory, ``state`` and
``meta``, with how arrays are written (replica-parallel only with several processes).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from train import faults

__all__ = ["handler_registry"]


class _FaultFuture:
    # A commit future orbax waits on in its background save thread (faults.py's hooks).
    def __init__(self, point: str, step: int):
        self.point, self.step = point, step

    def result(self, timeout: float | None = None) -> None:
        if self.point == "enospc" and faults.active("enospc", self.step):
            raise faults.enospc(self.step)
        faults.kill_if(self.point, self.step)

    def cancel(self) -> None:
        pass


class _PyTreeHandler(ocp.handlers.PyTreeCheckpointHandler):
    """Orbax's handler plus the fault-injection points inside its asynchronous save."""

    step = -1  # the step being saved (saves are serialised by the manager)

    async def async_save(self, directory, *args, **kwargs):  # type: ignore[override]
        futures = await super().async_save(directory, *args, **kwargs) or []
        # Waited on in order: the first while the arrays are still being written.
        step = self.step
        return [
            _FaultFuture("during_async_write", step),
            *futures,
            _FaultFuture("enospc", step),
            _FaultFuture("after_data_written", step),
        ]

    def finalize(self, directory) -> None:  # type: ignore[override]
        faults.kill_if("before_finalize", self.step)
        super().finalize(directory)


def handler_registry() -> tuple[Any, _PyTreeHandler]:
    # "Replica-parallel" saving splits the write of a replicated array over its replicas. With
    # several processes (hosts) that spreads the bytes of replicated params and optimizer state
    # over every host's disk bandwidth instead of making process 0's replica write them all, so
    # it is left to orbax's platform default (on, except on GPU). On one process every replica
    # shares one host: nothing is gained, and it compiles one small slicing program per
    # (shape, device) on the first save, slow with many (fake CPU) devices, so one replica
    # writes. Either way an array whose per-replica slice would be under 1 MiB is written by
    # one replica: its slicing programs cost more than the write they would split.
    th = ocp.type_handlers
    replica_parallel = None if jax.process_count() > 1 else False
    types = th.create_type_handler_registry(
        (
            jax.Array,
            th.ArrayHandler(
                use_replica_parallel=replica_parallel,
                min_slice_bytes_for_replica_parallel=1 << 20,
            ),
        ),
        (np.ndarray, th.NumpyHandler()),
        (np.number, th.ScalarHandler()),
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
    )
    state = _PyTreeHandler(type_handler_registry=types)
    meta = ocp.handlers.JsonCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeSave, state)
    registry.add("state", ocp.args.PyTreeRestore, state)
    registry.add("meta", ocp.args.JsonSave, meta)
    registry.add("meta", ocp.args.JsonRestore, meta)
    return registry, state
