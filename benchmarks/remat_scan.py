"""Nested checkpointed scans: grad-step temp memory and gradient FLOPs of ``rn.remat_scan``
against single-level remat, on the depth benchmark's stack.

The stack is :mod:`benchmarks.depth`'s (a scan over ``depth`` additive couplings of two-layer
MLPs). Single level is ``lax.scan`` over ``rn.checkpoint(step, policy="nothing_saveable")``
(one carry per layer held); ``levels=2`` and ``levels=3`` hold about ``sum(lengths)`` carries
(``rn.remat_scan_lengths``) for one more forward pass per level below the top. Memory: XLA's
compiled temp bytes of ``jax.grad`` (exact); FLOPs: ``rn.count_flops`` of the gradient, scan
trip counts included (exact). Nothing here is timed.
"""

from __future__ import annotations

import functools
import math

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import depth as depth_bench  # noqa: E402
from benchmarks._common import Result, Target  # noqa: E402
from remat_nn import format_bytes  # noqa: E402

LEVELS = (1, 2, 3)


def _step(h, p):
    return depth_bench.BLOCK.forward(p, None, h)[0], None


def _stack(levels: int, params, x):
    if levels == 1:
        return depth_bench._remat_scan("nothing_saveable", params, x)
    return rn.remat_scan(_step, x, params, levels=levels)[0]


def _loss(levels: int, params, x):
    y1, y2 = _stack(levels, params, x)
    return (y1**2).mean() + (y2**2).mean()


def measure(depth: int, levels: int, batch: int, half: int, hidden: int) -> tuple[int, int]:
    """(temp bytes, gradient FLOPs) of the stack at ``depth`` with ``levels`` levels."""
    params = jax.eval_shape(lambda: depth_bench.init(depth, half, hidden, jax.random.key(0)))
    x = (jax.ShapeDtypeStruct((batch, half), "float32"),) * 2
    grad = jax.grad(functools.partial(_loss, levels))
    temp = rn.compiled_memory(grad, params, x).temp_size_in_bytes
    return temp, rn.count_flops(grad, params, x)


def run(quick: bool) -> Result:
    if quick:
        batch, half, hidden, depths, headline = 4, 8, 16, [16, 64], 64
    else:
        batch, half, hidden, depths, headline = 64, 128, 512, [64, 512, 1000, 4096], 512
    rows = {}
    for depth in depths:
        for levels in LEVELS:
            rows[depth, levels] = measure(depth, levels, batch, half, hidden)
            print(f"  depth {depth}, levels {levels}: {format_bytes(rows[depth, levels][0])}")

    def lengths(depth: int, levels: int) -> str:
        return "" if levels == 1 else f" {rn.remat_scan_lengths(depth, levels)}"

    md = [
        f"MLP coupling stack (batch {batch}, halves {half}, MLP hidden {hidden}, float32): XLA "
        "temp bytes of `jax.grad` and its FLOPs (`rn.count_flops`, scan trip counts included); "
        "levels 1 is `lax.scan` over `rn.checkpoint(step, policy='nothing_saveable')`, "
        "levels 2 and 3 `rn.remat_scan(..., levels=n)` (chunk lengths in brackets).",
        "",
        "| depth | levels | temp | temp / levels 1 | gradient FLOPs / levels 1 |",
        "|--:|--:|--:|--:|--:|",
    ]
    for depth in depths:
        base_temp, base_flops = rows[depth, 1]
        for levels in LEVELS:
            temp, flops = rows[depth, levels]
            md.append(
                f"| {depth:,} | {levels}{lengths(depth, levels)} | {format_bytes(temp)} | "
                f"{temp / base_temp:.3f} | {flops / base_flops:.3f} |"
            )

    single, two = rows[headline, 1], rows[headline, 2]
    first, last = depths[0], depths[-1]
    growth = rows[last, 2][0] / rows[first, 2][0]
    targets = [
        Target(
            f"2 levels: temp at depth {headline} <= 1/4 of single-level `nothing_saveable`'s",
            two[0] <= single[0] / 4,
            f"{format_bytes(two[0])} vs {format_bytes(single[0])} = {two[0] / single[0]:.3f}",
        ),
        Target(
            f"2 levels: gradient FLOPs at depth {headline} <= 1.35x single level's",
            two[1] <= 1.35 * single[1],
            f"{two[1] / single[1]:.3f}x",
        ),
        Target(
            f"2 levels: temp grows at most as sqrt(depth) from {first:,} to {last:,} "
            f"(<= {math.sqrt(last / first):.2f}x)",
            growth <= math.sqrt(last / first),
            f"{growth:.2f}x ({format_bytes(rows[first, 2][0])} -> "
            f"{format_bytes(rows[last, 2][0])}; single level "
            f"{rows[last, 1][0] / rows[first, 1][0]:.2f}x)",
        ),
    ]

    fig, ax = plt.subplots(figsize=(6, 4))
    for levels in LEVELS:
        ax.plot(
            depths, [rows[d, levels][0] / 2**20 for d in depths], "o-", label=f"levels {levels}"
        )
    ax.set(xscale="log", yscale="log", xlabel="depth", ylabel="grad temp (MiB)")
    ax.set_title("rn.remat_scan: temp memory vs depth")
    ax.legend()
    return Result("remat_scan", "\n".join(md), {"remat_scan_memory.png": fig}, targets)
