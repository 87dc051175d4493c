"""``python -m benchmarks all --quick`` runs every benchmark end to end (one timing round), each
writes its results with the command, and the README's table of targets has the rows each emits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _common
from benchmarks.__main__ import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]


def _shape(claim: str) -> str:
    # Quick and full runs state the same claim at different sizes ("depth 32" / "depth 512").
    return re.sub(r"\d[\d,.]*", "N", claim)


def _readme_rows(name: str) -> list[str]:
    """Claims of the README table rows that link benchmarks/results/<name>.md."""
    link = f"[{name}](benchmarks/results/{name}.md)"
    lines = (ROOT / "README.md").read_text().splitlines()
    rows = [ln for ln in lines if ln.startswith(f"| {link}")]
    return [row.strip().strip("|").split(" | ")[1] for row in rows]


@pytest.mark.slow
def test_quick_benchmarks_write_results_and_the_readme_rows(tmp_path: Path) -> None:
    # `python -m benchmarks all --quick` (the README's command at tiny sizes), in one process: the
    # benchmarks share what they compile in common (the transformer's presets and init:
    # transformer, planner, efficiency, strategies, donation; the quick RevNet-38: revnet,
    # efficiency) and planner and efficiency reuse the transformer benchmark's measurements, as in
    # a full run (about 180 CPU-s against 184 for one process per benchmark: one run each). The
    # suite's compilation cache (conftest.py) serves this process and the trainer benchmark's
    # children, which would otherwise write to the user's (the suite's XLA flags reach them all).
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "all", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = (out / "summary_quick.md").read_text()
    for name in BENCHMARKS:
        _check_results(name, out, summary)


def _check_results(name: str, out: Path, summary: str) -> None:
    md = out / f"{name}_quick.md"
    assert md.exists(), f"{name}: no {md.name}"
    text = md.read_text()
    assert "Reproduce:" in text, f"{name}: no reproduce line"
    pngs = [ln.split("(")[1].rstrip(")") for ln in text.splitlines() if ln.startswith("![")]
    assert pngs, f"{name}: no figure"
    for png in pngs:
        assert (out / png).stat().st_size > 0, f"{name}: {png} missing or empty"
    # Every timing verdict carries its noise; the summary lists this benchmark's targets.
    targets = _common.targets_of(md)
    for claim, met, _figure, noise in targets:
        assert met in ("yes", "NO", "within noise") or met.startswith("inconclusive"), (
            name,
            claim,
            met,
        )
        assert noise == "exact" or "vs itself" in noise, (name, claim, noise)
    assert all(claim in summary for claim, *_ in targets), name
    # The README's table is pasted from a full run: the same targets, in the same order.
    readme = _readme_rows(name)
    quick_only = {"revnet": 1}.get(name, 0)  # the 1/8 memory target is full-size only
    assert [_shape(c) for c in readme[quick_only:]] == [_shape(c) for c, *_ in targets], name
    assert len(readme) == len(targets) + quick_only, name


def test_a_full_run_writes_the_table_between_the_readme_markers(tmp_path: Path) -> None:
    begin, end = _common.README_MARKERS
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{begin}\n| old | row |\n| old | row 2 |\n{end}\nafter\n")
    _common.paste_into_readme("| new | row |", readme)
    assert readme.read_text() == f"# title\n\nbefore\n{begin}\n| new | row |\n{end}\nafter\n"
    readme.write_text(f"no markers\n{end}\n{begin}\n")  # end before begin: refused, unchanged
    with pytest.raises(ValueError, match="benchmarks:summary begin"):
        _common.paste_into_readme("| new | row |", readme)
    assert readme.read_text() == f"no markers\n{end}\n{begin}\n"
