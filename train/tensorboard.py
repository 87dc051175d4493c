"""TensorBoard scalars beside metrics.jsonl: ``<run_dir>/tensorboard/``, written with tensorboardX.

metrics.jsonl is the record; the event files are derived from it. When a run starts, the event
directory is rebuilt from metrics.jsonl (which then holds the lines up to the restored step
only), in a temporary directory renamed into place, and the run appends to it: a resumed run
continues one stream with each step once, whatever a killed run had written past its last
checkpoint. Each line's numbers become scalars ``<split>/<key>`` (``train/loss``,
``eval/accuracy``) at its step. View with ``tensorboard --logdir <run_dir>/tensorboard``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

__all__ = ["DIRNAME", "TensorBoard"]

DIRNAME = "tensorboard"


class TensorBoard:
    """The run's event stream: rebuilt from ``metrics`` on open, then appended to by :meth:`record`.

    Args:
      run_dir: the run directory (process 0's).
      metrics: its metrics.jsonl (may not exist yet).
    """

    def __init__(self, run_dir: Path, metrics: Path):
        self.directory = run_dir / DIRNAME
        tmp = run_dir / f".{DIRNAME}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # a rebuild a killed run left
        # tensorboardX names a file by the second it opens it: the suffixes keep the history
        # apart from the file appended to next, and before it in the order TensorBoard reads.
        rebuilt = SummaryWriter(str(tmp), flush_secs=3600, filename_suffix=".1-history")
        for line in _lines(metrics):
            _add(rebuilt, line)
        rebuilt.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        os.replace(tmp, self.directory)
        self._writer = SummaryWriter(str(self.directory), flush_secs=3600, filename_suffix=".2-run")

    def record(self, split: str, step: int, values: Mapping[str, Any]) -> None:
        """Adds one metrics.jsonl line (and flushes, as metrics.jsonl does)."""
        _add(self._writer, {"split": split, "step": step, **values})
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _add(writer: SummaryWriter, line: Mapping[str, Any]) -> None:
    split, step = line.get("split", "train"), int(line["step"])
    for key, value in line.items():
        if key not in ("split", "step") and isinstance(value, int | float):
            writer.add_scalar(f"{split}/{key}", float(value), global_step=step)


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    # A torn last line (a kill while it was written) is no metric: skipped.
    if not path.exists():
        return
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and "step" in line:
            yield line
