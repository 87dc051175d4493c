"""How well can any memory model over kept names predict XLA's temp bytes? An exhaustive study.

``rn.plan_for_budget`` predicts a plan's compiled temp bytes from a few calibration compiles
(every name recomputed, each name saved alone). Issue 17 asked for a prediction error of at most
5% on every plan it compiles, with at most 34 compiles per budget. This study compiles the
gradient of the ``planner`` benchmark's scanned transformer under EVERY subset of its named
activations saved (2^8 = 256 compiles of the full model), and measures, on all of them:

  - the planner's model (floor + saved stacks - the largest single-name working-set reduction,
    from the floor and the 8 single-name compiles), without its nearest-compiled-plan correction;
  - a second-order model from the floor, the singles and all 28 pairs (37 compiles, more than the
    budget allows), which is exact on every set of at most two names;
  - least-squares fits on all 256 compiled sets (oracles: no planner can have these), of
    first-, second- and third-order polynomials in the kept-name indicators.

``python -m benchmarks.planner_interactions`` (the full model, ~9 min on 2 cores) or ``--quick``
(the quick transformer, 4 names). Nothing is timed; memory only, from XLA's compiled memory
analysis on this backend.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

import remat_nn as rn
from benchmarks import _workloads as wl
from remat_nn._memory import format_bytes

NAMES = (
    "attention_scores",
    "context",
    "key_proj",
    "mlp_hidden",
    "mlp_in",
    "out_proj",
    "query_proj",
    "value_proj",
)
QUICK_NAMES = NAMES[1:3] + NAMES[5:7]  # context, key_proj, out_proj, query_proj

Subset = frozenset[str]


def compile_subsets(
    model: wl.LM, names: Sequence[str], say: Callable[[str], None] = print
) -> dict[Subset, int]:
    """Temp bytes of the gradient with each subset of ``names`` saved (the rest recomputed)."""
    temps: dict[Subset, int] = {}
    t0 = time.perf_counter()
    for k in range(len(names) + 1):
        for kept in itertools.combinations(names, k):
            plan = rn.Plan(save=kept)
            grad = jax.grad(lambda p, t, plan=plan: model.loss(p, t, policy=plan))
            temps[frozenset(kept)] = rn.compiled_memory(
                grad, model.params, model.tokens
            ).temp_size_in_bytes
        say(f"  sets of {k} names compiled ({len(temps)} so far, {time.perf_counter() - t0:.0f} s)")
    return temps


def _indicators(sets: Sequence[Subset], names: Sequence[str], order: int) -> np.ndarray:
    cols = [np.ones(len(sets))]
    for k in range(1, order + 1):
        for group in itertools.combinations(names, k):
            cols.append(np.array([float(set(group) <= s) for s in sets]))
    return np.stack(cols, axis=1)


def models(
    temps: dict[Subset, int], stacks: dict[str, int], names: Sequence[str]
) -> list[tuple[str, int | None, Callable[[Subset], float]]]:
    """``(model, compiles it needs, predict)`` for each model of the study (None: an oracle)."""
    floor = temps[frozenset()]
    single = {n: temps[frozenset([n])] for n in names}
    reduction = {n: max(0, stacks[n] - (single[n] - floor)) for n in names}
    weight = {n: max(stacks[n], single[n] - floor) for n in names}

    def planner(s: Subset) -> float:
        return floor + sum(weight[n] for n in s) - max((reduction[n] for n in s), default=0)

    def second_order(s: Subset) -> float:
        v = floor + sum(single[n] - floor for n in s)
        for a, b in itertools.combinations(sorted(s), 2):
            v += temps[frozenset((a, b))] - single[a] - single[b] + floor
        return v

    calibration = 2 + len(names)  # no remat, every name recomputed, each name saved alone
    pairs = len(names) * (len(names) - 1) // 2
    out: list[tuple[str, int | None, Callable[[Subset], float]]] = [
        ("planner's model (floor, singles)", calibration, planner),
        ("second order (floor, singles, all pairs)", calibration + pairs, second_order),
    ]
    sets = list(temps)
    y = np.array([temps[s] for s in sets], float)
    for order in (1, 2, 3):
        x = _indicators(sets, names, order)
        w = np.linalg.lstsq(x, y, rcond=None)[0]
        fitted = dict(zip(sets, x @ w, strict=True))
        out.append((f"order-{order} least squares on all sets ({x.shape[1]} terms)", None,
                    fitted.__getitem__))  # fmt: skip
    return out


def table(temps: dict[Subset, int], stacks: dict[str, int], names: Sequence[str]) -> str:
    """Markdown: each model's largest and 90th-percentile error over the sets of >= 2 names."""
    multi = [s for s in temps if len(s) >= 2]
    rows = [
        "| model | compiles it needs | largest error | 90th percentile | sets over 5% |",
        "|---|--:|--:|--:|--:|",
    ]
    for label, compiles, predict in models(temps, stacks, names):
        errors = np.array([abs(predict(s) - temps[s]) / temps[s] for s in multi])
        need = "oracle (all)" if compiles is None else str(compiles)
        rows.append(
            f"| {label} | {need} | {errors.max():.1%} | {np.quantile(errors, 0.9):.1%} | "
            f"{int((errors > 0.05).sum())} of {len(multi)} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.planner_interactions", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="the quick transformer, 4 names")
    args = parser.parse_args(argv)
    config, names = (wl.LM_QUICK, QUICK_NAMES) if args.quick else (wl.LM_FULL, NAMES)
    model = wl.lm(config)
    command = "python -m benchmarks.planner_interactions" + (" --quick" if args.quick else "")
    print(f"Reproduce: `{command}`  \n{config}; backend {jax.default_backend()}", flush=True)
    save_all = rn.Plan(save=names)
    by_name = rn.memory_report(
        lambda p, t: model.loss(p, t, policy=save_all), model.params, model.tokens
    ).by_name()
    stacks = {n: by_name.get(n, {}).get("bytes", 0) for n in names}
    temps = compile_subsets(model, names)
    floor = temps[frozenset()]
    print(
        f"\n{len(temps)} sets compiled; every name recomputed {format_bytes(floor)}; least "
        f"{format_bytes(min(temps.values()))}, most {format_bytes(max(temps.values()))}. "
        f"Errors are |predicted - compiled| / compiled over the {sum(len(s) >= 2 for s in temps)} "
        "sets of two names or more.\n"
    )
    print(table(temps, stacks, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
