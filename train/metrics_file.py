"""``metrics.jsonl``: appended, read and trimmed so a crash loses no line of history.

The trainer appends one JSON line per log or eval (:class:`MetricsLog`). A kill can tear the
last line (a partial write): readers skip a torn last line with a warning. On start-up the file
is trimmed to the lines of the steps the run restarts from (lines past its checkpoint were
logged by a run that was killed, and will be logged again); the trimmed copy is written to a
temporary file, fsynced and renamed over the old one, so a kill during the rewrite leaves the
old file or the new one.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from train import faults
from train.durable import fsync_dir
from train.errors import SetupError

__all__ = ["MetricsLog", "read_metrics", "trim_metrics"]


class MetricsLog:
    """metrics.jsonl, one JSON line per log or eval, and (``tensorboard``) the same scalars for
    TensorBoard (:mod:`train.tensorboard`); written by process 0 only (``enabled``)."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool):
        path = run_dir / "metrics.jsonl"
        self._f = open(path, "a") if enabled else None  # noqa: SIM115 (closed by close())
        self._tensorboard: Any = None
        if enabled and tensorboard:
            from train.tensorboard import TensorBoard

            self._tensorboard = TensorBoard(run_dir, path)

    def record(self, split: str, step: int, values: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"split": split, "step": step, **values}) + "\n")
            self._f.flush()
        if self._tensorboard is not None:
            self._tensorboard.record(split, step, values)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def read_metrics(
    path: Path, *, warn: Callable[[str], None] = _stderr
) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` per line of ``path``, skipping a torn last line with a warning.

    Raises:
      SetupError: a line other than the last is not JSON (the file was edited or damaged).
    """
    lines = path.read_text(errors="replace").splitlines()
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if number == len(lines):
                warn(
                    f"WARNING: {path}: skipping its last line {number}, torn by a crash while it "
                    f"was written ({e}): {line[:80]!r}"
                )
                break
            raise SetupError(
                f"{path}: line {number} is not a JSON object ({e}): {line[:80]!r}. Fix: repair or "
                "delete that line (each line is one log or eval record)."
            ) from None
        out.append((line, record))
    return out


def trim_metrics(path: Path, step: int, *, warn: Callable[[str], None] = _stderr) -> None:
    """Keeps the lines of steps ``<= step``, rewriting the file atomically if any other."""
    if not path.exists():
        return
    rows = read_metrics(path, warn=warn)
    keep = [line for line, record in rows if record.get("step", 0) <= step]
    text = "".join(line + "\n" for line in keep)
    if text == path.read_text(errors="replace"):
        return
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        half = len(keep) // 2
        f.write("".join(line + "\n" for line in keep[:half]))
        f.flush()
        faults.kill_if("during_metrics_rewrite", step)
        f.write("".join(line + "\n" for line in keep[half:]))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
