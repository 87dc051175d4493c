"""The run directory: its lock, the config it was trained with, and its stale files.

:func:`start` locks it and refuses a config that changed since its checkpoints were written;
:func:`prepare` clears it for ``--restart``; :func:`record_config` writes ``config.yaml``;
:func:`remove_stale_tmp` clears what killed saves left in the checkpoints folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from train import multihost
from train.config import Config, dump_config, is_resume_safe, resume_view
from train.durable import write_text
from train.errors import ConfigChangedError, RunLockedError, SetupError
from train.manifest import DELETING, ORBAX_TMP, checkpointed

__all__ = [
    "RunLock",
    "config_diff",
    "config_hash",
    "prepare",
    "record_config",
    "remove_stale_tmp",
    "start",
]


def start(
    cfg: Config, *, restart: bool, allow_config_change: bool, say: Callable[[str], None]
) -> RunLock | None:
    """Locks the run directory and checks the config, on process 0; shared with every process.

    Returns:
      The lock (held by process 0 until the run returns; None elsewhere).

    Raises:
      RunLockedError, ConfigChangedError: on every process, when process 0's check fails.
    """
    run_dir = cfg.resolved_run_dir.absolute()
    lock, failure = None, None
    if multihost.is_main():
        try:
            lock = RunLock(run_dir)
            if not restart:  # refused before anything is built
                _check_config_change(run_dir, cfg, allow=allow_config_change, say=say)
        except Exception as e:
            failure = e
            if lock is not None:
                lock.release()
    try:
        multihost.share_verdict(failure, what="start-up")
        multihost.check_same_config(config_hash(cfg.model_dump(mode="json")))
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


def _check_config_change(
    run_dir: Path, cfg: Config, *, allow: bool, say: Callable[[str], None]
) -> None:
    # Only checkpoints make a changed config matter: without them the run starts afresh. A run
    # directory that ever held one is checked even when every step was set aside since.
    ckpts = run_dir / "checkpoints"
    if not (run_dir / "config.yaml").exists() or not ckpts.is_dir():
        return
    if not checkpointed(ckpts) and not any(p.name.isdigit() for p in ckpts.iterdir()):
        return
    old = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    unsafe, safe = config_diff(old, cfg.model_dump(mode="json"))
    if unsafe and not allow:
        raise ConfigChangedError(
            f"the config differs from the one {run_dir} was trained with (config.yaml):\n"
            + "\n".join(unsafe)
            + "\nFix: rerun with the old values, use another run_dir or --restart, or pass "
            "--allow-config-change to resume with the new ones."
        )
    if unsafe or safe:
        say("config changed since the last run (resuming):\n" + "\n".join(unsafe + safe))


def prepare(run_dir: Path, *, restart: bool) -> None:
    """Process 0 clears a restarted run's checkpoints, metrics and plot; the others wait for it."""
    if multihost.is_main():
        if restart and run_dir.exists():
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            (run_dir / "plot.png").unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
    multihost.sync("run_dir")


def record_config(run_dir: Path, cfg: Config) -> None:
    """Writes ``config.yaml``, once the checkpoints were accepted under this config.

    A refused resume leaves the config the run was trained with, so the original command
    still resumes.
    """
    if multihost.is_main():
        write_text(run_dir / "config.yaml", dump_config(cfg))


class RunLock:
    """An exclusive ``flock`` on ``run_dir/.lock``, which names its holder (pid and host).

    Raises:
      RunLockedError: another process holds it (the message names its pid and host).
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise SetupError(
                f"run_dir={str(run_dir)!r} cannot be created or written ({type(e).__name__}: "
                f"{e}). Fix: a writable directory (run_dir=...)."
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            raise RunLockedError(
                f"run directory {run_dir} is in use by another trainer ({holder}; lock file "
                f"{self.path}). Fix: wait for it to finish, stop it, or use another run_dir."
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def remove_stale_tmp(directory: Path) -> list[str]:
    """Removes orbax temporary step directories and half-deleted steps left by killed runs;
    returns their names."""
    if not directory.is_dir():
        return []
    stale = sorted(
        p for p in directory.iterdir() if ORBAX_TMP in p.name or p.name.endswith(DELETING)
    )
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in stale]


def config_hash(cfg_dict: dict[str, Any]) -> str:
    """sha256 of the config's keys that change what a run computes (not the resume-safe ones).

    Hashed in the effective form (:func:`train.config.resume_view`): two configs whose learning
    rate schedules span the same steps hash alike whatever their ``train.steps``.
    """
    kept = {k: v for k, v in _flat(resume_view(cfg_dict)).items() if not is_resume_safe(k)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k: v})
    return out


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(unsafe, safe)`` changed keys as ``key: old -> new`` lines.

    Safe keys are those the schema marks resume-safe (:func:`train.config.is_resume_safe`).
    Both configs are compared in their effective form (:func:`train.config.resume_view`), so a
    longer run on the same schedule changes only ``train.steps`` (safe), while a longer run
    that would stretch a cosine schedule also changes ``optim.schedule_steps`` (unsafe).

    >>> config_diff({"train": {"steps": 8}}, {"train": {"steps": 12}})
    (['  optim.schedule_steps: 8 -> 12'], ['  train.steps: 8 -> 12'])
    >>> extended = {"train": {"steps": 12}, "optim": {"schedule_steps": 8}}
    >>> config_diff({"train": {"steps": 8}}, extended)
    ([], ['  train.steps: 8 -> 12'])
    """
    a, b = _flat(resume_view(old)), _flat(resume_view(new))
    unsafe, safe = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "(unset)") != b.get(key, "(unset)"):
            line = f"  {key}: {a.get(key, '(unset)')!r} -> {b.get(key, '(unset)')!r}"
            (safe if is_resume_safe(key) else unsafe).append(line)
    return unsafe, safe
