"""Plot a run's loss and accuracy curves: ``python -m train.plot RUN_DIR`` writes RUN_DIR/plot.png.

Reads ``metrics.jsonl`` (one JSON object per line: ``split`` train/eval, ``step``, ``loss``,
``accuracy``, ...).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.errors import SetupError
from train.metrics_file import read_metrics

__all__ = ["main", "plot_run"]


def _read(path: Path) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {"train": [], "eval": []}
    for _, r in read_metrics(path):  # a torn last line (a crash mid-write) is skipped, warning
        rows.setdefault(r.get("split", "train"), []).append(r)
    return rows


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Writes the loss / accuracy plot of ``run_dir`` and returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"train.plot: no metrics.jsonl in {run_dir}; is it a run dir?")
    rows = _read(metrics)
    # The loss, and accuracy or the loss function's first metric (train.losses).
    fixed = {"split", "step", "loss", "grad_norm", "lr", "steps_per_sec", "examples_per_sec"}
    named = sorted({k for r in rows.get("eval", []) for k in r} - fixed - {"epoch", "skipped"})
    second = "accuracy" if "accuracy" in named or not named else named[0]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("loss", second), strict=True):
        for split, style in (("train", "-"), ("eval", "o-")):
            pts = [(r["step"], r[key]) for r in rows.get(split, []) if key in r]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, label=f"{split} {key}", markersize=4)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
    if second == "accuracy":
        axes[1].set_ylim(0, 1.02)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    path = Path(out) if out else run_dir / "plot.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__)
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    parser.add_argument("--out", help="output PNG (default RUN_DIR/plot.png)")
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except (FileNotFoundError, SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
