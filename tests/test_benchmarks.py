"""Every benchmark runs end to end in quick mode (one timing round) and writes its results with
the command, and the README's table of targets has the rows the benchmark emits."""

from __future__ import annotations

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


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_quick_benchmark_writes_results_and_the_readme_rows(name: str, tmp_path: Path) -> None:
    # One process per benchmark, so that `-n 2` spreads them; a benchmark that reuses another's
    # measurements in `python -m benchmarks all` (planner, efficiency) takes them itself here.
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", name, "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
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
