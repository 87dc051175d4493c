"""What every benchmark shares: timing, the machine record, and writing results."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from remat_nn._timing import timing_rounds

RESULTS = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parents[1] / "README.md"
#: The README lines between which a full run writes the table of targets.
README_MARKERS = ("<!-- benchmarks:summary begin -->", "<!-- benchmarks:summary end -->")


@dataclass
class Target:
    """A stated target: the claim, the verdict, the measured figure and the noise beside it.

    ``met`` is a bool for exact measurements (memory, counts) or a verdict string from
    :func:`verdict` for timings, where a margin inside the measured noise is "within noise".
    """

    claim: str
    met: bool | str
    figure: str
    noise: str = "exact"

    @property
    def verdict(self) -> str:
        if isinstance(self.met, str):
            return self.met
        return "yes" if self.met else "NO"


@dataclass
class Result:
    """One benchmark's output: a markdown body, PNG figures and the targets it checks."""

    name: str
    markdown: str
    figures: dict[str, Any] = field(default_factory=dict)  # file name -> matplotlib Figure
    targets: list[Target] = field(default_factory=list)


@dataclass
class Paired:
    """Times of several functions in the same shuffled rounds, one of them timed twice.

    ``samples[k]`` holds ``k``'s seconds per call in each round; ``samples[AGAIN]`` is the
    ``itself`` function run as a second entry of every round. A ratio is the median over rounds
    of two times taken in the same round (a slow spell spanning a round cancels); the ratio of
    ``itself`` to its second entry shows the noise such a ratio still carries.
    """

    samples: dict[str, list[float]]
    itself: str

    def ratio(self, a: str, b: str) -> float:
        """Median over rounds of ``a``'s time over ``b``'s in the same round."""
        return statistics.median(
            x / y for x, y in zip(self.samples[a], self.samples[b], strict=True)
        )

    def seconds(self, k: str) -> float:
        """Median seconds per call of ``k`` over the rounds."""
        return statistics.median(self.samples[k])

    @property
    def rounds(self) -> int:
        return len(self.samples[self.itself])

    @property
    def noise(self) -> float:
        """Relative noise of a paired ratio: the same function against itself.

        The larger of its median's distance from 1 and the half-width of a 95% interval of that
        median (1.96 x the median's standard error, 1.2533 x the ratios' robust standard
        deviation 1.4826 x MAD, over the square root of the rounds).
        """
        r = [x / y for x, y in zip(self.samples[AGAIN], self.samples[self.itself], strict=True)]
        m = statistics.median(r)
        mad = statistics.median(abs(x - m) for x in r)
        return max(abs(m - 1), 1.96 * 1.2533 * 1.4826 * mad / len(r) ** 0.5)

    def noise_text(self) -> str:
        return f"±{self.noise:.1%} ({self.itself} vs itself, {rounds_text(self.rounds)})"


def rounds_text(n: int) -> str:
    return f"{n} round" + ("s" if n != 1 else "")


#: The key of the second entry of the ``itself`` function in :class:`Paired` samples.
AGAIN = "(again)"


def paired(
    fns: dict[str, Callable[[], Any]],
    *,
    itself: str,
    rounds: int,
    warmup: int = 1,
    min_seconds: float = 0.0,
) -> Paired:
    """Times ``fns`` in ``rounds`` shuffled rounds with ``fns[itself]`` run twice per round.

    The shared implementation is :func:`remat_nn._timing.timing_rounds`; ``min_seconds`` repeats
    a fast function within its slot so that its time is not lost in timer resolution.
    """
    entries = {**fns, AGAIN: fns[itself]}
    samples, _ = timing_rounds(
        entries, rounds=rounds, warmup=warmup, min_seconds=min_seconds, shuffle=True
    )
    return Paired(samples, itself)


def verdict(value: float, bound: float, noise: float, *, at_most: bool) -> str:
    """ "yes" / "NO" for ``value <= bound`` (or ``>=``), "within noise" when the margin between
    the two is inside ``noise`` (relative)."""
    if abs(value - bound) <= noise * abs(bound):
        return "within noise"
    return "yes" if (value <= bound if at_most else value >= bound) else "NO"


def machine() -> str:
    """A markdown line naming the machine, the versions and the date."""
    import flax
    import jaxlib
    import optax

    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs, {platform.processor() or 'cpu'}, "
        f"backend {jax.default_backend()} ({len(jax.devices())} devices); Python "
        f"{platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"flax {flax.__version__}, optax {optax.__version__}; "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    )


def command(names: list[str], quick: bool) -> str:
    """The command that reproduces a result."""
    return " ".join(["python -m benchmarks", *names, *(["--quick"] if quick else [])])


def write(result: Result, *, quick: bool, out: Path = RESULTS) -> Path:
    """Writes ``<out>/<name>.md`` (+ PNGs) with the machine and the command; returns the .md."""
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if quick else ""
    lines = [
        f"# {result.name}",
        "",
        f"Reproduce: `{command([result.name], quick)}`  ",
        f"Machine: {machine()}",
        "",
        result.markdown,
    ]
    if result.targets:
        lines += ["", TARGETS, "", TARGET_HEAD, "|---|---|---|---|"]
        lines += [f"| {t.claim} | {t.verdict} | {t.figure} | {t.noise} |" for t in result.targets]
    for fname, fig in result.figures.items():
        stem, ext = os.path.splitext(fname)
        path = out / f"{stem}{suffix}{ext}"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        lines += ["", f"![{stem}]({path.name})"]
    md = out / f"{result.name}{suffix}.md"
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), file=sys.stdout, flush=True)
    return md


TARGETS = "## Targets"
TARGET_HEAD = "| target | verdict | measured | noise |"


def targets_of(md: Path) -> list[list[str]]:
    """The rows of a result file's targets table: [claim, verdict, measured, noise] each."""
    lines = md.read_text().splitlines()
    if TARGETS not in lines or lines[lines.index(TARGETS) + 2] != TARGET_HEAD:
        return []  # no targets, or a file written before verdicts had their noise
    rows = []
    for line in lines[lines.index(TARGETS) + 4 :]:
        if not line.startswith("| "):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def summary_table(out: Path, names: list[str], *, quick: bool, link_prefix: str = "") -> str:
    """The targets of every result file in ``out`` as one markdown table (benchmark order)."""
    suffix = "_quick" if quick else ""
    lines = ["| benchmark | target | measured | noise | verdict |", "|---|---|---|---|---|"]
    for name in names:
        md = out / f"{name}{suffix}.md"
        if md.exists():
            for claim, met, figure, noise in targets_of(md):
                link = f"[{name}]({link_prefix}{md.name})"
                lines.append(f"| {link} | {claim} | {figure} | {noise} | {met} |")
    return "\n".join(lines)


def write_summary(out: Path, names: list[str], *, quick: bool) -> Path:
    """Writes ``<out>/summary.md``: every target of the result files, as the README shows it."""
    suffix = "_quick" if quick else ""
    path = out / f"summary{suffix}.md"
    text = [
        "# Benchmark targets",
        "",
        f"Generated by `{command(['all'], quick)}` from the targets of each result file "
        "(each file states the machine, the versions and the command). A timing verdict is "
        '"within noise" when its margin to the target is inside the noise measured beside it: '
        "the same executable timed against itself in the same shuffled rounds.",
        "",
        summary_table(out, names, quick=quick),
    ]
    path.write_text("\n".join(text) + "\n")
    return path


def paste_into_readme(table: str, readme: Path = README) -> None:
    """Replaces the lines between the README's :data:`README_MARKERS` with ``table``."""
    begin, end = README_MARKERS
    lines = readme.read_text().splitlines()
    if begin not in lines or end not in lines or lines.index(begin) > lines.index(end):
        raise ValueError(f"{readme} has no '{begin}' ... '{end}' block to write the table into")
    lines[lines.index(begin) + 1 : lines.index(end)] = table.splitlines()
    readme.write_text("\n".join(lines) + "\n")
