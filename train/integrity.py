"""What orbax does not check: per-step manifests, the run-directory lock, config changes.

Orbax's atomic rename keeps a half-written step out of sight, but it neither checksums array
data nor notices a truncated file or a dtype change on restore. So every finalized step gets a
``manifest.json`` (config hash; per leaf: path, shape, dtype, crc32 of the host bytes), written
after orbax renamed the step into place; a step without one is unverified.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "ConfigChangedError",
    "RunLock",
    "RunLockedError",
    "config_diff",
    "config_hash",
    "leaf_records",
    "read_manifest",
    "remove_stale_tmp",
    "structure_problems",
    "write_manifest",
]

MANIFEST = "manifest.json"
ORBAX_TMP = ".orbax-checkpoint-tmp"
# Keys a resumed run may change without changing what it computes.
RESUME_SAFE = (
    "name", "run_dir", "train.log_every", "train.eval_every", "train.eval_batches",
    "train.progress", "train.plot", "train.compile_cache", "train.verify_donation",
    "checkpoint.every", "checkpoint.keep", "checkpoint.keep_best", "checkpoint.best_metric",
    "checkpoint.async_save", "distributed.",
)  # fmt: skip


class CheckpointError(RuntimeError):
    """No checkpoint can be used as it is: all damaged, a save failed, or it does not fit."""


class RunLockedError(RuntimeError):
    """Another process is training into the same run directory."""


class ConfigChangedError(ValueError):
    """The config differs from the one the run directory's checkpoints were trained with."""


# --- manifest -------------------------------------------------------------------------------------


def _host_bytes(x: Any) -> np.ndarray | None:
    # A value every process can read whole; None for arrays sharded across hosts (not checksummed).
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0)) if x.is_fully_replicated else None
    return np.asarray(x)


def leaf_records(tree: Any) -> dict[str, dict[str, Any]]:
    """``{leaf path: {shape, dtype, crc32}}`` of a pytree of arrays (one host sync)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    host = jax.device_get([_host_bytes(x) for _, x in flat])
    out = {}
    for (path, x), h in zip(flat, host, strict=True):
        crc = None if h is None else zlib.crc32(np.ascontiguousarray(h).view(np.uint8).data)
        out[jax.tree_util.keystr(path)] = {
            "shape": list(x.shape), "dtype": str(x.dtype), "crc32": crc,
            "finite": True if h is None or h.dtype.kind != "f" else bool(np.isfinite(h).all()),
        }  # fmt: skip
    return out


def write_manifest(step_dir: Path, manifest: dict[str, Any]) -> None:
    """Writes ``step_dir/manifest.json`` atomically (temporary file, fsync, rename)."""
    tmp = step_dir / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The step's manifest; ``ValueError`` naming the problem if missing or unreadable."""
    path = step_dir / MANIFEST
    if not path.exists():
        raise ValueError("no-manifest: no manifest.json (the save did not finish)")
    try:
        manifest = json.loads(path.read_text())
        manifest["leaves"].items()
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"bad-manifest: manifest.json is unreadable ({e})") from None
    return manifest


def structure_problems(
    saved: dict[str, dict[str, Any]], expected: dict[str, Any], *, allow_dtype_cast: bool
) -> list[str]:
    """Every leaf whose path, shape or dtype differs, as ``path: saved ..., expected ...``."""

    def show(r: dict[str, Any] | None) -> str:
        return "(absent)" if r is None else f"{tuple(r['shape'])} {r['dtype']}"

    problems = []
    for path in sorted(set(saved) | set(expected)):
        s, e = saved.get(path), expected.get(path)
        if s is not None and e is not None and s["shape"] == e["shape"]:
            if s["dtype"] == e["dtype"] or allow_dtype_cast:
                continue
        problems.append(f"  {path}: saved {show(s)}, expected {show(e)}")
    return problems


def config_hash(cfg_dict: dict[str, Any]) -> str:
    """sha256 of the config's keys that change what a run computes (not the resume-safe ones)."""
    kept = {k: v for k, v in _flat(cfg_dict).items() if not _resume_safe(k)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


# --- config changes -------------------------------------------------------------------------------


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k: v})
    return out


def _resume_safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in RESUME_SAFE)


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(unsafe, safe)`` changed keys as ``key: old -> new`` lines."""
    a, b = _flat(old), _flat(new)
    unsafe, safe = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "(unset)") != b.get(key, "(unset)"):
            line = f"  {key}: {a.get(key, '(unset)')!r} -> {b.get(key, '(unset)')!r}"
            (safe if _resume_safe(key) else unsafe).append(line)
    return unsafe, safe


# --- run directory --------------------------------------------------------------------------------


class RunLock:
    """An exclusive ``flock`` on ``run_dir/.lock``, which names its holder (pid and host).

    Raises:
      RunLockedError: another process holds it (the message names its pid and host).
    """

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / ".lock"
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
    """Removes orbax temporary step directories left by killed saves; returns their names."""
    if not directory.is_dir():
        return []
    stale = sorted(p for p in directory.iterdir() if ORBAX_TMP in p.name)
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in stale]
