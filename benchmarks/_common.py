"""What every benchmark shares: timing, the machine record, and writing results."""

from __future__ import annotations

import datetime
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Target:
    """A stated target: the claim, whether it was met, and the measured figure."""

    claim: str
    met: bool
    figure: str


@dataclass
class Result:
    """One benchmark's output: a markdown body, PNG figures and the targets it checks."""

    name: str
    markdown: str
    figures: dict[str, Any] = field(default_factory=dict)  # file name -> matplotlib Figure
    targets: list[Target] = field(default_factory=list)


def median_seconds(fn: Callable[[], Any], *, warmup: int = 2, reps: int = 7) -> float:
    """Median wall time of ``fn()`` (blocked until ready) after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_samples(
    fns: dict[str, Callable[[], Any]],
    *,
    warmup: int = 2,
    rounds: int = 9,
    min_seconds: float = 0.05,
    shuffle: bool = False,
) -> dict[str, list[float]]:
    """Wall time per call of each ``fns[k]()`` in each of ``rounds`` interleaved rounds.

    Each round times every function once (repeating a call until ``min_seconds`` passed, so
    millisecond steps are not lost in timer noise); interleaving spreads the load of a shared
    machine over all of them alike, so their ratios hold even when absolute times drift.
    ``shuffle`` runs each round in a fresh (seeded) random order, so that no function always
    follows the same one.
    """
    reps = {}
    for k, fn in fns.items():
        for _ in range(warmup):
            jax.block_until_ready(fn())
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        reps[k] = max(1, int(min_seconds / max(time.perf_counter() - t0, 1e-6)))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    rng = random.Random(0)
    for _ in range(rounds):
        for k in rng.sample(list(fns), len(fns)) if shuffle else fns:
            t0 = time.perf_counter()
            for _ in range(reps[k]):
                out = fns[k]()
            jax.block_until_ready(out)
            samples[k].append((time.perf_counter() - t0) / reps[k])
    return samples


def interleaved_seconds(fns: dict[str, Callable[[], Any]], **kwargs: Any) -> dict[str, float]:
    """Median of :func:`interleaved_samples` per function (same arguments)."""
    return {k: statistics.median(v) for k, v in interleaved_samples(fns, **kwargs).items()}


def paired_ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``a``'s time over ``b``'s in the same round: a slow spell of the
    shared machine that spans a round cancels."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))


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
        lines += ["", "## Targets", "", "| target | met | measured |", "|---|---|---|"]
        lines += [
            f"| {t.claim} | {'yes' if t.met else 'NO'} | {t.figure} |" for t in result.targets
        ]
    for fname, fig in result.figures.items():
        stem, ext = os.path.splitext(fname)
        path = out / f"{stem}{suffix}{ext}"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        lines += ["", f"![{stem}]({path.name})"]
    md = out / f"{result.name}{suffix}.md"
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), file=sys.stdout, flush=True)
    return md
