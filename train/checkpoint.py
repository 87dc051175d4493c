"""Orbax checkpointing, in one place.

A checkpoint is one step directory holding two items: ``state`` (the whole :class:`TrainState`,
each array saved by its shards) and ``meta`` (JSON: the data iterator's position and the step).
Saves are asynchronous and atomic (orbax writes to a temporary directory and renames it when
complete), so a run killed mid-save leaves the previous checkpoint as the latest complete one.
The last ``keep`` checkpoints are kept, plus the best ``keep_best`` by an eval metric.

Restores take the target shardings from the current mesh, so a checkpoint written on 8 devices
restores onto 1 and back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from train.config import Checkpoint
from train.state import TrainState

__all__ = ["Checkpointer"]


def _state_tree(state: TrainState) -> dict[str, Any]:
    # Saved as a plain dict so the on-disk layout does not depend on the Python class.
    return state._asdict()


def _handler_registry() -> Any:
    # Arrays are written by the replica that owns each shard. Orbax's default on CPU/TPU,
    # "replica-parallel" saving, slices each replicated array per device, which compiles one
    # small program per (shape, device) on the first save: slow with many fake CPU devices and
    # nothing gained on a single host.
    th = ocp.type_handlers
    types = th.create_type_handler_registry(
        (jax.Array, th.ArrayHandler(use_replica_parallel=False)),
        (np.ndarray, th.NumpyHandler()),
        (np.number, th.ScalarHandler()),
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
    )
    state = ocp.handlers.PyTreeCheckpointHandler(type_handler_registry=types)
    meta = ocp.handlers.JsonCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeSave, state)
    registry.add("state", ocp.args.PyTreeRestore, state)
    registry.add("meta", ocp.args.JsonSave, meta)
    registry.add("meta", ocp.args.JsonRestore, meta)
    return registry


class Checkpointer:
    """Saves and restores the train state and data position under ``directory``.

    Args:
      directory: the checkpoints folder (created if missing).
      cfg: the ``checkpoint`` config section.
    """

    def __init__(self, directory: str | Path, cfg: Checkpoint):
        self.cfg = cfg
        keep: list[Any] = [policies.LatestN(cfg.keep)]
        if cfg.keep_best:
            sign = 1.0 if cfg.best_metric == "eval_accuracy" else -1.0
            keep.append(
                policies.BestN(
                    get_metric_fn=lambda m: sign * float(m[cfg.best_metric]),
                    n=cfg.keep_best,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.FixedIntervalPolicy(cfg.every),
            preservation_policy=policies.AnyPreservationPolicy(keep),
            enable_async_checkpointing=cfg.async_save,
            create=True,
            cleanup_tmp_directories=True,  # leftovers of a save that was killed
        )
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=_handler_registry()
        )

    def latest_step(self) -> int | None:
        """The step of the latest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        data_position: int,
        metrics: dict[str, float] | None = None,
        force: bool = False,
    ) -> bool:
        """Starts an (async) save at ``step`` if the interval says so (or ``force``)."""
        if step in self._manager.all_steps():
            return False
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(_state_tree(state)),
                meta=ocp.args.JsonSave({"step": step, "data_position": data_position}),
            ),
            metrics=metrics if self.cfg.keep_best else None,
            force=force,
        )

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """Restores ``step`` onto the shardings of ``abstract_state`` (ShapeDtypeStructs).

        Returns:
          The state and the meta dict (``data_position``, ``step``).
        """
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            _state_tree(abstract_state),
        )
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
                ),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return TrainState(**out["state"]), dict(out["meta"])

    def wait(self) -> None:
        """Blocks until the pending save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
