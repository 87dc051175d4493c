"""Memory-budget planner: ``rn.plan_for_budget`` against the hand-written remat presets.

On the scanned transformer of the ``transformer`` benchmark, at budgets between the ``full``
preset's temp memory and no remat, the planner picks save / recompute per activation name (the
loss takes the candidate as the model's own remat plan, ``loss(params, tokens, *, policy)``).
For each budget: the plan, its compiled temp bytes (must fit), and its median step time against
the fastest preset that also fits, timed alternately in the same run.
"""

from __future__ import annotations

import statistics
import time

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks import transformer as tb  # noqa: E402
from benchmarks._common import Result, Target  # noqa: E402
from remat_nn._memory import format_bytes  # noqa: E402


def _alternate(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds of each ``fn()``, run in turn so that machine noise hits all alike."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _budgets(temps: dict[str, int], count: int) -> list[int]:
    """Budgets between distinct preset memories (midpoints), lowest first, ``count`` of them."""
    levels = sorted(set(temps.values()))
    mids = [(a + b) // 2 for a, b in zip(levels, levels[1:], strict=False)]
    if len(mids) > count:  # keep the lowest (only `full` fits there) and spread the rest
        step = (len(mids) - 1) / (count - 1)
        mids = [mids[round(i * step)] for i in range(count)]
    return mids


def _plan_text(plan: rn.Plan) -> str:
    return f"save [{', '.join(plan.save)}]" if plan.save else "save nothing (recompute all)"


def run(quick: bool = False) -> Result:
    config = wl.LM_QUICK if quick else wl.LM_FULL
    reps = 2 if quick else 5
    names = tb.QUICK_PRESETS if quick else tuple(tb.REMAT_PRESETS)
    presets = tb.measure(config, reps, names)  # cached when the transformer benchmark ran first
    model = wl.lm(config)
    # Offload presets move nothing on CPU: their memory is that of the matching save preset.
    temps = {p: r["temp"] for p, r in presets.items() if p not in tb.OFFLOAD_PRESETS}
    budgets = [(temps["full"] + temps["none"]) // 2] if quick else _budgets(temps, 5)
    steps = {p: jax.jit(model.grad_step(p)) for p in temps}

    # XLA:CPU has one memory space: an offloaded name stays in device memory, but the planner's
    # knapsack counts offload as zero device bytes (and ~1 ms at 16 GB/s), so on CPU it picks
    # offload, overshoots, and tightens only the saved bytes. Plan with save / recompute here.
    allow = ("save", "recompute") if jax.default_backend() == "cpu" else ("save", "offload",
                                                                           "recompute")  # fmt: skip
    rows, failed = [], []
    for budget in budgets:
        t0 = time.perf_counter()
        fitting = [p for p, t in temps.items() if t <= budget]
        fastest = min(fitting, key=lambda p: presets[p]["seconds"]) if fitting else None
        try:
            report = rn.plan_for_budget(
                model.loss, model.params, model.tokens, budget=budget, allow=allow
            )
        except rn.PlanError as e:
            print(f"budget {format_bytes(budget)}: {e}", flush=True)
            failed.append((budget, fitting, str(e)))
            continue
        plan_seconds = time.perf_counter() - t0
        plan_step = jax.jit(model.grad_step(report.plan))
        fns = {"plan": lambda s=plan_step: s(model.params, model.tokens)}
        if fastest is not None:
            fns[fastest] = lambda s=steps[fastest]: s(model.params, model.tokens)
        secs = _alternate(fns, reps)
        rows.append({"budget": budget, "report": report, "fitting": fitting, "fastest": fastest,
                     "plan_s": secs["plan"], "preset_s": secs.get(fastest),
                     "plan_seconds": plan_seconds})  # fmt: skip
        print(f"budget {format_bytes(budget)}: {_plan_text(report.plan)}, temp "
              f"{format_bytes(report.compiled_temp_bytes)}; {secs}", flush=True)  # fmt: skip

    lines = [
        f"Scanned transformer ({config}). Preset XLA temp bytes of the grad step: "
        + ", ".join(
            f"{p} {format_bytes(t)}" for p, t in sorted(temps.items(), key=lambda kv: kv[1])
        )
        + f". Budgets: midpoints between consecutive preset memories. Times: median of {reps} "
        f"runs, the plan and the fastest fitting preset alternating. Planner actions: "
        f"{', '.join(allow)} (on CPU offload moves nothing, so it is left out).",
        "",
        "| budget | planner's plan | compiled temp (predicted) | fits | presets that fit | "
        "fastest fitting preset | plan time / preset time | planning took |",
        "|--:|---|--:|---|---|---|--:|--:|",
    ]
    for r in rows:
        rep = r["report"]
        ratio = r["plan_s"] / r["preset_s"] if r["preset_s"] else float("nan")
        lines.append(
            f"| {format_bytes(r['budget'])} | {_plan_text(rep.plan)} | "
            f"{format_bytes(rep.compiled_temp_bytes)} ({format_bytes(rep.predicted_temp_bytes)}) "
            f"| {'yes' if rep.compiled_temp_bytes <= r['budget'] else 'NO'} | "
            f"{', '.join(r['fitting']) or '-'} | {r['fastest'] or '-'} | {ratio:.3f}x | "
            f"{r['plan_seconds']:.0f} s |"
        )
    for budget, fitting, err in failed:
        lines.append(f"| {format_bytes(budget)} | none: {err.split('. Fix')[0]} | - | - | "
                     f"{', '.join(fitting) or '-'} | - | - | - |")  # fmt: skip
    first = rows[0]["report"]
    lines += [
        "",
        f"Cost model of the planner for this model (from the last solve): recompute FLOPs per "
        f"name, bytes if saved; range {format_bytes(first.min_temp_bytes)} (all recomputed) .. "
        f"{format_bytes(first.no_remat_temp_bytes)} (no remat).",
        "",
        "| name | count | bytes if saved | recompute GFLOPs |",
        "|---|--:|--:|--:|",
    ]
    lines += [f"| {c.name} | {c.count} | {format_bytes(c.nbytes)} | {c.recompute_flops / 1e9:.3f} |"
              for c in rows[-1]["report"].costs]  # fmt: skip
    floor = first.min_temp_bytes
    lowest = min(temps.values())
    lines += [
        "",
        f"No preset fits below `{min(temps, key=temps.get)}` ({format_bytes(lowest)}), and the "
        f"planner's least memory (every name recomputed) is {format_bytes(floor)}: "
        + (
            "so there is no budget at which no preset fits but a plan does; the budgets between "
            "preset memories show where the planner finds a plan faster than every preset that "
            "fits."
            if floor >= lowest
            else "below every preset."
        ),  # fmt: skip
    ]

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for p, t in temps.items():
        ax.scatter(presets[p]["seconds"], t / 2**20, color="tab:gray")
        ax.annotate(p, (presets[p]["seconds"], t / 2**20), fontsize=6, xytext=(3, 2),
                    textcoords="offset points")  # fmt: skip
    for r in rows:
        ax.axhline(r["budget"] / 2**20, color="tab:red", lw=0.6, ls=":")
        # Plan time on the presets' scale: its ratio to the fitting preset, times that preset's.
        x = r["plan_s"] / r["preset_s"] * presets[r["fastest"]]["seconds"] if r["fastest"] else (
            r["plan_s"])  # fmt: skip
        ax.scatter(x, r["report"].compiled_temp_bytes / 2**20, color="tab:red", marker="*", s=80)
    ax.set_xlabel("median grad-step time (s)")
    ax.set_ylabel("XLA temp bytes (MiB)")
    ax.set_title(f"Presets (gray), budgets (dotted), planner's plans (stars)\n{config}", fontsize=7)
    ax.grid(True, alpha=0.3)

    fits = all(r["report"].compiled_temp_bytes <= r["budget"] for r in rows)
    ratios = [r["plan_s"] / r["preset_s"] for r in rows if r["preset_s"]]
    worst = max(ratios) if ratios else float("nan")
    better = [r for r in rows if r["preset_s"] and r["plan_s"] < r["preset_s"]]
    targets = [
        Target("every plan's compiled temp <= its budget", fits,
               ", ".join(f"{format_bytes(r['report'].compiled_temp_bytes)} <= "
                         f"{format_bytes(r['budget'])}" for r in rows)),
        Target("plan step time <= 1.05x the fastest fitting preset", worst <= 1.05,
               ", ".join(f"{x:.3f}x" for x in ratios)),
        Target("a budget where no preset fits but a plan does", floor < lowest and fits,
               f"planner floor {format_bytes(floor)} vs lowest preset {format_bytes(lowest)}; "
               f"{len(better)} budget(s) where the plan beats every fitting preset"),
    ]  # fmt: skip
    return Result("planner", "\n".join(lines), {"planner.png": fig}, targets)
