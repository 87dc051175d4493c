"""``python -m benchmarks [all | NAME ...] [--quick]``: memory and speed evidence, to results/.

Memory figures come from XLA's compiled memory analysis (exact, CPU-friendly). Times are paired:
every function compared runs once per round, rounds in a fresh random order, a ratio is the
median over rounds of two times from the same round, and the baseline timed against itself in
the same rounds gives the noise printed beside each verdict. Each result file records the
machine, the versions and the command; ``summary.md`` collects every target, and the README's
table is the one printed at the end: a full run into ``results/`` writes it into the README too.
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
    "remat_scan": "benchmarks.remat_scan",
    "strategies": "benchmarks.strategies",
    "invertible": "benchmarks.invertible",
    "revnet": "benchmarks.revnet",
    "drift_cost": "benchmarks.drift_cost",
    "transformer": "benchmarks.transformer",
    "donation": "benchmarks.donation",
    "efficiency": "benchmarks.efficiency",
    "planner": "benchmarks.planner",
    "planner_interactions": "benchmarks.planner_interactions",
    "trainer": "benchmarks.trainer",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "names", nargs="*", help=f"'all' (the default) or some of {list(BENCHMARKS)}"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds, for tests)")
    parser.add_argument("--out", type=Path, default=_common.RESULTS, help="results directory")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS and n != "all"]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose 'all' or from {list(BENCHMARKS)}")
    names = list(BENCHMARKS) if not args.names or "all" in args.names else args.names
    start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        result = importlib.import_module(BENCHMARKS[name]).run(quick=args.quick)
        path = _common.write(result, quick=args.quick, out=args.out)
        _common.write_summary(args.out, list(BENCHMARKS), quick=args.quick)
        print(f"\n[{name}: {time.perf_counter() - t0:.0f}s -> {path}]\n", flush=True)
    print(f"[{', '.join(names)}: {time.perf_counter() - start:.0f}s in all]", flush=True)
    table = _common.summary_table(
        args.out, list(BENCHMARKS), quick=args.quick, link_prefix="benchmarks/results/"
    )
    print("\nThe README's table (benchmarks/results/summary.md):\n", flush=True)
    print(table, flush=True)
    if not args.quick and args.out.resolve() == _common.RESULTS:
        _common.paste_into_readme(table)
        print(f"\n(written into {_common.README.name}, between its benchmarks:summary lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
