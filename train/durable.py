"""Durable file writes: a temporary file, fsynced, renamed into place, the directory fsynced.

Used for what a crash must not leave half-written: manifests, ``config.yaml``, the trimmed
``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "write_json", "write_text"]


def write_json(path: Path, obj: Any) -> None:
    """Writes ``obj`` as JSON to ``path`` durably (:func:`write_text`)."""
    write_text(path, json.dumps(obj, indent=1))


def write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` durably: a temporary file, fsynced, renamed into place, then
    the directory fsynced (so the rename itself survives a power loss)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """fsyncs a directory, making the renames and creations inside it durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
