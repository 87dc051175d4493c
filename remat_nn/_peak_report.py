"""The parts of :func:`remat_nn.explain_peak`'s report: a buffer live at XLA's peak
(:class:`Buffer`) and its categories, the report's text tables, its timeline figure and the
durable write of its JSON.

The report itself (:class:`remat_nn.PeakReport`), the compile and the attribution of each buffer
to a category, a checkpoint name and a source line: :mod:`remat_nn._peak`; XLA's dump is read by
:mod:`remat_nn._xla_dump`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat_nn._memory import format_bytes

__all__ = ["CATEGORIES", "FRAGMENTATION", "Buffer"]

FRAGMENTATION = "fragmentation"
CATEGORIES = (
    "argument",
    "output",
    "saved residual",
    "recomputed",
    "gradient",
    "transient",
    FRAGMENTATION,
)


@dataclass(frozen=True)
class Buffer:
    """One buffer counted at the peak.

    Attributes:
      value: XLA's HLO value (``instruction{shape index}``), or the allocation for an argument,
        an output or the fragmentation row.
      nbytes: bytes it adds to the peak (an aliased value's bytes count once).
      shape: its HLO shape, e.g. ``f32[8,128]``.
      category: ``argument: <role>``, ``output``, ``recomputed`` (a value JAX's remat recomputes
        in the backward pass), ``gradient`` (any other value of the backward pass), ``saved
        residual`` (any other value the backward pass reads), ``transient`` or
        ``fragmentation``.
      name: the ``checkpoint_name``, the argument's pytree path, or None.
      source: ``file:line`` of the defining instruction's innermost frame, or "".
      op_name: XLA's op_name metadata (JAX's name stack).
      live: its live range ``(start, end)`` in the flattened schedule (inclusive).
      holds: for an output allocation, the category of the value in it at the peak (a
        backward temp XLA places in an output buffer before the output is written), else "".
    """

    value: str
    nbytes: int
    shape: str
    category: str
    name: str | None
    source: str
    op_name: str
    live: tuple[int, int]
    holds: str = ""

    @property
    def label(self) -> str:
        """The name, else the op (last part of op_name), else the value."""
        if self.name:
            return self.name
        return f"({self.op_name.rsplit('/', 1)[-1] or self.value})"


def atomic_write(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def figure(report: Any, title: str) -> Any:
    """A :class:`remat_nn.PeakReport`'s timeline as a matplotlib ``Figure``."""
    from matplotlib.figure import Figure

    mib = 1024 * 1024
    cats = [c for c in report.timeline if any(report.timeline[c])]
    xs = range(len(report.schedule))
    fig = Figure(figsize=(9, 4))
    ax = fig.subplots()
    ax.stackplot(xs, *[[v / mib for v in report.timeline[c]] for c in cats], labels=cats)
    ax.axvline(report.peak_index, color="k", linestyle="--", linewidth=1)
    ax.axhline(report.compiled.peak_bytes / mib, color="r", linestyle=":", linewidth=1)
    ax.annotate(
        f"peak {format_bytes(report.peak_bytes)} at {report.peak_index}"
        f" (XLA: {format_bytes(report.compiled.peak_bytes)}, dotted)",
        (report.peak_index, report.compiled.peak_bytes / mib),
        xytext=(5, -12),
        textcoords="offset points",
        fontsize=8,
    )
    ax.set_xlabel("XLA schedule index (flattened: loop bodies at the loop's place)")
    ax.set_ylabel("live MiB")
    ax.set_title(title or "live bytes over XLA's schedule")
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    return fig


def rows_text(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
    return "\n".join([line(head), *(line(r) for r in rows)])


def table(title: str, key: str, groups: Mapping[str, Mapping[str, Any]]) -> str:
    def shapes(s: set[str]) -> str:
        s2 = sorted(s)
        return ", ".join(s2[:3]) + (f" +{len(s2) - 3}" if len(s2) > 3 else "")

    rows = [
        (k, shapes(g["shapes"]), str(g["count"]), format_bytes(g["bytes"]))
        for k, g in groups.items()
    ]
    return f"{title}:\n" + rows_text((key, "shape", "count", "bytes"), rows)
