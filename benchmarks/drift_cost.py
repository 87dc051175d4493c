"""The drift check's cost (#44): memory and step time of reversible stacks with the check off
(``fallback="none"``), raising (``"error"``, the default) and recomputing (``"recompute"``).

Two stacks: RevNet-38 as ``benchmarks/revnet.py`` builds it (``models.revnet.RevNet`` with its
downsampling units under remat ``full``; BatchNorm in training mode), and the dense coupling
stack of ``benchmarks/depth.py`` through ``rn.reversible_scan``. Memory: XLA's compiled
analysis of the grad step (temp bytes and peak). Time: the three grad steps and ``none`` a
second time (the noise) in shuffled rounds; a ratio is the median over rounds of two times from
the same round. ``rn.drift_recomputes()`` counts how often the fallback ran over every call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks import depth as depth_bench  # noqa: E402
from benchmarks._common import Paired, Result, Target, paired, verdict  # noqa: E402
from models import revnet as R  # noqa: E402

FALLBACKS = ("none", "recompute", "error")
#: The issue's goal for the default check against none.
TIME_BOUND, MEMORY_BOUND = 1.03, 1.01


@dataclasses.dataclass
class _Step:
    run: Callable[[], Any]
    memory: rn.CompiledMemory


def _revnet(fallback: str, quick: bool) -> _Step:
    arch = R.ARCHS["revnet38"]
    if quick:
        arch = dataclasses.replace(arch, units=(2, 2, 2))
    module = R.RevNet(arch, remat=R.REMAT_PRESETS["full"], drift_fallback=fallback)
    batch, image = (8, 8) if quick else (32, 32)
    model = wl.classifier(
        "revnet38", batch=batch, image_size=image, module=module, materialize=False
    )
    executable, memory = wl.compile_step(model.grad_step, *model.args)
    return _Step(functools.partial(executable, *wl.concrete(model).args), memory)


def _dense(fallback: str, quick: bool) -> _Step:
    depth, half, hidden, batch = (8, 16, 32, 8) if quick else (64, 64, 256, 256)
    params = depth_bench.init(depth, half, hidden, jax.random.key(0))
    x = tuple(jax.random.normal(k, (batch, half)) for k in jax.random.split(jax.random.key(1)))
    fwd = lambda p, x: rn.reversible_scan(depth_bench.BLOCK, p, x, fallback=fallback)[0]  # noqa: E731
    executable, memory = wl.compile_step(
        jax.grad(functools.partial(depth_bench._loss, fwd)), params, x
    )
    return _Step(functools.partial(executable, params, x), memory)


STACKS = {"RevNet-38": _revnet, "dense stack": _dense}


def _measure(build: Callable[[str, bool], _Step], quick: bool, rounds: int) -> tuple:
    steps = {f: build(f, quick) for f in FALLBACKS}
    fns = {f: (lambda s=s: jax.block_until_ready(s.run())) for f, s in steps.items()}
    rn.drift_recomputes(reset=True)
    times = paired(fns, itself="none", rounds=rounds, min_seconds=0.05)
    recomputes = sum(rn.drift_recomputes(reset=True).values())
    return {f: s.memory for f, s in steps.items()}, times, recomputes


def _rows(name: str, memory: dict, times: Paired, recomputes: int) -> list[str]:
    base = memory["none"]
    rows = []
    for f in FALLBACKS:
        temp, peak = memory[f].temp_size_in_bytes, memory[f].peak_bytes
        rows.append(
            f"| {name} | {f} | {temp:,} B ({temp / base.temp_size_in_bytes:.4f}x) "
            f"| {peak:,} B ({peak / base.peak_bytes:.4f}x) | {times.seconds(f) * 1e3:.1f} ms "
            f"| {times.ratio(f, 'none'):.3f}x | {times.noise_text()} |"
        )
    rows.append(f"| {name} | recomputes over every call | {recomputes} | | | | |")
    return rows


def _targets(name: str, memory: dict, times: Paired) -> list[Target]:
    peak = memory["error"].peak_bytes / memory["none"].peak_bytes  # the default fallback
    ratio = times.ratio("error", "none")
    return [
        Target(
            f"{name}: the default check's step time <= {TIME_BOUND:.2f}x none",
            verdict(ratio, TIME_BOUND, times.noise, at_most=True),
            f"{ratio:.3f}x",
            times.noise_text(),
        ),
        Target(
            f"{name}: the default check's peak memory <= {MEMORY_BOUND:.2f}x none",
            peak <= MEMORY_BOUND,
            f"{peak:.4f}x",
        ),
    ]


def run(quick: bool = False) -> Result:
    rounds = 1 if quick else 15
    rows = [
        "| stack | fallback | temp | peak | step | step / none | noise |",
        "|---|---|--:|--:|--:|--:|---|",
    ]
    targets, ratios = [], {}
    for name, build in STACKS.items():
        memory, times, recomputes = _measure(build, quick, rounds)
        rows += _rows(name, memory, times, recomputes)
        targets += _targets(name, memory, times)
        ratios[name] = [times.ratio(f, "none") for f in FALLBACKS]
    sizes = (
        "quick sizes"
        if quick
        else "RevNet-38 at batch 32, 32x32; dense: depth 64, halves 64, hidden 256, batch 256"
    )
    body = (
        f"Grad steps with the drift check off / on ({sizes}); {rounds} shuffled rounds, "
        "`none` timed against itself for the noise. Memory: XLA's compiled analysis (ratios to "
        "`none`).\n\n" + "\n".join(rows)
    )
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, (name, r) in enumerate(ratios.items()):
        ax.bar([j * 3 + i for j in range(len(FALLBACKS))], r, label=name)
    ax.set_xticks([j * 3 + 0.5 for j in range(len(FALLBACKS))], FALLBACKS)
    ax.axhline(TIME_BOUND, color="k", ls=":", label=f"{TIME_BOUND}x")
    ax.set_ylabel("step time / fallback=none")
    ax.set_title("the drift check's step time", fontsize=9)
    ax.legend(fontsize=8)
    return Result("drift_cost", body, {"drift_cost.png": fig}, targets)
