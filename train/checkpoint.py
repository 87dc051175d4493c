"""Orbax checkpointing, in one place.

A checkpoint is one step directory holding two items: ``state`` (the whole :class:`TrainState`,
each array saved by its shards) and ``meta`` (JSON: the data iterator's position and the step).
Saves are asynchronous and atomic (orbax writes to a temporary directory and renames it when
complete), so a run killed mid-save leaves the previous checkpoint as the latest complete one.
The last ``keep`` checkpoints are kept, plus the best ``keep_best`` by an eval metric.

Restores take the target shardings from the current mesh, so a checkpoint written on 8 devices
restores onto 1 and back.

Integrity (:mod:`train.integrity`): each step gets a ``manifest.json`` once orbax has renamed it
into place. :meth:`Checkpointer.restore_latest` restores the newest step whose manifest matches
the restored bytes, moves each bad one aside to ``<N>.corrupt-<reason>`` with a warning naming
the leaf, and refuses (listing every rejected step) when none verifies. A checkpoint whose leaf
paths, shapes or dtypes differ from the config's state is refused before restoring.
"""

from __future__ import annotations

import errno
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from train import faults
from train import integrity as integ
from train.config import Checkpoint
from train.integrity import CheckpointError
from train.state import TrainState

__all__ = ["CheckpointError", "Checkpointer"]


def _state_tree(state: TrainState) -> dict[str, Any]:
    # Saved as a plain dict so the on-disk layout does not depend on the Python class.
    return state._asdict()


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
        return [_FaultFuture("during_async_write", step), *futures,
                _FaultFuture("enospc", step), _FaultFuture("after_data_written", step)]  # fmt: skip

    def finalize(self, directory) -> None:  # type: ignore[override]
        faults.kill_if("before_finalize", self.step)
        super().finalize(directory)


def _handler_registry() -> tuple[Any, _PyTreeHandler]:
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
    state = _PyTreeHandler(type_handler_registry=types)
    meta = ocp.handlers.JsonCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeSave, state)
    registry.add("state", ocp.args.PyTreeRestore, state)
    registry.add("meta", ocp.args.JsonSave, meta)
    registry.add("meta", ocp.args.JsonRestore, meta)
    return registry, state


class Checkpointer:
    """Saves and restores the train state and data position under ``directory``.

    Args:
      directory: the checkpoints folder (created if missing; orbax temporary directories left by
        killed saves are removed).
      cfg: the ``checkpoint`` config section.
      config_hash: recorded in each step's manifest (:func:`train.integrity.config_hash`).
      warn: where warnings about rejected steps go (default: stderr).
    """

    def __init__(
        self,
        directory: str | Path,
        cfg: Checkpoint,
        *,
        config_hash: str = "",
        warn: Callable[[str], None] | None = None,
    ):
        self.cfg = cfg
        self.config_hash = config_hash
        self._warn = warn or (lambda s: print(s, file=sys.stderr, flush=True))
        self.directory = Path(directory).absolute()
        # Removed before orbax lists the steps (orbax's own cleanup runs in the background).
        self.removed_tmp = integ.remove_stale_tmp(self.directory) if _is_main() else []
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
        registry, self._handler = _handler_registry()
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=registry
        )
        self._manifest_writer: threading.Thread | None = None
        self._save_error: BaseException | None = None  # of the pending save, from the writer
        self._saving: int | None = None
        self._failed = False

    def latest_step(self) -> int | None:
        """The step of the latest complete checkpoint (verified or not), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def verified_steps(self) -> list[int]:
        """Steps that have a manifest (checked against their bytes only on restore)."""
        return [s for s in self.all_steps() if (self.directory / str(s) / integ.MANIFEST).exists()]

    # --- save -------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        data_position: int,
        metrics: dict[str, float] | None = None,
        force: bool = False,
    ) -> bool:
        """Starts an (async) save at ``step`` if the interval says so (or ``force``).

        Raises:
          CheckpointError: the state holds NaN/Inf (never written), or the previous save failed
            (e.g. disk full); the message names the last valid step.
        """
        if step in self._manager.all_steps() or not (force or self._manager.should_save(step)):
            return False
        self._finish_pending()
        faults.kill_if("before_save", step)
        leaves = integ.leaf_records(_state_tree(state))
        bad = [path for path, r in leaves.items() if not r.pop("finite")]
        if bad:
            raise CheckpointError(
                f"refusing to save step {step}: non-finite values in {', '.join(bad[:5])}. The "
                f"last valid checkpoint is {self._last_valid()}."
            )
        meta = {"step": step, "data_position": data_position}
        manifest = {"step": step, "config_hash": self.config_hash, "meta": meta, "leaves": leaves}
        self._handler.step = self._saving = step
        try:
            started = self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(_state_tree(state)), meta=ocp.args.JsonSave(meta)
                ),
                metrics=metrics if self.cfg.keep_best else None,
                force=force,
            )
        except OSError as e:
            raise self._write_error(step, e) from e
        if started:
            self._manifest_writer = threading.Thread(
                target=self._write_manifest, args=(step, manifest), daemon=True
            )
            self._manifest_writer.start()
        return started

    def _write_manifest(self, step: int, manifest: dict[str, Any]) -> None:
        # Background: once orbax has renamed the step into place, add its manifest.
        try:
            self._manager.wait_until_finished()
        except BaseException as e:  # raised in the main thread by the next save or wait()
            self._save_error = e
            return
        step_dir = self.directory / str(step)
        if step_dir.is_dir() and _is_main():
            faults.kill_if("after_finalize_before_cleanup", step)
            integ.write_manifest(step_dir, manifest)

    def _finish_pending(self) -> None:
        if self._manifest_writer is not None:
            self._manifest_writer.join()
            self._manifest_writer = None
        if self._save_error is not None:
            error, self._save_error = self._save_error, None
            raise self._write_error(self._saving, error) from error

    def _write_error(self, step: int | None, error: BaseException) -> CheckpointError:
        self._failed = True
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        what = f"{type(error).__name__}: {error}"
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            what = f"disk full: {cause}"
        return CheckpointError(
            f"saving checkpoint step {step} in {self.directory} failed ({what}). The last valid "
            f"checkpoint is {self._last_valid()}; earlier checkpoints are intact. Fix: free disk "
            "space (or the cause above) and rerun the same command to resume from it."
        )

    def _last_valid(self) -> str:
        steps = self.verified_steps()
        return f"step {steps[-1]}" if steps else "none (no verified checkpoint yet)"

    # --- restore ----------------------------------------------------------------------------------

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """Restores ``step`` onto the shardings and dtypes of ``abstract_state`` (unverified).

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

    def restore_latest(
        self, abstract_state: TrainState, *, allow_dtype_cast: bool = False
    ) -> tuple[TrainState, dict[str, Any], int] | None:
        """Restores the newest step that verifies against its manifest; None if there is none.

        Steps that do not verify are moved aside to ``<N>.corrupt-<reason>`` with a warning.

        Args:
          abstract_state: ShapeDtypeStructs with shardings: the config's state.
          allow_dtype_cast: restore a leaf saved in another dtype by casting it.

        Returns:
          ``(state, meta, step)`` or None when the directory has no step at all.

        Raises:
          CheckpointError: steps exist but none verifies (each is listed), or the newest one's
            leaf paths, shapes or dtypes differ from ``abstract_state`` (each leaf is listed).
        """
        tree = _state_tree(abstract_state)
        expected = {
            jax.tree_util.keystr(p): {"shape": list(x.shape), "dtype": str(x.dtype)}
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        }
        rejected: list[str] = []
        unfinished: list[str] = []  # no manifest: killed after orbax's rename, before the manifest
        for step in sorted(self.all_steps(), reverse=True):
            step_dir = self.directory / str(step)
            try:
                manifest = integ.read_manifest(step_dir)
            except ValueError as e:
                bucket = unfinished if str(e).startswith("no-manifest") else rejected
                bucket.append(self._reject(step, str(e)))
                continue
            saved = manifest["leaves"]
            problems = integ.structure_problems(saved, expected, allow_dtype_cast=allow_dtype_cast)
            if problems:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} does not fit this config's train "
                    f"state ({len(problems)} leaves differ, saved vs expected):\n"
                    + "\n".join(problems)
                    + "\nFix: use the config the run was trained with (config.yaml in the run "
                    "directory), another run_dir, or --restart; if only dtypes differ, "
                    "--allow-dtype-cast converts them."
                )
            faults.kill_if("during_restore", step)
            try:
                state, meta = self._restore_verified(step, tree, manifest)
            except _Damaged as e:
                rejected.append(self._reject(step, str(e)))
                continue
            except Exception as e:  # orbax could not read it: truncated or missing files
                first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                rejected.append(self._reject(step, f"unreadable: {type(e).__name__}: {first}"))
                continue
            if rejected:
                self._manager.reload()
            cast = [f"  {p}: {saved[p]['dtype']} -> {e['dtype']}"
                    for p, e in expected.items() if saved[p]["dtype"] != e["dtype"]]  # fmt: skip
            if cast:
                self._warn(f"WARNING: step {step}: casting {len(cast)} leaves (allowed):\n"
                           + "\n".join(cast))  # fmt: skip
            state = jax.tree.map(lambda x, a: x.astype(a.dtype), state, abstract_state)
            return state, meta, step
        if rejected:
            self._manager.reload()
            raise CheckpointError(
                f"no checkpoint in {self.directory} verifies; every step was rejected (and moved "
                "aside):\n" + "\n".join(rejected) + "\nNothing was restored and training did not "
                "start. Fix: restore the directory from a backup, or --restart to start at step 0."
            )
        if unfinished:
            # Only saves that never finished (like orbax's own temporary directories): there is
            # no complete checkpoint, so the run starts at step 0, and says so.
            self._manager.reload()
            self._warn("WARNING: no finished checkpoint; starting at step 0. Set aside:\n"
                       + "\n".join(unfinished))  # fmt: skip
        return None

    def _restore_verified(
        self, step: int, tree: dict[str, Any], manifest: dict[str, Any]
    ) -> tuple[TrainState, dict[str, Any]]:
        # Restored in the saved dtypes, so the bytes checked are the bytes written.
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = manifest["leaves"]
        saved_dtypes = treedef.unflatten(
            [
                jax.ShapeDtypeStruct(
                    x.shape,
                    jnp.dtype(leaves[jax.tree_util.keystr(p)]["dtype"]),
                    sharding=x.sharding,
                )
                for p, x in flat
            ]
        )
        state, meta = self.restore(step, TrainState(**saved_dtypes))
        for path, record in integ.leaf_records(_state_tree(state)).items():
            want = leaves[path]["crc32"]
            if want is not None and record["crc32"] != want:
                raise _Damaged(
                    f"checksum: leaf {path} does not match its manifest (crc32 "
                    f"{record['crc32']:#010x}, manifest {want:#010x})"
                )
        if meta != manifest["meta"]:
            raise _Damaged(f"checksum: meta {meta} does not match its manifest {manifest['meta']}")
        return state, meta

    def _reject(self, step: int, reason: str) -> str:
        step_dir = self.directory / str(step)
        aside = self.directory / f"{step}.corrupt-{reason.split(':')[0]}"
        while aside.exists():
            aside = aside.with_name(aside.name + "-again")
        if _is_main():
            step_dir.rename(aside)
        line = f"  step {step}: {reason}; moved to {aside.name}"
        self._warn(f"WARNING: checkpoint rejected:\n{line}")
        return line

    # --- end --------------------------------------------------------------------------------------

    def wait(self) -> None:
        """Blocks until the pending save is complete on disk, its manifest written.

        Raises:
          CheckpointError: the save failed (e.g. disk full); names the last valid step.
        """
        self._finish_pending()
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            if not self._failed:  # orbax raises a failure it already reported once more
                raise self._write_error(self._saving, e) from e

    def close(self) -> None:
        try:
            self._manager.close()
        except Exception:
            if not self._failed:
                raise


class _Damaged(ValueError):
    """A restored step whose bytes do not match its manifest."""


def _is_main() -> bool:
    return jax.process_index() == 0
