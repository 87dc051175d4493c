"""Every benchmark runs end to end in quick mode (one timing round) and writes its results with
the command, and the README's table of targets has the rows the benchmark emits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _common
from benchmarks.__main__ import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]


def _shape(claim: str) -> str:
    # Quick and full runs state the same claim at different sizes ("depth 32" / "depth 512").
    return re.sub(r"\d[\d,.]*", "N", claim)


def _readme_rows(name: str) -> list[str]:
    """Claims of the README table rows that link benchmarks/results/<name>.md."""
    link = f"[{name}](benchmarks/results/{name}.md)"
    lines = (ROOT / "README.md").read_text().splitlines()
    rows = [ln for ln in lines if ln.startswith(f"| {link}")]
    return [row.strip().strip("|").split(" | ")[1] for row in rows]


@pytest.fixture(scope="session")
def benchmark_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The benchmarks' environment: the suite's (``XLA_FLAGS``, the CPU platform: conftest.py)
    and one JAX compilation cache for every benchmark process of the session.

    Benchmarks compile programs in common (the transformer's presets and init: transformer,
    planner, efficiency, strategies, donation; the quick RevNet-38: revnet, efficiency), and
    only the first to run compiles them. Under xdist the cache is in the session's directory,
    which the workers share (an entry read while another process writes it fails to load: JAX
    warns and compiles). Every entry is kept (no minimum compile time). The trainer, which sets
    its cache directory from the config only when none is set, writes here, not to the user's.
    """
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "jax_cache"
    cache.mkdir(exist_ok=True)
    return os.environ | {
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


# The transformer first: the planner and efficiency benchmarks then find its compiles in the
# cache. Then the longest first, so that `-n 2` ends its two workers together.
_FIRST = ("transformer", "revnet", "strategies", "planner", "efficiency", "trainer")
_ORDER = sorted(BENCHMARKS, key=lambda n: _FIRST.index(n) if n in _FIRST else len(_FIRST))


@pytest.mark.parametrize("name", _ORDER)
def test_quick_benchmark_writes_results_and_the_readme_rows(
    name: str, tmp_path: Path, benchmark_env: dict[str, str]
) -> None:
    # One process per benchmark, so that `-n 2` spreads them; a benchmark that reuses another's
    # measurements in `python -m benchmarks all` (planner, efficiency) takes them itself here.
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", name, "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=benchmark_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    md = tmp_path / f"{name}_quick.md"
    assert md.exists(), f"{name}: no {md.name}"
    text = md.read_text()
    assert "Reproduce:" in text, f"{name}: no reproduce line"
    pngs = [ln.split("(")[1].rstrip(")") for ln in text.splitlines() if ln.startswith("![")]
    assert pngs, f"{name}: no figure"
    for png in pngs:
        assert (tmp_path / png).stat().st_size > 0, f"{name}: {png} missing or empty"
    # Every timing verdict carries its noise; the summary lists this benchmark's targets.
    targets = _common.targets_of(md)
    for claim, met, _figure, noise in targets:
        assert met in ("yes", "NO", "within noise") or met.startswith("inconclusive"), (claim, met)
        assert noise == "exact" or "vs itself" in noise, (claim, noise)
    summary = (tmp_path / "summary_quick.md").read_text()
    assert all(claim in summary for claim, *_ in targets)
    # The README's table is pasted from a full run: the same targets, in the same order.
    readme = _readme_rows(name)
    quick_only = {"revnet": 1}.get(name, 0)  # the 1/8 memory target is full-size only
    assert [_shape(c) for c in readme[quick_only:]] == [_shape(c) for c, *_ in targets], name
    assert len(readme) == len(targets) + quick_only, name
