"""``python -m benchmarks [NAME ...] [--quick]``: memory and speed evidence, written to results/.

Memory figures come from XLA's compiled memory analysis (exact, CPU-friendly); times are medians
of repeated steps after warm-up, reported as ratios against the baseline measured in the same run.
Each result file records the machine, the versions and the command that reproduces it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from benchmarks import _common

#: benchmark name -> module (each has ``run(quick: bool) -> Result``).
BENCHMARKS = {
    "depth": "benchmarks.depth",
    "invertible": "benchmarks.invertible",
    "revnet": "benchmarks.revnet",
    "transformer": "benchmarks.transformer",
    "donation": "benchmarks.donation",
    "efficiency": "benchmarks.efficiency",
    "planner": "benchmarks.planner",
    "trainer": "benchmarks.trainer",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "names", nargs="*", help=f"benchmarks to run (default all): {list(BENCHMARKS)}"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds, for tests)")
    parser.add_argument("--out", type=Path, default=_common.RESULTS, help="results directory")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    for name in args.names or list(BENCHMARKS):
        t0 = time.perf_counter()
        result = importlib.import_module(BENCHMARKS[name]).run(quick=args.quick)
        path = _common.write(result, quick=args.quick, out=args.out)
        print(f"\n[{name}: {time.perf_counter() - t0:.0f}s -> {path}]\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
