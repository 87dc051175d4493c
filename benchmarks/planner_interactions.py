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

``python -m benchmarks planner_interactions`` (the full model, ~8 min on 2 cores; part of
``all``) or ``--quick`` (the quick transformer, 4 names). Nothing is timed; memory only, from
XLA's compiled memory analysis on this backend.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks._common import Result, Target  # noqa: E402
from remat_nn import format_bytes  # noqa: E402

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
        label = f"order-{order} least squares on all sets ({x.shape[1]} terms)"
        out.append((label, None, fitted.__getitem__))
    return out


def errors(
    temps: dict[Subset, int], stacks: dict[str, int], names: Sequence[str]
) -> list[tuple[str, int | None, np.ndarray, np.ndarray]]:
    """``(model, compiles it needs, predicted, compiled)`` over the sets of >= 2 names."""
    multi = [s for s in temps if len(s) >= 2]
    compiled = np.array([temps[s] for s in multi], float)
    return [
        (label, compiles, np.array([predict(s) for s in multi]), compiled)
        for label, compiles, predict in models(temps, stacks, names)
    ]


def _relative(predicted: np.ndarray, compiled: np.ndarray) -> np.ndarray:
    return np.abs(predicted - compiled) / compiled


def _table(results: list[tuple[str, int | None, np.ndarray, np.ndarray]]) -> str:
    rows = [
        "| model | compiles it needs | largest error | 90th percentile | sets over 5% |",
        "|---|--:|--:|--:|--:|",
    ]
    for label, compiles, predicted, compiled in results:
        err = _relative(predicted, compiled)
        need = "oracle (all)" if compiles is None else str(compiles)
        rows.append(
            f"| {label} | {need} | {err.max():.1%} | {np.quantile(err, 0.9):.1%} | "
            f"{int((err > 0.05).sum())} of {len(err)} |"
        )
    return "\n".join(rows)


def table(temps: dict[Subset, int], stacks: dict[str, int], names: Sequence[str]) -> str:
    """Markdown: each model's largest and 90th-percentile error over the sets of >= 2 names."""
    return _table(errors(temps, stacks, names))


def run(quick: bool = False) -> Result:
    config, names = (wl.LM_QUICK, QUICK_NAMES) if quick else (wl.LM_FULL, NAMES)
    model = wl.lm(config)
    save_all = rn.Plan(save=names)
    by_name = rn.memory_report(
        lambda p, t: model.loss(p, t, policy=save_all), model.params, model.tokens
    ).by_name()
    stacks = {n: by_name.get(n, {}).get("bytes", 0) for n in names}
    temps = compile_subsets(model, names)
    floor = temps[frozenset()]
    multi = sum(len(s) >= 2 for s in temps)
    results = errors(temps, stacks, names)  # fits the oracles once, for the table and targets
    md = [
        f"{config}: the gradient compiled with every subset of {len(names)} names saved "
        f"({', '.join(names)}; the rest recomputed). {len(temps)} sets compiled; every name "
        f"recomputed {format_bytes(floor)}; least {format_bytes(min(temps.values()))}, most "
        f"{format_bytes(max(temps.values()))}. Errors are |predicted - compiled| / compiled over "
        f"the {multi} sets of two names or more; 'oracle' models are fitted on every compiled "
        "set, which no planner has.",
        "",
        _table(results),
    ]
    _, calibration, predicted, compiled = results[0]  # the planner's model
    err = _relative(predicted, compiled)
    oracle = next(r for r in results if r[0].startswith("order-3"))
    oracle_err = _relative(oracle[2], oracle[3])
    targets = [
        Target(
            f"the planner's memory model ({calibration} compiles) within 5% on every set of "
            ">= 2 names saved",
            bool(err.max() <= 0.05),
            f"largest {err.max():.1%}, 90th percentile {np.quantile(err, 0.9):.1%}, "
            f"{int((err > 0.05).sum())} of {len(err)} sets over 5% (order-3 oracle: largest "
            f"{oracle_err.max():.1%})",
        )
    ]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, _, pred, comp in results[:2] + [oracle]:
        ax.scatter(comp / 2**20, pred / 2**20, s=10, alpha=0.6, label=label)
    lo, hi = min(temps.values()) / 2**20, max(temps.values()) / 2**20
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set(xlabel="compiled temp (MiB)", ylabel="predicted temp (MiB)")
    ax.set_title(f"memory models over every set of >= 2 names ({multi} sets)")
    ax.legend(fontsize=7)
    return Result("planner_interactions", "\n".join(md), {"planner_interactions.png": fig}, targets)
