"""Every benchmark runs end to end in quick mode and writes its results with the command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.__main__ import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmarks_write_results(tmp_path: Path) -> None:
    # One process for all of them, as `python -m benchmarks --quick` runs (the planner reuses
    # the transformer benchmark's measurements there).
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in BENCHMARKS:
        md = tmp_path / f"{name}_quick.md"
        assert md.exists(), f"{name}: no {md.name}"
        text = md.read_text()
        assert "Reproduce:" in text, f"{name}: no reproduce line"
        pngs = [line.split("(")[1].rstrip(")") for line in text.splitlines()
                if line.startswith("![")]  # fmt: skip
        assert pngs, f"{name}: no figure"
        for png in pngs:
            assert (tmp_path / png).stat().st_size > 0, f"{name}: {png} missing or empty"
