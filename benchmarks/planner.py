"""Memory-budget planner: ``rn.plan_for_budget`` against the hand-written remat presets.

On the scanned transformer of the ``transformer`` benchmark, at 10 budgets from just above the
least memory any form reaches to the no-remat memory, the planner picks save / recompute per
activation name (the loss takes the candidate as the model's own remat plan, ``loss(params,
tokens, *, policy)``), and falls back on the model's other forms where no plan fits: the nested
scan (``scan_levels=2``, :func:`remat_nn.remat_scan`) and the reversible transformer
(``reversible=true``, its own parameters). For each budget: the plan, its compiled temp bytes
(must fit), the memory model's error on every plan it predicted before compiling it, the
number of compiles, and (with timing) its step time against every preset that also fits,
timed in the same shuffled rounds (median of paired ratios), the plan also against itself (the
noise). The planner's calibration compiles are the same programs at every budget: a persistent
compilation cache (the one configured, else a temporary directory for this process) shares
them across budgets. ``run(timing=False)`` skips the timing (and the planner's race): memory
figures only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks import transformer as tb  # noqa: E402
from benchmarks._common import Result, Target, paired, rounds_text, verdict  # noqa: E402
from remat_nn import format_bytes  # noqa: E402

#: The most compiles of one budget in the committed table before the mechanism search (17, at
#: 4 of the 6 budgets of 2026-11-23): the target allows twice as many.
TODAY_MOST_COMPILES = 17
BUDGETS = 10
QUICK_BUDGETS = 2  # the test of the quick run: the lowest (a variant) and no remat


def _budgets(least: int, no_remat: int, count: int = BUDGETS) -> list[int]:
    """``count`` budgets evenly spaced from 2% above ``least`` to ``no_remat``, lowest first."""
    lo = least + least // 50
    return [lo + (no_remat - lo) * i // (count - 1) for i in range(count)]


def _variants(model: wl.LM) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """The transformer's other forms, as ``rn.plan_for_budget(variants=...)`` takes them."""

    def loss_of(module: Any) -> Any:
        def loss(params: Any, tokens: jax.Array, *, policy: Any = "none") -> jax.Array:
            plan = None if isinstance(policy, str) else policy
            logits = module.clone(remat=plan).apply({"params": params}, tokens[:, :-1])
            return wl.next_token_loss(logits, tokens)

        return loss

    nested = model.module.clone(scan_levels=2)  # same parameters as the scan
    reversible = model.module.clone(reversible=True, remat=None)
    # Reversible blocks keep nothing per layer: a plan has nothing to act on, so it is ignored.
    rev_loss = loss_of(reversible)
    rev_params = jax.jit(reversible.init)(jax.random.key(0), model.tokens[:, :-1])["params"]
    return {
        "nested scan (scan_levels=2)": (loss_of(nested), (model.params, model.tokens)),
        "reversible": (
            lambda p, t, *, policy="none": rev_loss(p, t, policy="none"),
            (rev_params, model.tokens),
        ),
    }


def _plan_text(plan: rn.Plan, variant: str | None = None) -> str:
    text = f"save [{', '.join(plan.save)}]" if plan.save else "save nothing (recompute all)"
    if variant == "reversible":
        return "reversible (keeps nothing per layer: no plan applies)"
    return text if variant is None else f"{variant}: {text}"


def _default(arg: str) -> object:
    """``rn.plan_for_budget``'s default for ``arg`` (the benchmark calls it with its defaults)."""
    return inspect.signature(rn.plan_for_budget).parameters[arg].default


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


def run(quick: bool = False, timing: bool = True) -> Result:
    with _shared_compiles():
        return _run(quick, timing)


def _run(quick: bool, timing: bool) -> Result:
    config = wl.LM_QUICK if quick else wl.LM_FULL
    reps = 1 if quick else 15
    names = tb.QUICK_PRESETS if quick else tuple(tb.REMAT_PRESETS)
    presets = tb.compile_presets(config, names)  # cached when the transformer benchmark ran
    # The presets' step times for the figure: the transformer benchmark's rounds (cached).
    preset_times = (
        tb.timed(config, names, tb.rounds(quick), tb.matmul_size(quick)) if timing else None
    )
    model = wl.lm(config)
    variants = _variants(model)
    # Offload presets move nothing on CPU: their memory is that of the matching save preset.
    temps = {
        p: mem.temp_size_in_bytes for p, (_, mem) in presets.items() if p not in tb.OFFLOAD_PRESETS
    }
    steps = {p: presets[p][0] for p in temps}
    lowest = min(temps.values())

    def plan(budget: int) -> rn.PlanReport:
        return rn.plan_for_budget(
            model.loss,
            model.params,
            model.tokens,
            budget=budget,
            measure=None if timing else False,
            variants=variants,
            log=print,
        )

    # The least memory of any form: the plain plans' least (the top budget's calibration
    # compiles) and each variant's under that plan (compiled again, from the cache, when a
    # budget falls back on it).
    print("calibrating at the no-remat memory:", flush=True)
    t0 = time.perf_counter()
    top = plan(temps["none"])
    top_seconds = time.perf_counter() - t0
    least_plan = min((t for t in top.tried if t.variant is None), key=lambda t: t.temp_bytes)
    variant_temps = {
        label: rn.compiled_memory(
            jax.grad(functools.partial(fn, policy=least_plan.plan)), *args
        ).temp_size_in_bytes
        for label, (fn, args) in variants.items()
    }
    least = min(top.min_temp_bytes, *variant_temps.values())
    count = QUICK_BUDGETS if quick else BUDGETS
    budgets = _budgets(least, top.no_remat_temp_bytes, count)

    rows = []
    for budget in budgets:
        t0 = time.perf_counter()
        fitting = [p for p, t in temps.items() if t <= budget]
        print(f"budget {format_bytes(budget)}:", flush=True)
        # Every budget is above the least: a PlanError is a failure. The top one was planned.
        report = top if budget == top.budget_bytes else plan(budget)
        plan_seconds = top_seconds if report is top else time.perf_counter() - t0
        row: dict[str, Any] = {
            "budget": budget,
            "report": report,
            "fitting": fitting,
            "plan_seconds": plan_seconds,
            "fastest": None,
            "ratio": None,
        }
        if timing and report.variant is None:
            # An executable, as the presets' steps are (a cache hit: the planner compiled it).
            plan_jit = jax.jit(model.grad_step(report.plan))
            plan_step = plan_jit.lower(model.params, model.tokens).compile()
            fns = {"plan": lambda s=plan_step: s(model.params, model.tokens)}
            fns |= {p: lambda s=steps[p]: s(model.params, model.tokens) for p in fitting}
            times = paired(fns, itself="plan", rounds=reps)
            # The fastest fitting preset is the one the plan compares worst against.
            ratios = {p: times.ratio("plan", p) for p in fitting}
            fastest = max(ratios, key=ratios.__getitem__) if fitting else None
            row |= {
                "fastest": fastest,
                "ratio": ratios[fastest] if fastest else None,
                "noise": times.noise,
                "plan_s": times.seconds("plan"),
            }
        rows.append(row)
        print(
            f"budget {format_bytes(budget)}: {_plan_text(report.plan, report.variant)}, temp "
            f"{format_bytes(report.compiled_temp_bytes)}, {len(report.tried)} compiles, model "
            f"error <= {report.prediction_error:.1%}",
            flush=True,
        )

    how = (
        f"Times: {rounds_text(reps)}, each running the plan, the plan compiled again and every "
        "preset that fits, in a fresh random order; a ratio is the median over rounds of the two "
        "times in the same round (paired, so that the shared machine's slow spells cancel), the "
        "plan against itself shows what noise is left, and the fastest fitting preset is the one "
        "the plan's ratio is worst against. The planner is called with its defaults and the "
        "variants (`rn.plan_for_budget(loss, params, tokens, budget=b, variants=...)`): it "
        "leaves offload out on CPU (one memory), and, since the arguments are concrete, races its "
        f"{_default('shortlist')} fastest-modeled fitting plans (up to {_default('rounds')} "
        "rounds, clearly slower ones dropping out) and keeps the fastest measured."
        if timing
        else 'Memory figures only (`python -c "from benchmarks import planner, _common; '
        '_common.write(planner.run(timing=False), quick=False, out=_common.RESULTS)"`): nothing '
        "is timed and the planner does not race its candidates (`measure=False`): it keeps the "
        "fastest modeled that fits."
    )
    lines = [
        f"Scanned transformer ({config}). Preset XLA temp bytes of the grad step: "
        + ", ".join(
            f"{p} {format_bytes(t)}" for p, t in sorted(temps.items(), key=lambda kv: kv[1])
        )
        + ". Other forms, compiled under the plain plans' least plan "
        f"({_plan_text(least_plan.plan)}, {format_bytes(least_plan.temp_bytes)}): "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in variant_temps.items())
        + f". Budgets: {count}, evenly spaced from 2% above the least of all "
        f"({format_bytes(least)}) to no remat ({format_bytes(top.no_remat_temp_bytes)}). "
        "'model error' is the largest |predicted - compiled| / compiled over the plans the memory "
        "model predicted before compiling them (the calibration compiles, no remat, every name "
        "recomputed and each name saved alone, are what it is built from); 'compiles' counts every "
        f"compile of the planner for the budget (before the mechanism search: at most "
        f"{TODAY_MOST_COMPILES}). {how}",
        "",
        "| budget | planner's plan | compiled temp (predicted) | fits | model error | compiles | "
        "presets that fit | fastest fitting preset (measured) | plan time / preset time | "
        "noise (plan vs itself) | planning took |",
        "|--:|---|--:|---|--:|--:|---|---|--:|--:|--:|",
    ]
    for r in rows:
        rep = r["report"]
        ratio = f"{r['ratio']:.3f}x" if r["ratio"] else "-"
        noise = f"±{r['noise']:.1%}" if r["ratio"] else "-"
        lines.append(
            f"| {format_bytes(r['budget'])} | {_plan_text(rep.plan, rep.variant)} | "
            f"{format_bytes(rep.compiled_temp_bytes)} ({format_bytes(rep.predicted_temp_bytes)}) "
            f"| {'yes' if rep.compiled_temp_bytes <= r['budget'] else 'NO'} | "
            f"{rep.prediction_error:.1%} | {len(rep.tried)} | "
            f"{', '.join(r['fitting']) or 'none'} | {r['fastest'] or '-'} | {ratio} | {noise} | "
            f"{r['plan_seconds']:.0f} s |"
        )
    first = top
    lines += [
        "",
        f"Cost model of the planner for this model: every name recomputed "
        f"{format_bytes(first.floor_temp_bytes)}, least compiled plan "
        f"{format_bytes(first.min_temp_bytes)}, no remat {format_bytes(first.no_remat_temp_bytes)}."
        " 'temp if only it is saved' is the calibration compile of each name; a set of kept "
        "names is predicted at the floor plus their saved bytes minus the largest working-set "
        "reduction among them, corrected by that prediction's error at the nearest compiled plan.",
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
    worst = max(rows, key=lambda r: r["report"].prediction_error)["report"]
    lines += [
        "",
        f"The planner's report at the budget {format_bytes(worst.budget_bytes)} (its memory "
        "model's largest error):",
        "",
        "```",
        str(worst),
        "```",
    ]

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if preset_times is not None:
        for p, t in temps.items():
            x = preset_times.seconds(p)
            ax.scatter(x, t / 2**20, color="tab:gray")
            ax.annotate(p, (x, t / 2**20), fontsize=6, xytext=(3, 2), textcoords="offset points")
        for r in rows:
            if r["ratio"] is None and "plan_s" not in r:
                continue
            ax.axhline(r["budget"] / 2**20, color="tab:red", lw=0.6, ls=":")
            # Plan time on the presets' scale: its ratio to the fitting preset, times that one's.
            x = r["ratio"] * preset_times.seconds(r["fastest"]) if r["fastest"] else r["plan_s"]
            temp = r["report"].compiled_temp_bytes / 2**20
            ax.scatter(x, temp, color="tab:red", marker="*", s=80)
        ax.set_xlabel("grad-step time (s)")
        ax.set_title(
            f"Presets (gray), budgets (dotted), planner's plans (stars)\n{config}", fontsize=7
        )
    else:
        xs = [r["budget"] / 2**20 for r in rows]
        ax.plot(xs, xs, color="tab:gray", lw=0.6, ls=":", label="budget")
        ax.scatter(
            xs,
            [r["report"].compiled_temp_bytes / 2**20 for r in rows],
            color="tab:red",
            marker="*",
            s=80,
            label="planner's plan (compiled)",
        )
        for p, t in temps.items():
            ax.axhline(t / 2**20, color="tab:gray", lw=0.4)
            ax.annotate(
                p, (xs[0], t / 2**20), fontsize=6, xytext=(2, 2), textcoords="offset points"
            )
        ax.set_xlabel("budget (MiB)")
        ax.legend(fontsize=7)
        ax.set_title(f"Budgets and the planner's plans; presets (gray lines)\n{config}", fontsize=7)
    ax.set_ylabel("XLA temp bytes (MiB)")
    ax.grid(True, alpha=0.3)

    fits = all(r["report"].compiled_temp_bytes <= r["budget"] for r in rows)
    errors = [r["report"].prediction_error for r in rows]
    compiles = [len(r["report"].tried) for r in rows]
    below = [r for r in rows if r["budget"] < first.min_temp_bytes]
    targets = [
        Target(
            f"all {count} budgets, from just above the least plan to no remat, fit",
            fits and len(rows) == count,
            ", ".join(
                f"{format_bytes(r['report'].compiled_temp_bytes)} <= {format_bytes(r['budget'])}"
                for r in rows
            ),
        ),
        Target(
            "memory model error <= 5% on every plan predicted before its compile",
            max(errors) <= 0.05,
            ", ".join(f"{e:.1%}" for e in errors),
        ),
        Target(
            "a budget below the least of the per-name plans met",
            bool(below) and all(r["report"].compiled_temp_bytes <= r["budget"] for r in below),
            "; ".join(
                f"{format_bytes(r['budget'])}: {_plan_text(r['report'].plan, r['report'].variant)}"
                f" at {format_bytes(r['report'].compiled_temp_bytes)}"
                for r in below
            )
            + f" (per-name plans' least {format_bytes(first.min_temp_bytes)})",
        ),
        Target(
            f"compiles per budget <= 2x before the mechanism search ({2 * TODAY_MOST_COMPILES})",
            max(compiles) <= 2 * TODAY_MOST_COMPILES,
            ", ".join(map(str, compiles)),
        ),
        Target(
            "a budget where no preset fits but a plan does",
            any(not r["fitting"] for r in rows) and fits,
            "; ".join(
                f"{format_bytes(r['budget'])}: {_plan_text(r['report'].plan, r['report'].variant)}"
                f" at {format_bytes(r['report'].compiled_temp_bytes)}, lowest preset "
                f"{format_bytes(lowest)}"
                for r in rows
                if not r["fitting"]
            )
            or "none",
        ),
    ]
    timed = [r for r in rows if r["ratio"]]
    if not timing:
        targets.append(
            Target(
                "plan step time <= 1.05x the fastest fitting preset",
                "inconclusive: not timed (memory figures only, run(timing=False))",
                "-",
                "- (a timed run prints the plan vs itself noise here)",
            )
        )
    else:
        # Each budget's verdict against its own noise; the target's is the worst of them.
        verdicts = [verdict(r["ratio"], 1.05, r["noise"], at_most=True) for r in timed]
        overall = next(
            (v for v in ("NO", "within noise") if v in verdicts), "yes" if timed else "NO"
        )
        targets.append(
            Target(
                "plan step time <= 1.05x the fastest fitting preset",
                overall,
                ", ".join(f"{r['ratio']:.3f}x ({v})" for r, v in zip(timed, verdicts, strict=True)),
                ", ".join(f"±{r['noise']:.1%}" for r in timed)
                + f" (plan vs itself, {rounds_text(reps)} each)",
            )
        )
    return Result("planner", "\n".join(lines), {"planner.png": fig}, targets)
