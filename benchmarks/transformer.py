"""Transformer remat presets: memory, saved residuals by name, FLOPs and step time.

Every preset of ``models.transformer.REMAT_PRESETS`` (``none`` is no remat) on the scanned
transformer (one ``nn.scan`` over layers, the plan applied to the scan body, where XLA:CPU keeps
remat as on accelerators). Memory: XLA's temp bytes of ``jax.jit(jax.grad(loss))`` and the
residuals reverse-mode saves, grouped by activation name (``rn.memory_report``). FLOPs: counted
from the jaxpr (``rn.count_flops``; XLA's ``cost_analysis`` counts a scan body once). Time: every
preset's grad step, ``none`` a second time (the noise) and the dense matmul the efficiency
benchmark compares against run in the same shuffled rounds; a ratio is the median over rounds of
two times from the same round.
"""

from __future__ import annotations

import functools
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks._common import Paired, Result, Target, paired, rounds_text, verdict  # noqa: E402
from models.transformer import REMAT_PRESETS  # noqa: E402
from remat_nn import format_bytes  # noqa: E402

OFFLOAD_PRESETS = [p for p, plan in REMAT_PRESETS.items() if plan is not None and plan.offload]
#: Quick mode (tests) measures a few presets only: one of each kind.
QUICK_PRESETS = ("none", "full", "minimal", "minimal_offloaded")


#: The key of the dense float32 matmul timed in the presets' rounds (efficiency's reference).
MATMUL = "matmul"


def matmul_size(quick: bool) -> int:
    return 256 if quick else 2048


@functools.cache
def compile_presets(
    config: wl.LMConfig, presets: tuple[str, ...]
) -> dict[str, tuple[Any, rn.CompiledMemory]]:
    """preset -> (executable, XLA memory analysis) of its grad step (cached per process: the
    planner and efficiency benchmarks time the same executables, and need no more of them)."""
    model = wl.lm(config)
    return {p: wl.compile_step(model.grad_step(p), model.params, model.tokens) for p in presets}


@functools.cache
def measure(config: wl.LMConfig, presets: tuple[str, ...]) -> dict[str, dict]:
    """preset -> temp, peak, residuals by name, FLOPs (cached per process)."""
    model = wl.lm(config)
    rows = {}
    for preset, (_, mem) in compile_presets(config, presets).items():
        step = model.grad_step(preset)
        report = rn.memory_report(
            functools.partial(model.loss, policy=preset), model.params, model.tokens
        )
        rows[preset] = {
            "temp": mem.temp_size_in_bytes,
            "peak": mem.peak_bytes,
            "report": report,
            "flops": rn.count_flops(step, model.params, model.tokens),
            "matmul_flops": rn.matmul_flops(step, model.params, model.tokens),
        }
        print(f"{preset}: temp {format_bytes(mem.temp_size_in_bytes)}", flush=True)
    return rows


@functools.cache
def timed(config: wl.LMConfig, presets: tuple[str, ...], rounds: int, matmul: int) -> Paired:
    """Every preset's grad step, ``none`` again and a dense ``matmul`` x ``matmul`` float32
    matmul in ``rounds`` shuffled rounds (cached: the efficiency and planner benchmarks use the
    same measurement when they run in the same process)."""
    model = wl.lm(config)
    steps = compile_presets(config, presets)
    fns = {p: functools.partial(c, model.params, model.tokens) for p, (c, _) in steps.items()}
    fns[MATMUL] = wl.matmul_fn(matmul)
    # Quick sizes take a millisecond a step: repeat within a slot so timer resolution is no noise.
    quick = matmul < 1024
    times = paired(fns, itself="none", rounds=rounds, min_seconds=0.01 if quick else 0.0)
    print(", ".join(f"{k} {times.seconds(k):.3f} s" for k in times.samples), flush=True)
    return times


def _named(report: rn.MemoryReport) -> str:
    groups = report.by_name()
    named = [(k, g) for k, g in groups.items() if not k.startswith("(")]
    text = ", ".join(
        f"{k} {format_bytes(g['bytes'])}" + (" (offloaded)" if "offloaded" in g["actions"] else "")
        for k, g in named
    )
    return text or "-"


def rounds(quick: bool) -> int:
    return 1 if quick else 9


def run(quick: bool = False) -> Result:
    config = wl.LM_QUICK if quick else wl.LM_FULL
    presets = QUICK_PRESETS if quick else tuple(REMAT_PRESETS)
    rows = measure(config, presets)
    times = timed(config, presets, rounds(quick), matmul_size(quick))
    base = rows["none"]
    noise = times.noise
    lines = [
        f"Scanned transformer ({config}). Grad step `jax.jit(jax.grad(loss))`: XLA temp "
        f"bytes; residuals saved for the backward (`rn.memory_report`: total, and the named "
        f"ones by name; every array of a scanned layer counts once per layer); FLOPs of the "
        f"step counted from the jaxpr (scan bodies times their length). Time: "
        f"{rounds_text(times.rounds)}, each running every preset's step, `none` a second time "
        "and a dense matmul in a fresh random order; step time is the median over rounds, "
        "time vs none the median over rounds of the ratio within a round. Noise: "
        f"{times.noise_text()}.",
        "",
        "| preset | XLA temp | XLA peak | residuals | named residuals (all layers) | GFLOPs "
        "| matmul GFLOPs | FLOPs vs none | step time | time vs none |",
        "|---|--:|--:|--:|---|--:|--:|--:|--:|--:|",
    ]
    for preset, r in rows.items():
        lines.append(
            f"| {preset} | {format_bytes(r['temp'])} | {format_bytes(r['peak'])} | "
            f"{format_bytes(r['report'].total_bytes)} | {_named(r['report'])} | "
            f"{r['flops'] / 1e9:.2f} | {r['matmul_flops'] / 1e9:.2f} | "
            f"{r['flops'] / base['flops']:.3f}x | {times.seconds(preset):.3f} s | "
            f"{times.ratio(preset, 'none'):.3f}x |"
        )
    pairs = []
    for p in [p for p in OFFLOAD_PRESETS if p in rows]:
        twin = next(
            (
                q
                for q, plan in REMAT_PRESETS.items()
                if plan is not None
                and set(plan.save) == set(REMAT_PRESETS[p].offload)
                and not plan.offload
            ),
            None,
        )
        if twin in rows:
            pairs.append(
                f"{p} {format_bytes(rows[p]['temp'])} vs {twin} {format_bytes(rows[twin]['temp'])}"
            )
    lines += [
        "",
        f"Offload presets ({', '.join(p for p in OFFLOAD_PRESETS if p in rows)}) compile and run "
        "on CPU but move "
        "nothing: XLA:CPU has one memory space, so offloaded residuals stay in the same RAM and "
        "the temp memory equals that of the preset saving the same names "
        f"({'; '.join(pairs)}). Savings from offloading can only be claimed from an "
        "accelerator run.",
    ]

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for preset, r in rows.items():
        marker = "s" if preset in OFFLOAD_PRESETS else "o"
        ratio = times.ratio(preset, "none")
        ax.scatter(ratio, r["temp"] / 2**20, marker=marker)
        ax.annotate(
            preset,
            (ratio, r["temp"] / 2**20),
            fontsize=7,
            xytext=(4, 3),
            textcoords="offset points",
        )
    ax.axvspan(1 - noise, 1 + noise, color="tab:gray", alpha=0.2, label="none vs itself (noise)")
    ax.legend(fontsize=7)
    ax.set_xlabel("grad-step time / none's (paired, median over rounds)")
    ax.set_ylabel("XLA temp bytes of the grad step (MiB)")
    ax.set_title(f"Remat presets: memory vs time ({config})", fontsize=7)
    ax.grid(True, alpha=0.3)
    full = times.ratio("full", "none")
    mem = rows["full"]["temp"] / base["temp"]
    targets = [
        Target(
            "`full` remat temp <= 1/2 of no remat's",
            mem <= 0.5,
            f"{format_bytes(rows['full']['temp'])} / {format_bytes(base['temp'])} = {mem:.3f}",
        ),
        Target(
            "`full` remat step time <= 1.33x no remat's (jax.checkpoint: 1.0-1.33x FLOPs)",
            verdict(full, 4 / 3, noise, at_most=True),
            f"{full:.3f}x",
            times.noise_text(),
        ),
    ]
    return Result("transformer", "\n".join(lines), {"transformer_presets.png": fig}, targets)
