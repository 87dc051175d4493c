"""Transformer remat presets: memory, saved residuals by name, FLOPs and step time.

Every preset of ``models.transformer.REMAT_PRESETS`` (``none`` is no remat) on the scanned
transformer (one ``nn.scan`` over layers, the plan applied to the scan body, where XLA:CPU keeps
remat as on accelerators). Memory: XLA's temp bytes of ``jax.jit(jax.grad(loss))`` and the
residuals reverse-mode saves, grouped by activation name (``rn.memory_report``). FLOPs: counted
from the jaxpr (``rn.count_flops``; XLA's ``cost_analysis`` counts a scan body once). Time:
median grad step, relative to ``none`` in the same run.
"""

from __future__ import annotations

import functools

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks._common import Result, median_seconds  # noqa: E402
from models.transformer import REMAT_PRESETS  # noqa: E402
from remat_nn._memory import format_bytes  # noqa: E402

OFFLOAD_PRESETS = [p for p, plan in REMAT_PRESETS.items() if plan is not None and plan.offload]
#: Quick mode (tests) measures a few presets only: one of each kind.
QUICK_PRESETS = ("none", "full", "minimal", "minimal_offloaded")


@functools.cache
def measure(config: wl.LMConfig, reps: int, presets: tuple[str, ...]) -> dict[str, dict]:
    """preset -> temp, peak, residuals by name, FLOPs, median seconds (cached per process, so
    the planner benchmark reuses the memory figures when both run together)."""
    model = wl.lm(config)
    rows = {}
    for preset in presets:
        step = model.grad_step(preset)
        compiled, mem = wl.compile_step(step, model.params, model.tokens)
        report = rn.memory_report(
            functools.partial(model.loss, policy=preset), model.params, model.tokens
        )
        rows[preset] = {
            "temp": mem.temp_size_in_bytes,
            "peak": mem.peak_bytes,
            "report": report,
            "flops": rn.count_flops(step, model.params, model.tokens),
            "matmul_flops": rn.matmul_flops(step, model.params, model.tokens),
            "seconds": median_seconds(
                lambda c=compiled: c(model.params, model.tokens), warmup=1, reps=reps
            ),
        }
        print(f"{preset}: temp {format_bytes(mem.temp_size_in_bytes)}, "
              f"{rows[preset]['seconds']:.3f} s/step", flush=True)  # fmt: skip
    return rows


def _named(report: rn.MemoryReport) -> str:
    groups = report.by_name()
    named = [(k, g) for k, g in groups.items() if not k.startswith("(")]
    text = ", ".join(
        f"{k} {format_bytes(g['bytes'])}" + (" (offloaded)" if "offloaded" in g["actions"] else "")
        for k, g in named
    )
    return text or "-"


def run(quick: bool = False) -> Result:
    config = wl.LM_QUICK if quick else wl.LM_FULL
    reps = 2 if quick else 5
    rows = measure(config, reps, QUICK_PRESETS if quick else tuple(REMAT_PRESETS))
    base = rows["none"]
    lines = [
        f"Scanned transformer ({config}). Grad step `jax.jit(jax.grad(loss))`: XLA temp "
        f"bytes; residuals saved for the backward (`rn.memory_report`: total, and the named "
        f"ones by name; every array of a scanned layer counts once per layer); FLOPs of the "
        f"step counted from the jaxpr (scan bodies times their length); median of {reps} steps "
        "after one warm-up.",
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
            f"{r['flops'] / base['flops']:.3f}x | {r['seconds']:.3f} s | "
            f"{r['seconds'] / base['seconds']:.2f}x |"
        )
    pairs = []
    for p in [p for p in OFFLOAD_PRESETS if p in rows]:
        twin = next((q for q, plan in REMAT_PRESETS.items()
                     if plan is not None and set(plan.save) == set(REMAT_PRESETS[p].offload)
                     and not plan.offload), None)  # fmt: skip
        if twin in rows:
            pairs.append(f"{p} {format_bytes(rows[p]['temp'])} vs {twin} "
                         f"{format_bytes(rows[twin]['temp'])}")  # fmt: skip
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
        ax.scatter(r["seconds"], r["temp"] / 2**20, marker=marker)
        ax.annotate(preset, (r["seconds"], r["temp"] / 2**20), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")  # fmt: skip
    ax.set_xlabel("median grad-step time (s)")
    ax.set_ylabel("XLA temp bytes of the grad step (MiB)")
    ax.set_title(f"Remat presets: memory vs time ({config})", fontsize=7)
    ax.grid(True, alpha=0.3)
    return Result("transformer", "\n".join(lines), {"transformer_presets.png": fig})
