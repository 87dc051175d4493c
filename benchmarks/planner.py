"""Memory-budget planner: ``rn.plan_for_budget`` against the hand-written remat presets.

On the scanned transformer of the ``transformer`` benchmark, at budgets between the ``full``
preset's temp memory and no remat, the planner picks save / recompute per activation name (the
loss takes the candidate as the model's own remat plan, ``loss(params, tokens, *, policy)``).
For each budget: the plan, its compiled temp bytes (must fit), and its step time against every
preset that also fits, timed in the same shuffled rounds (median of paired ratios), the plan
also against itself (the noise). The planner's calibration compiles are the same programs at
every budget: a persistent compilation cache (the one configured, else a temporary directory
for this process) shares them across budgets.
"""

from __future__ import annotations

import contextlib
import inspect
import tempfile
import time
from collections.abc import Iterator

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks import transformer as tb  # noqa: E402
from benchmarks._common import Result, Target, paired, rounds_text, verdict  # noqa: E402
from remat_nn._memory import format_bytes  # noqa: E402


def _budgets(temps: dict[str, int], count: int) -> list[int]:
    """Budgets between distinct preset memories (midpoints), lowest first, ``count`` of them."""
    levels = sorted(set(temps.values()))
    mids = [(a + b) // 2 for a, b in zip(levels, levels[1:], strict=False)]
    if len(mids) > count:  # keep the lowest (only `full` fits there) and spread the rest
        step = (len(mids) - 1) / (count - 1)
        mids = [mids[round(i * step)] for i in range(count)]
    return mids


def _default(arg: str) -> object:
    """``rn.plan_for_budget``'s default for ``arg`` (the benchmark calls it with its defaults)."""
    return inspect.signature(rn.plan_for_budget).parameters[arg].default


def _plan_text(plan: rn.Plan) -> str:
    return f"save [{', '.join(plan.save)}]" if plan.save else "save nothing (recompute all)"


@contextlib.contextmanager
def _shared_compiles() -> Iterator[None]:
    """A persistent compilation cache for the duration, every compile in it: the planner's
    calibration compiles (no remat, every name recomputed, each name saved alone) are the same
    programs at every budget, so only the first budget compiles them. The cache directory
    configured (``JAX_COMPILATION_CACHE_DIR``), or a temporary one when there is none."""
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {n: getattr(jax.config, n) for n in names}
    with tempfile.TemporaryDirectory() as d:
        for n, v in zip(names, (before[names[0]] or d, 0.0, -1), strict=True):
            jax.config.update(n, v)
        try:
            yield
        finally:
            for n, v in before.items():
                jax.config.update(n, v)


def run(quick: bool = False) -> Result:
    with _shared_compiles():
        return _run(quick)


def _run(quick: bool) -> Result:
    config = wl.LM_QUICK if quick else wl.LM_FULL
    reps = 1 if quick else 15
    names = tb.QUICK_PRESETS if quick else tuple(tb.REMAT_PRESETS)
    presets = tb.compile_presets(config, names)  # cached when the transformer benchmark ran
    # The presets' step times for the figure: the transformer benchmark's rounds (cached).
    preset_times = tb.timed(config, names, tb.rounds(quick), tb.matmul_size(quick))
    model = wl.lm(config)
    # Offload presets move nothing on CPU: their memory is that of the matching save preset.
    temps = {
        p: mem.temp_size_in_bytes for p, (_, mem) in presets.items() if p not in tb.OFFLOAD_PRESETS
    }
    budgets = [(temps["full"] + temps["none"]) // 2] if quick else _budgets(temps, 5)
    steps = {p: presets[p][0] for p in temps}
    lowest = min(temps.values())

    rows, failed = [], []
    pending = list(budgets)
    while pending:
        budget = pending.pop(0)
        t0 = time.perf_counter()
        fitting = [p for p, t in temps.items() if t <= budget]
        print(f"budget {format_bytes(budget)}:", flush=True)
        try:
            report = rn.plan_for_budget(
                model.loss, model.params, model.tokens, budget=budget, log=print
            )
        except rn.PlanError as e:
            print(f"budget {format_bytes(budget)}: {e}", flush=True)
            failed.append((budget, fitting, str(e)))
            continue
        plan_seconds = time.perf_counter() - t0
        if not rows and report.min_temp_bytes < lowest and not quick:
            # The planner reached below every preset: also plan halfway between the two.
            pending.insert(0, (report.min_temp_bytes + lowest) // 2)
        # An executable, as the presets' steps are (a hit in the cache: the planner compiled it).
        plan_jit = jax.jit(model.grad_step(report.plan))
        plan_step = plan_jit.lower(model.params, model.tokens).compile()
        fns = {"plan": lambda s=plan_step: s(model.params, model.tokens)}
        fns |= {p: lambda s=steps[p]: s(model.params, model.tokens) for p in fitting}
        times = paired(fns, itself="plan", rounds=reps)
        # The fastest fitting preset is the one the plan compares worst against.
        ratios = {p: times.ratio("plan", p) for p in fitting}
        fastest = max(ratios, key=ratios.__getitem__) if fitting else None
        secs = {k: times.seconds(k) for k in times.samples}
        rows.append(
            {
                "budget": budget,
                "report": report,
                "fitting": fitting,
                "fastest": fastest,
                "ratio": ratios.get(fastest),
                "noise": times.noise,
                "rounds": times.rounds,
                "plan_s": secs["plan"],
                "plan_seconds": plan_seconds,
            }
        )
        print(
            f"budget {format_bytes(budget)}: {_plan_text(report.plan)}, temp "
            f"{format_bytes(report.compiled_temp_bytes)}; {secs}",
            flush=True,
        )
    rows.sort(key=lambda r: r["budget"])

    first = rows[0]["report"]
    lines = [
        f"Scanned transformer ({config}). Preset XLA temp bytes of the grad step: "
        + ", ".join(
            f"{p} {format_bytes(t)}" for p, t in sorted(temps.items(), key=lambda kv: kv[1])
        )
        + f". Budgets: midpoints between consecutive preset memories, and one between the "
        f"planner's least compiled plan and the lowest preset. Times: {rounds_text(reps)}, each "
        "running the plan, the plan compiled again and every preset that fits, in a fresh random "
        "order; a ratio is the "
        "median over rounds of the two times in the same round (paired, so that the shared "
        "machine's slow spells cancel), the plan against itself shows what noise is left, and "
        "the fastest fitting preset is the one the plan's ratio is worst against. The planner is "
        "called with its defaults "
        "(`rn.plan_for_budget(loss, params, tokens, budget=b)`): it leaves offload out on CPU "
        "(one memory), and, since the arguments are concrete, races its "
        f"{_default('shortlist')} fastest-modeled fitting plans (up to {_default('rounds')} "
        "rounds, clearly slower ones dropping out) and keeps the fastest measured.",
        "",
        "| budget | planner's plan | compiled temp (predicted) | fits | presets that fit | "
        "fastest fitting preset (measured) | plan time / preset time | noise (plan vs itself) | "
        "plans compiled | planning took |",
        "|--:|---|--:|---|---|---|--:|--:|--:|--:|",
    ]
    for r in rows:
        rep = r["report"]
        ratio = f"{r['ratio']:.3f}x" if r["ratio"] else "- (no preset fits)"
        noise = f"±{r['noise']:.1%}"
        lines.append(
            f"| {format_bytes(r['budget'])} | {_plan_text(rep.plan)} | "
            f"{format_bytes(rep.compiled_temp_bytes)} ({format_bytes(rep.predicted_temp_bytes)}) "
            f"| {'yes' if rep.compiled_temp_bytes <= r['budget'] else 'NO'} | "
            f"{', '.join(r['fitting']) or 'none'} | {r['fastest'] or '-'} | {ratio} | "
            f"{noise} | "
            f"{len(rep.tried)} | {r['plan_seconds']:.0f} s |"
        )
    for budget, fitting, err in failed:
        lines.append(
            f"| {format_bytes(budget)} | none: {err.split('. Fix')[0]} | - | - | "
            f"{', '.join(fitting) or 'none'} | - | - | - | - | - |"
        )
    lines += [
        "",
        f"Cost model of the planner for this model: every name recomputed "
        f"{format_bytes(first.floor_temp_bytes)}, least compiled plan "
        f"{format_bytes(first.min_temp_bytes)}, no remat {format_bytes(first.no_remat_temp_bytes)}."
        " 'temp if only it is saved' is the calibration compile of each name; a set of kept "
        "names is predicted at the floor plus their saved bytes minus the largest working-set "
        "reduction among them.",
        "",
        "| name | count | bytes if saved | temp if only it is saved | recompute GFLOPs |",
        "|---|--:|--:|--:|--:|",
    ]
    lines += [
        f"| {c.name} | {c.count} | {format_bytes(c.nbytes)} | "
        f"{format_bytes(first.floor_temp_bytes + c.alone)} | "
        f"{c.recompute_flops / 1e9:.3f} |"
        for c in first.costs
    ]
    last = rows[-1]["report"]
    lines += [
        "",
        f"The planner's report at the budget {format_bytes(last.budget_bytes)}:",
        "",
        "```",
        str(last),
        "```",
    ]

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for p, t in temps.items():
        x = preset_times.seconds(p)
        ax.scatter(x, t / 2**20, color="tab:gray")
        ax.annotate(p, (x, t / 2**20), fontsize=6, xytext=(3, 2), textcoords="offset points")
    for r in rows:
        ax.axhline(r["budget"] / 2**20, color="tab:red", lw=0.6, ls=":")
        # Plan time on the presets' scale: its ratio to the fitting preset, times that preset's.
        x = r["ratio"] * preset_times.seconds(r["fastest"]) if r["fastest"] else r["plan_s"]
        ax.scatter(x, r["report"].compiled_temp_bytes / 2**20, color="tab:red", marker="*", s=80)
    ax.set_xlabel("grad-step time (s)")
    ax.set_ylabel("XLA temp bytes (MiB)")
    ax.set_title(f"Presets (gray), budgets (dotted), planner's plans (stars)\n{config}", fontsize=7)
    ax.grid(True, alpha=0.3)

    fits = all(r["report"].compiled_temp_bytes <= r["budget"] for r in rows)
    timed = [r for r in rows if r["ratio"]]
    # Each budget's verdict against its own noise; the target's is the worst of them.
    verdicts = [verdict(r["ratio"], 1.05, r["noise"], at_most=True) for r in timed]
    overall = next((v for v in ("NO", "within noise") if v in verdicts), "yes" if timed else "NO")
    beyond = [r for r in rows if not r["fitting"]]
    targets = [
        Target(
            "every plan's compiled temp <= its budget",
            fits,
            ", ".join(
                f"{format_bytes(r['report'].compiled_temp_bytes)} <= {format_bytes(r['budget'])}"
                for r in rows
            ),
        ),
        Target(
            "plan step time <= 1.05x the fastest fitting preset",
            overall,
            ", ".join(f"{r['ratio']:.3f}x ({v})" for r, v in zip(timed, verdicts, strict=True)),
            ", ".join(f"±{r['noise']:.1%}" for r in timed)
            + f" (plan vs itself, {rounds_text(reps)} each)",
        ),
        Target(
            "a budget where no preset fits but a plan does",
            bool(beyond) and fits,
            "; ".join(
                f"{format_bytes(r['budget'])}: {_plan_text(r['report'].plan)} at "
                f"{format_bytes(r['report'].compiled_temp_bytes)}, lowest preset "
                f"{format_bytes(lowest)}"
                for r in beyond
            )
            or f"planner's least {format_bytes(first.min_temp_bytes)} vs lowest preset "
            f"{format_bytes(lowest)}",
        ),
    ]
    return Result("planner", "\n".join(lines), {"planner.png": fig}, targets)
