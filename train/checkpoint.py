"""Orbax checkpointing, in one place: :class:`Checkpointer` saves, keeps and restores steps.

A step directory holds ``state`` (the whole :class:`TrainState`, each array saved by its shards)
and ``meta`` (JSON: the step and the data iterator's grain state). Saves are asynchronous and
atomic; each step is verified against its manifest (:mod:`train.manifest`) before it is
restored onto the current mesh. What is guaranteed when things go wrong, and how saves, restores
and several processes work: docs/reliability.md.
"""

from __future__ import annotations

import errno
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from train import faults, multihost
from train import manifest as manifest_lib
from train import restore_verdicts as verdicts
from train.config import Checkpoint
from train.donation import refit
from train.durable import fsync_dir
from train.errors import CheckpointError, CheckpointUnavailableError
from train.orbax_handlers import handler_registry
from train.run_dir import remove_stale_tmp
from train.state import TrainState

__all__ = ["Checkpointer"]


def _state_tree(state: TrainState) -> dict[str, Any]:
    # Saved as a plain dict so the on-disk layout does not depend on the Python class.
    return state._asdict()


class Checkpointer:
    """Saves and restores the train state and data position under ``directory``.

    Args:
      directory: the checkpoints folder (created if missing; orbax temporary directories left by
        killed saves are removed).
      cfg: the ``checkpoint`` config section.
      config_hash: this run's :func:`train.run_dir.config_hash`; recorded in each step's
        manifest and checked on restore (``""``, the default, records and checks nothing).
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
        self.removed_tmp = remove_stale_tmp(self.directory) if multihost.is_main() else []
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.FixedIntervalPolicy(cfg.every),
            # Orbax deletes old steps as soon as a new one is renamed into place, before its
            # manifest exists; _prune deletes them only once a newer step is complete.
            preservation_policy=policies.LatestN(None),  # None: keep every step
            enable_async_checkpointing=cfg.async_save,
            create=True,
            cleanup_tmp_directories=True,  # leftovers of a save that was killed
        )
        registry, self._handler = handler_registry()
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
        return [
            s
            for s in self.all_steps()
            if (self.directory / str(s) / manifest_lib.MANIFEST).exists()
        ]

    # --- save -------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        data_state: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        force: bool = False,
    ) -> bool:
        """Starts an (async) save at ``step`` if the interval says so (or ``force``).

        Blocks for the NaN/Inf check (on the devices), orbax's synchronous part and the host
        copies of what the manifest checksums; the crc32s and the manifest follow in the
        background. ``state`` may be donated as soon as this returns.

        Raises:
          CheckpointError: the state holds NaN/Inf (never written), or the previous save failed
            (e.g. disk full); the message names the last valid step.
        """
        if not (force or self._manager.should_save(step)):
            return False
        self._finish_pending()
        if step in self._manager.all_steps():
            return False
        faults.kill_if("before_save", step)
        tree = _state_tree(state)
        # The device-to-host copies the crc32s need start first, to overlap the NaN/Inf check
        # (reduced on the devices: no host copy of the state) and orbax's own copies.
        copies = manifest_lib.HostCopies(tree)
        bad = manifest_lib.nonfinite_leaves(tree)
        if bad:
            raise CheckpointError(
                f"refusing to save step {step}: non-finite values in {', '.join(bad[:5])}. The "
                f"last valid checkpoint is {self._last_valid()}."
            )
        meta: dict[str, Any] = {"step": step}
        if data_state is not None:
            meta["data_state"] = data_state  # grain's iterator state: resumes the batches exactly
        head = {
            "step": step,
            "config_hash": self.config_hash,
            "meta": meta,
            "process_count": jax.process_count(),
            "metrics": dict(metrics or {}),  # ranks the step for keep_best, across restarts
        }
        self._handler.step = self._saving = step
        try:
            started = self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(tree), meta=ocp.args.JsonSave(meta)
                ),
                force=force,
            )
        except OSError as e:
            raise self._write_error(step, e) from e
        if started:
            # The caller donates `state` when this returns: its bytes must be on the host by then.
            copies.take()
            self._manifest_writer = threading.Thread(
                target=self._write_manifest, args=(step, head, copies), daemon=True
            )
            self._manifest_writer.start()
        return started

    def _write_manifest(
        self, step: int, head: dict[str, Any], copies: manifest_lib.HostCopies
    ) -> None:
        # Background: checksum the host copies (while orbax writes), then once orbax has renamed
        # the step into place, add this process's manifest.
        try:
            records = copies.records()
            self._manager.wait_until_finished()
        except BaseException as e:  # raised in the main thread by the next save or wait()
            self._save_error = e
            return
        step_dir = self.directory / str(step)
        if not step_dir.is_dir():
            return
        if multihost.is_main():
            faults.kill_if("after_finalize_before_cleanup", step)
            manifest_lib.write_manifest(step_dir, {**head, "leaves": records})
            if _complete(step_dir):
                manifest_lib.mark_checkpointed(self.directory, step)
        else:
            me = jax.process_index()
            shards = {path: r["shards"] for path, r in records.items() if r.get("shards")}
            manifest_lib.write_manifest(
                step_dir, {"step": step, "process": me, "shards": shards}, process=me
            )

    def _finish_pending(self) -> None:
        if self._manifest_writer is not None:
            self._manifest_writer.join()
            self._manifest_writer = None
        if self._save_error is not None:
            error, self._save_error = self._save_error, None
            raise self._write_error(self._saving, error) from error
        if multihost.is_main():
            self._prune()

    def _prune(self) -> None:
        # Deletes complete steps beyond the latest `keep` and the best `keep_best` (ranked by the
        # metrics in their manifests, so the ranking survives a restart). Only complete steps
        # count and only they are deleted, so an older step stays until a newer one is complete.
        complete: dict[int, dict[str, Any]] = {}
        for step in self.all_steps():
            try:
                complete[step] = manifest_lib.read_manifest(self.directory / str(step))
            except (ValueError, OSError):
                continue
        if not complete:
            return
        manifest_lib.mark_checkpointed(self.directory, max(complete))
        keep = set(sorted(complete)[-self.cfg.keep :])
        if self.cfg.keep_best:
            name = self.cfg.best_metric
            sign = -1.0 if name == "eval_loss" else 1.0  # higher is better after the sign
            ranked = [s for s, m in complete.items() if name in (m.get("metrics") or {})]
            ranked.sort(key=lambda s: (sign * float(complete[s]["metrics"][name]), s), reverse=True)
            keep |= set(ranked[: self.cfg.keep_best])
        doomed = sorted(set(complete) - keep)
        for step in doomed:
            gone = self.directory / f"{step}{manifest_lib.DELETING}"
            (self.directory / str(step)).rename(gone)
            shutil.rmtree(gone, ignore_errors=True)
        if doomed:
            fsync_dir(self.directory)
            self._manager.reload()

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
          The state and the meta dict (``step`` and, when saved, ``data_state``).
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
        self,
        abstract_state: TrainState,
        *,
        allow_dtype_cast: bool = False,
        allow_config_change: bool = False,
        donatable: bool = False,
    ) -> tuple[TrainState, dict[str, Any], int] | None:
        """Restores the newest step that verifies against its manifest; None if there is none.

        Steps that do not verify are moved aside to ``<N>.corrupt-<reason>`` with a warning. With
        several processes every process takes the same decision on each step (a step is rejected
        when any process finds its shards damaged), and only process 0 moves steps aside.

        Args:
          abstract_state: ShapeDtypeStructs with shardings: the config's state.
          allow_dtype_cast: restore a leaf saved in another dtype by casting it.
          allow_config_change: restore a step written with another config (its manifest's
            ``config_hash`` differs from this Checkpointer's), with a warning.
          donatable: give every leaf a fresh XLA-owned buffer, so the first train step can
            donate it (jax#18617), as :func:`rematerialize` does: no copy of the state is needed
            afterwards. Either way the peak device memory is the state plus one leaf.

        Returns:
          ``(state, meta, step)`` or None when the directory has no step at all.

        Raises:
          CheckpointError: steps exist but none verifies (each is listed), or the newest one's
            leaf paths, shapes or dtypes differ from ``abstract_state`` (each leaf is listed), or
            it was written with another config and ``allow_config_change`` is False.
        """
        tree = _state_tree(abstract_state)
        expected = {
            jax.tree_util.keystr(p): {"shape": list(x.shape), "dtype": str(x.dtype)}
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        }
        aside = verdicts.SetAside()
        for step in sorted(self.all_steps(), reverse=True):
            # 1. Its manifest: complete, readable, fits the state, written with this config.
            manifest = self._agreed_manifest(
                step,
                expected,
                aside,
                allow_dtype_cast=allow_dtype_cast,
                allow_config_change=allow_config_change,
            )
            if manifest is None:
                continue
            # 2. Its bytes, restored in the saved dtypes and checked leaf by leaf.
            restored = self._agreed_restore(step, tree, manifest, aside)
            if restored is None:
                continue
            if aside.lines:
                self._set_aside_done()
            state, meta = restored
            state = self._accept(step, state, manifest, expected, tree, donatable=donatable)
            return state, meta, step
        self._none_usable(aside)
        return None

    def _agreed_manifest(
        self,
        step: int,
        expected: dict[str, Any],
        aside: verdicts.SetAside,
        *,
        allow_dtype_cast: bool,
        allow_config_change: bool,
    ) -> dict[str, Any] | None:
        # The step's manifest if every process accepts it; None once the step is set aside.
        code, text, manifest = self._check_manifest(
            step,
            expected,
            allow_dtype_cast=allow_dtype_cast,
            allow_config_change=allow_config_change,
        )
        mine = code
        code, text = verdicts.agree(code, text)
        if code == verdicts.STORAGE:
            raise CheckpointUnavailableError(verdicts.storage_message(step, self.directory, text))
        if code in (verdicts.MISFIT, verdicts.CONFIG):
            if code != mine:
                text = f"checkpoint step {step} in {self.directory} is refused ({text})"
            raise CheckpointError(text)
        if code != verdicts.OK:
            aside.add(self._reject(step, text), unfinished=code == verdicts.UNFINISHED)
            return None
        return manifest

    def _agreed_restore(
        self, step: int, tree: dict[str, Any], manifest: dict[str, Any], aside: verdicts.SetAside
    ) -> tuple[TrainState, dict[str, Any]] | None:
        # The step's state and meta if every process verified its bytes; None once set aside.
        faults.kill_if("during_restore", step)
        restored: tuple[TrainState, dict[str, Any]] | None = None
        code, text = verdicts.OK, ""
        try:
            restored = self._restore_verified(step, tree, manifest)
        except verdicts.Damaged as e:
            code, text = verdicts.CHECKSUM, str(e)
        except Exception as e:  # orbax could not read it: truncated or missing files
            code, text = (
                verdicts.UNREADABLE,
                verdicts.unreadable(self.directory / str(step), e, tree),
            )
            if verdicts.storage_failure(e):  # the storage, not the step: set nothing aside
                code, text = verdicts.STORAGE, f"{type(e).__name__}: {e}"
        code, text = verdicts.agree(code, text)
        if code == verdicts.STORAGE:
            if restored is not None:
                _delete(restored[0])
            raise CheckpointUnavailableError(verdicts.storage_message(step, self.directory, text))
        if restored is None or code != verdicts.OK:
            if restored is not None:
                _delete(restored[0])
            aside.add(self._reject(step, text), unfinished=False)
            return None
        return restored

    def _accept(
        self,
        step: int,
        state: TrainState,
        manifest: dict[str, Any],
        expected: dict[str, Any],
        target: dict[str, Any],
        *,
        donatable: bool,
    ) -> TrainState:
        # The verified state in the dtypes of `target` (the config's state), each leaf in a
        # fresh buffer with `donatable`; a warning for each thing allowed.
        written = manifest.get("config_hash") or ""
        if self.config_hash and written and written != self.config_hash:
            self._warn(
                f"WARNING: step {step} was written with another config (config hash "
                f"{written[:12]}, this run's {self.config_hash[:12]}); resuming with "
                "this run's config (allowed)."
            )
        saved = manifest["leaves"]
        cast = [
            f"  {p}: {saved[p]['dtype']} -> {e['dtype']}"
            for p, e in expected.items()
            if saved[p]["dtype"] != e["dtype"]
        ]
        if cast:
            self._warn(
                f"WARNING: step {step}: casting {len(cast)} leaves (allowed):\n" + "\n".join(cast)
            )
        return TrainState(**refit(_state_tree(state), target, copy_all=donatable))

    def _none_usable(self, aside: verdicts.SetAside) -> None:
        # No step was restored: refuse when steps were damaged or the run had checkpointed
        # once, else (only unfinished saves, or none at all) the run starts at step 0.
        if aside.damaged:
            self._set_aside_done()
            raise CheckpointError(
                f"no checkpoint in {self.directory} verifies; every step was rejected (and moved "
                "aside):\n"
                + "\n".join(aside.lines)
                + "\nNothing was restored and training did not start. Fix: restore the "
                "directory from a backup, or --restart to start at step 0."
            )
        if aside.unfinished:
            self._set_aside_done()
        if manifest_lib.checkpointed(self.directory):
            # A step of this run was complete once: starting over would silently retrain it.
            found = "\n".join(aside.lines) or "  (no step is left in it)"
            earlier = sorted(p.name for p in self.directory.iterdir() if ".corrupt-" in p.name)
            raise CheckpointError(
                f"{self.directory} held complete checkpoints of this run (marker "
                f"{manifest_lib.CHECKPOINTED}), but none is usable now:\n{found}\n"
                + (f"Set aside earlier: {', '.join(earlier)}.\n" if earlier else "")
                + "Nothing was restored and training did not start. Fix: restore the directory "
                "from a backup (or move a set-aside step back), or --restart to start at step 0."
            )
        if aside.unfinished:
            # Only saves that never finished (like orbax's own temporary directories): there is
            # no complete checkpoint, so the run starts at step 0, and says so.
            self._warn(
                "WARNING: no finished checkpoint; starting at step 0. Set aside:\n"
                + "\n".join(aside.unfinished)
            )

    def _check_manifest(
        self,
        step: int,
        expected: dict[str, Any],
        *,
        allow_dtype_cast: bool,
        allow_config_change: bool,
    ) -> tuple[int, str, dict[str, Any]]:
        # This process's verdict on a step's manifest: (code, reason, manifest).
        try:
            manifest = manifest_lib.read_manifest(self.directory / str(step))
        except OSError as e:
            return verdicts.STORAGE, f"reading its manifest: {type(e).__name__}: {e}", {}
        except ValueError as e:
            return (
                (
                    verdicts.UNFINISHED
                    if str(e).startswith("no-manifest")
                    else verdicts.BAD_MANIFEST
                ),
                str(e),
                {},
            )
        problems = manifest_lib.structure_problems(
            manifest["leaves"], expected, allow_dtype_cast=allow_dtype_cast
        )
        if problems:
            misfit = (
                f"checkpoint step {step} in {self.directory} does not fit this config's train "
                f"state ({len(problems)} leaves differ, saved vs expected):\n"
                + "\n".join(problems)
                + "\nFix: use the config the run was trained with (config.yaml in the run "
                "directory), another run_dir, or --restart; if only dtypes differ, "
                "--allow-dtype-cast converts them."
            )
            return verdicts.MISFIT, misfit, manifest
        written = manifest.get("config_hash") or ""  # absent in manifests of older versions
        if self.config_hash and written and written != self.config_hash and not allow_config_change:
            changed = verdicts.CONFIG_CHANGED.format(
                step=step, directory=self.directory, written=written[:12], now=self.config_hash[:12]
            )
            return verdicts.CONFIG, changed, manifest
        return verdicts.OK, "", manifest

    def _restore_verified(
        self, step: int, tree: dict[str, Any], manifest: dict[str, Any]
    ) -> tuple[TrainState, dict[str, Any]]:
        # Restored in the saved dtypes, so the bytes checked are the bytes written; each leaf's
        # host copy is made (and dropped) in turn. A damaged state is deleted before raising.
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
        try:
            problems: list[str] = []
            for path, x in jax.tree_util.tree_leaves_with_path(_state_tree(state)):
                key = jax.tree_util.keystr(path)
                problems = manifest_lib.checksum_problems(key, x, leaves[key])
                if problems:
                    break
            if not problems and meta != manifest["meta"]:
                problems = [f"checksum: meta {meta} does not match its manifest {manifest['meta']}"]
            if problems:
                more = f" (and {len(problems) - 1} more shards)" if len(problems) > 1 else ""
                raise verdicts.Damaged(problems[0] + more)
        except BaseException:
            _delete(state)  # before the next step is restored: one state at a time
            raise
        return state, meta

    def _reject(self, step: int, reason: str) -> str:
        step_dir = self.directory / str(step)
        aside = self.directory / f"{step}.corrupt-{reason.split(':')[0]}"
        while aside.exists():
            aside = aside.with_name(aside.name + "-again")
        if multihost.is_main():  # every process has finished reading it: the verdict was agreed
            step_dir.rename(aside)
        line = f"  step {step}: {reason}; moved to {aside.name}"
        self._warn(f"WARNING: checkpoint rejected:\n{line}")
        return line

    def _set_aside_done(self) -> None:
        # Every process lists the steps again only once process 0 has moved them aside, so all
        # agree on which steps exist (a later save of the same step number is not skipped).
        multihost.sync("checkpoint-set-aside")
        self._manager.reload()

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


def _delete(tree: Any) -> None:
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def _complete(step_dir: Path) -> bool:
    # Every process's manifest part is there (shared storage).
    try:
        manifest_lib.read_manifest(step_dir)
    except (ValueError, OSError):
        return False
    return True
