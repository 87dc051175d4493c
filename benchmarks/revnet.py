"""RevNet vs ResNet: grad-step memory, parameters, step time and the largest batch that fits.

RevNet-38/110/164 against ResNet-32/110/164 (the pairs of Gomez et al. 2017, Table 1) on
CIFAR-sized inputs, BatchNorm in training mode (``mutable=["batch_stats"]``). Memory is XLA's
compiled analysis of ``jax.jit(jax.grad(loss, has_aux=True))``: temp bytes (activations and
scratch) and peak (temp + arguments + outputs). Memory is affine in the batch, so two compiles
give bytes per example and the fixed part, hence the largest batch under a budget (no OOM
probing). Time: the RevNet's and the ResNet's grad steps (and the ResNet's again, the noise) in
shuffled rounds; the ratio is the median over rounds of the two times in the same round.

The evidence for where a RevNet's bytes go: ``rn.memory_report`` residuals grouped by top-level
module, and XLA's temp bytes of the same RevNet with its reversible stacks removed (one unit per
stage: stem, the three non-reversible downsampling units, head) and with plain autodiff
(``reversible=False``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
import time
from collections.abc import Callable
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks import depth as depth_bench  # noqa: E402
from benchmarks._common import Paired, Result, Target, paired, verdict  # noqa: E402
from models import resnet as RN  # noqa: E402
from models import revnet as R  # noqa: E402
from models.summary import count_params  # noqa: E402
from remat_nn import format_bytes  # noqa: E402

GIB = 2**30
BUDGETS = {"2 GiB": 2 * GIB, "8 GiB": 8 * GIB}
PAIRS = [("revnet38", "resnet32"), ("revnet110", "resnet110"), ("revnet164", "resnet164")]


def _arch(name: str, quick: bool) -> R.Arch:
    # Quick mode (tests): the same widths with 2 units per stage, so compiles take seconds.
    return dataclasses.replace(R.ARCHS[name], units=(2, 2, 2)) if quick else R.ARCHS[name]


def _module(name: str, quick: bool):
    # As the registry builds them (models.build): a RevNet recomputes its non-reversible
    # downsampling units in the backward (remat `full`), a ResNet stores every activation.
    if name.startswith("revnet"):
        return R.RevNet(_arch(name, quick), remat=R.REMAT_PRESETS["full"])
    return RN.ResNet(_arch(name, quick))


@dataclasses.dataclass
class _Compiled:
    """A grad step compiled for abstract inputs: the executable, XLA's memory analysis, the
    compile seconds and the abstract model (its shapes)."""

    executable: Any
    memory: rn.CompiledMemory
    compile_s: float
    model: wl.Classifier


def _compiled(
    name: str, quick: bool, batch: int, image: int, unroll: int | None = None
) -> _Compiled:
    """The grad step of ``name`` as the registry builds it; for a RevNet, ``unroll`` of its
    reversible stacks (``None``: the default, unrolled on CPU). Each network, batch and unroll
    compiles once: the memory table, the step times and the unroll table share a compile where
    their batches coincide (all of quick mode's; the full run's memory and time batches)."""
    return _compile(name, quick, batch, image, unroll)  # one cache key however it is called


@functools.cache
def _compile(name: str, quick: bool, batch: int, image: int, unroll: int | None) -> _Compiled:
    module = _module(name, quick)
    if name.startswith("revnet"):
        module = module.copy(unroll=unroll)
    model = wl.classifier(name, batch=batch, image_size=image, module=module, materialize=False)
    start = time.perf_counter()
    executable, mem = wl.compile_step(model.grad_step, *model.args)
    return _Compiled(executable, mem, time.perf_counter() - start, model)


def _measure(name: str, quick: bool, batch: int, half: int, image: int) -> dict:
    """Temp / peak at ``batch`` and ``half``, params and the affine fit of peak in batch."""
    full = _compiled(name, quick, batch, image)
    mem, mem_half = full.memory, _compiled(name, quick, half, image).memory
    per_example = (mem.peak_bytes - mem_half.peak_bytes) / (batch - half)
    fixed = mem.peak_bytes - per_example * batch
    row = {
        "params": count_params(full.model.params),
        "temp": mem.temp_size_in_bytes,
        "peak": mem.peak_bytes,
        "per_example": per_example,
        "fixed": fixed,
        "max_batch": {k: max(0, math.floor((b - fixed) / per_example)) for k, b in BUDGETS.items()},
    }
    print(f"{name}: temp {format_bytes(row['temp'])}, peak {format_bytes(row['peak'])}", flush=True)
    return row


def _step(name: str, quick: bool, batch: int, image: int, unroll: int | None) -> Callable[[], Any]:
    """:func:`_compiled`'s step, ready to call on values of its shapes."""
    step = _compiled(name, quick, batch, image, unroll)
    return functools.partial(step.executable, *wl.concrete(step.model).args)


def _dense_unroll(depth: int, rounds: int) -> tuple[Paired, dict[str, float]]:
    """The depth benchmark's dense coupling stack (benchmarks/depth.py) rolled and unrolled:
    paired grad-step times and compile seconds (why the default unrolls convolutions only)."""
    params = depth_bench.init(depth, 64, 256, jax.random.key(0))
    x = (jnp.ones((256, 64)), jnp.ones((256, 64)))
    fns, compile_s = {}, {}
    for key, unroll in (("unroll=1 (default)", 1), ("unrolled", True)):
        fwd = lambda p, x, u=unroll: rn.reversible_scan(depth_bench.BLOCK, p, x, unroll=u)[0]  # noqa: E731
        grad = jax.jit(jax.grad(functools.partial(depth_bench._loss, fwd)))
        start = time.perf_counter()
        compiled = grad.lower(params, x).compile()
        compile_s[key] = time.perf_counter() - start
        fns[key] = functools.partial(compiled, params, x)
    return paired(fns, itself="unroll=1 (default)", rounds=rounds, min_seconds=0.05), compile_s


def _by_module(name: str, quick: bool, batch: int, image: int) -> dict[str, int]:
    """Residual bytes of the grad step grouped by the top-level module that produces them."""
    model = _compiled(name, quick, batch, image).model
    report = rn.memory_report(lambda *a: model.loss(*a)[0], *model.args)
    groups: dict[str, int] = collections.Counter()
    for r in report.residuals:
        if r.kind in ("argument", "constant", "literal"):
            key = "arguments (params, batch_stats, images)"
        elif m := re.search(r"\b(stage\d+_down|stage\d+|stem|head)\b", r.scope):
            key = m.group(1)
        elif "_reversible.py" in r.source:
            key = "reversible stack outputs (y1, y2)"
        else:
            key = "other"
        groups[key] += r.nbytes
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def unroll_peak_lines(name: str, quick: bool, batch: int, image: int) -> list[str]:
    """The buffers at XLA's peak of ``name``'s grad step with its reversible stacks unrolled
    and rolled (``rn.explain_peak``): temp by category, and the saved residuals only one keeps."""
    peaks = {}
    for label, unroll in (("unrolled", None), ("rolled", 1)):
        module = _module(name, quick).copy(unroll=unroll)
        model = wl.classifier(name, batch=batch, image_size=image, module=module, materialize=False)
        peaks[label] = rn.explain_peak(model.grad_step, *model.args)
    cats = {k: {c: g["bytes"] for c, g in r.by_category().items()} for k, r in peaks.items()}
    temp_cats = ("saved residual", "recomputed", "gradient", "transient", "fragmentation")
    saved = {k: [b for b in r.buffers if b.category == "saved residual"] for k, r in peaks.items()}
    only = _unmatched(saved["unrolled"], saved["rolled"])
    params = cats["unrolled"].get("argument: params", 0)
    extra = sum(b.nbytes for b in only["unrolled"]) - sum(b.nbytes for b in only["rolled"])
    frag = cats["unrolled"].get("fragmentation", 0) - cats["rolled"].get("fragmentation", 0)
    diff = (
        peaks["unrolled"].compiled.temp_size_in_bytes - peaks["rolled"].compiled.temp_size_in_bytes
    )

    def row(b: rn.Buffer) -> str:
        op = "/".join(b.op_name.split("/")[-3:]) or "(an XLA copy)"
        return (
            f"| {b.shape} | {format_bytes(b.nbytes)} | `{op}` | {b.source or '-'} | "
            f"{b.live[0]}-{b.live[1]} |"
        )

    return [
        f"### What the unrolled stacks keep ({name} at batch {batch}, `rn.explain_peak`)",
        "",
        f"The buffers live at XLA's peak of the grad step (they sum to XLA's peak to the byte: "
        f"{', '.join(f'{k} {r.difference:+d} B' for k, r in peaks.items())}); temp by category:",
        "",
        "| category | unrolled | rolled | difference |",
        "|---|--:|--:|--:|",
        *(
            f"| {c} | {format_bytes(cats['unrolled'].get(c, 0))} | "
            f"{format_bytes(cats['rolled'].get(c, 0))} | "
            f"{format_bytes(cats['unrolled'].get(c, 0) - cats['rolled'].get(c, 0))} |"
            for c in temp_cats
        ),
        f"| **temp** | {format_bytes(peaks['unrolled'].compiled.temp_size_in_bytes)} | "
        f"{format_bytes(peaks['rolled'].compiled.temp_size_in_bytes)} | {format_bytes(diff)} |",
        "",
        "Saved residuals (made in the forward pass, live into the backward) at one peak with no "
        "counterpart of the same shape at the other (live range = XLA schedule indices):",
        "",
        "| step | shape | bytes | op (last 3 of its name stack) | source | live |",
        "|---|---|--:|---|---|---|",
        *(f"| {k} " + row(b) for k in ("unrolled", "rolled") for b in only[k]),
        "",
        _unroll_reading(diff, extra, frag, params, peaks),
    ]


def _unroll_reading(diff: int, extra: int, frag: int, params: int, peaks: dict) -> str:
    where = ", ".join(
        f"{k} at schedule index {r.peak_index} of {len(r.schedule)}" for k, r in peaks.items()
    )
    if not 0 < extra <= diff or extra + frag < diff * 0.9:
        return (
            f"The two peaks ({where}) differ in more than kept forward values here: read the "
            "category table."
        )
    return (
        f"So of the {format_bytes(diff)}, {format_bytes(extra)} is forward values only the "
        f"unrolled step keeps into the backward and {format_bytes(frag)} is fragmentation of "
        f"XLA's packed temp allocation ({where}); no parameter-sized copy (the parameters are "
        f"{format_bytes(params)} in all). A coupling's reconstruction in the backward computes "
        "its G (or F) again on the same input as the forward did; unrolled, both are in one "
        "straight-line program, and the kept value is consistent with XLA merging the two "
        "(common-subexpression elimination) and holding the forward's result through the "
        "backward, which a loop body's boundary prevents."
    )


def _unmatched(a: list[rn.Buffer], b: list[rn.Buffer]) -> dict[str, list[rn.Buffer]]:
    """Buffers of ``a`` and ``b`` left after pairing equal (shape, source), then equal shape and
    scope (the name stack less the op and ``closed_call``: a loop's carry and the unrolled
    values it stands for), then equal shapes."""

    def scope(x: rn.Buffer) -> str:
        return x.op_name.rsplit("/", 1)[0].replace("/closed_call", "")

    left_a, left_b = list(a), list(b)
    for key in (
        lambda x: (x.shape, x.source),
        lambda x: (x.shape, scope(x)),
        lambda x: x.shape,
    ):
        for x in list(left_a):
            match = next((y for y in left_b if key(y) == key(x)), None)
            if match is not None:
                left_a.remove(x)
                left_b.remove(match)
    return {"unrolled": left_a, "rolled": left_b}


def _variant_temp(module, batch: int, image: int) -> int:
    model = wl.classifier(
        "variant", batch=batch, image_size=image, module=module, materialize=False
    )
    return wl.compile_step(model.grad_step, *model.args)[1].temp_size_in_bytes


class _Stack(fnn.Module):
    depth: int
    bn: bool

    @fnn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            if self.bn:
                x = fnn.BatchNorm(use_running_average=False)(x)
            x = fnn.Conv(x.shape[-1], (3, 3), use_bias=False)(jax.nn.relu(x))
        return x


def _buffers_per_layer(bn: bool) -> float:
    """Activation-sized buffers XLA keeps per (BN-)ReLU-conv layer: slope of temp in depth."""
    x = jnp.zeros((8, 16, 16, 64))
    temps = []
    for depth in (2, 6):
        module = _Stack(depth, bn)
        variables = jax.eval_shape(module.init, jax.random.key(0), x)

        def loss(params, stats, x, module=module):
            variables = {"params": params, "batch_stats": stats}
            return jnp.mean(module.apply(variables, x, mutable=["batch_stats"])[0] ** 2)

        args = (variables["params"], variables.get("batch_stats", {}), x)
        temps.append(wl.compile_step(jax.grad(loss), *args)[1].temp_size_in_bytes)
    return (temps[1] - temps[0]) / 4 / (x.size * x.dtype.itemsize)


def run(quick: bool = False) -> Result:
    pairs = PAIRS[:1] if quick else PAIRS
    batch, half, image = (8, 4, 8) if quick else (128, 64, 32)
    rows = {}
    for rev, res in pairs:
        for name in (res, rev):
            rows[name] = _measure(name, quick, batch, half, image)
    # Step time of the smallest pair at the memory table's batch; the reversible stacks are
    # unrolled on CPU (their default for convolutional blocks): in a loop, XLA:CPU runs the
    # convolutions far slower (jax-ml/jax#12868), which the unroll table below measures.
    time_batch, rounds = (8, 1) if quick else (batch, 5)
    t_rev, t_res = pairs[0]
    fns = {n: _step(n, quick, time_batch, image, None) for n in (t_res, t_rev)}
    steps = paired(fns, itself=t_res, rounds=rounds)
    step_ratio = steps.ratio(t_rev, t_res)
    # Rolled vs unrolled: at batch 8, since a rolled RevNet-38 step at batch 128 takes minutes.
    unroll_batch = 8
    variants = {"unrolled (default)": None, "unroll=1": 1}
    unroll_steps = {k: _compiled(t_rev, quick, unroll_batch, image, u) for k, u in variants.items()}
    fns = {k: _step(t_rev, quick, unroll_batch, image, u) for k, u in variants.items()}
    rolled = paired(fns, itself="unrolled (default)", rounds=rounds)
    rolled_ratio = rolled.ratio("unroll=1", "unrolled (default)")
    # Every RevNet rolled, against its unrolled row above (quick: unroll_steps' compile).
    rolled_temp = {
        rev: _compiled(rev, quick, batch, image, 1).memory.temp_size_in_bytes for rev, _ in pairs
    }
    dense_depth = 8 if quick else 64
    dense, dense_compile = _dense_unroll(dense_depth, 1 if quick else 7)
    dense_ratio = dense.ratio("unrolled", "unroll=1 (default)")
    dense_compile_ratio = dense_compile["unrolled"] / dense_compile["unroll=1 (default)"]
    print(
        f"{t_rev} / {t_res} {step_ratio:.2f}x at batch {time_batch}; {t_rev} rolled "
        f"{rolled_ratio:.2f}x unrolled at batch {unroll_batch}",
        flush=True,
    )

    # --- evidence: where the largest RevNet's bytes go ---
    rev, res = pairs[-1]
    arch = _arch(rev, quick)
    by_module = _by_module(rev, quick, batch, image)
    total_res = sum(by_module.values())
    no_stacks = _variant_temp(
        R.RevNet(R.Arch((1, 1, 1), arch.widths, arch.stem, True), remat=R.REMAT_PRESETS["full"]),
        batch,
        image,
    )
    plain = _variant_temp(R.RevNet(arch, reversible=False), batch, image)
    stored = _variant_temp(R.RevNet(arch), batch, image)  # remat none: the paper's layout
    per_layer, per_layer_nobn = _buffers_per_layer(True), _buffers_per_layer(False)
    print(
        f"{rev}: without reversible stacks {format_bytes(no_stacks)}, plain autodiff "
        f"{format_bytes(plain)}",
        flush=True,
    )

    # --- tables ---
    setup = f"batch {batch}, {image}x{image}x3, float32, BatchNorm in training mode"
    if quick:
        setup += "; quick: 2 units per stage"
    lines = [
        f"Grad step `jax.jit(jax.grad(loss, has_aux=True))` ({setup}); temp and peak are XLA's "
        f"compiled memory analysis (peak = temp + arguments + outputs). Largest batch: peak "
        f"fitted as fixed + per-example x batch from compiles at batch {batch} and {half} "
        "(the budget bounds XLA's peak; parameters, gradients and inputs included).",
        "",
        "| model | params | temp | peak | ResNet temp / RevNet temp | per example | "
        + " | ".join(f"max batch in {k}" for k in BUDGETS)
        + " |",
        "|---|--:|--:|--:|--:|--:|" + "--:|" * len(BUDGETS),
    ]
    for r_name, s_name in pairs:
        for name in (s_name, r_name):
            row = rows[name]
            ratio = rows[s_name]["temp"] / rows[r_name]["temp"] if name == r_name else 1.0
            lines.append(
                f"| {name} | {row['params'] / 1e6:.3f}M | {format_bytes(row['temp'])} | "
                f"{format_bytes(row['peak'])} | {ratio:.2f}x | {format_bytes(row['per_example'])} "
                "| " + " | ".join(str(row["max_batch"][k]) for k in BUDGETS) + " |"
            )
    lines += [
        "",
        f"## Step time (batch {time_batch}, {image}x{image}x3; {steps.rounds} shuffled rounds, "
        f"{t_res} also timed against itself)",
        "",
        "| model | grad step (median over rounds) | vs " + t_res + " (paired) |",
        "|---|--:|--:|",
        *(
            f"| {n} | {steps.seconds(n):.3f} s | {steps.ratio(n, t_res):.2f}x |"
            for n in (t_res, t_rev)
        ),
        "",
        f"{t_rev} / {t_res} = **{step_ratio:.2f}x** (noise {steps.noise_text()}; anchors: "
        "MemCNN 1.16-1.47x; FLOPs 4/3 of a stored-activation backward).",
        "",
        "## Unrolled reversible stacks",
        "",
        "`rn.reversible_scan` / `nn.ReversibleSequence` take `unroll` (passed to the scans of "
        "the forward and of the backward). Its default unrolls on CPU when the block "
        "convolves: XLA:CPU runs convolutions inside a while loop far slower than unrolled "
        "(jax-ml/jax#12868, open). Dense blocks stay a loop: the depth benchmark's dense "
        f"coupling stack at depth {dense_depth} (batch 256) runs **{dense_ratio:.2f}x** the "
        f"time unrolled ({dense.rounds} shuffled rounds, noise {dense.noise_text()}) and "
        f"compiles in {dense_compile['unrolled']:.1f} s instead of "
        f"{dense_compile['unroll=1 (default)']:.1f} s ({dense_compile_ratio:.0f}x). The "
        "backward orders each block's reconstruction after the block above "
        "(`remat_nn/_tie.py`), or XLA would run all reconstructions first and hold them.",
        "",
        f"{t_rev} grad step at batch {unroll_batch} ({rolled.rounds} shuffled rounds, noise "
        f"{rolled.noise_text()}):",
        "",
        "| reversible stacks | grad step | vs unrolled (paired) | compile | XLA temp |",
        "|---|--:|--:|--:|--:|",
        *(
            f"| {k} | {rolled.seconds(k):.3f} s | {rolled.ratio(k, 'unrolled (default)'):.2f}x "
            f"| {v.compile_s:.1f} s | {format_bytes(v.memory.temp_size_in_bytes)} |"
            for k, v in unroll_steps.items()
        ),
        "",
        f"XLA temp at batch {batch}, unrolled (the table above) vs rolled: "
        + ", ".join(
            f"{r} {format_bytes(rows[r]['temp'])} vs {format_bytes(rolled_temp[r])} "
            f"({rows[r]['temp'] / rolled_temp[r] - 1:+.0%})"
            for r, _ in pairs
        )
        + ". What the unrolled stacks keep is below (from the buffers at XLA's peak); the "
        "reversible stacks' activation memory stays flat in depth either way "
        "(tests/invertible/test_reversible.py: two stacks in series, depth 4 and 12)"
        + (
            f"; RevNet-38 -> RevNet-110 (same widths, 3x the reversible units) moves the "
            f"difference from {format_bytes(rows['revnet38']['temp'] - rolled_temp['revnet38'])} "
            f"to {format_bytes(rows['revnet110']['temp'] - rolled_temp['revnet110'])}."
            if "revnet110" in rows
            else "."
        ),
    ]

    if not quick:  # two more compiles of the full step, with XLA's dump
        lines += ["", *unroll_peak_lines(t_rev, quick, batch, image)]

    ratio = rows[res]["temp"] / rows[rev]["temp"]
    lines += [
        "",
        f"## Where {rev}'s memory goes ({ratio:.1f}x below {res})",
        "",
        f"Residuals of {rev}'s grad step (`rn.memory_report`, what the forward pass keeps for "
        f"the backward; total {format_bytes(total_res)}), by the top-level module producing them:",
        "",
        "| module | residual bytes | share |",
        "|---|--:|--:|",
    ]
    lines += [f"| {k} | {format_bytes(b)} | {b / total_res:.0%} |" for k, b in by_module.items()]
    down = sum(b for k, b in by_module.items() if k.endswith("_down"))
    lines += [
        "",
        f"XLA temp bytes of the same network ({setup}):",
        "",
        "| variant | XLA temp |",
        "|---|--:|",
        f"| {rev} (reversible stacks of {'-'.join(str(u - 1) for u in arch.units)} units) | "
        f"{format_bytes(rows[rev]['temp'])} |",
        f"| stacks removed: stem, the 3 non-reversible downsampling units, head | "
        f"{format_bytes(no_stacks)} |",
        f"| same {rev}, plain autodiff (`reversible=False`) | {format_bytes(plain)} |",
        f"| {res} | {format_bytes(rows[res]['temp'])} |",
        "",
        f"- The reversible stacks cost {format_bytes(rows[rev]['temp'] - no_stacks)} of XLA temp "
        f"({(rows[rev]['temp'] - no_stacks) / rows[rev]['temp']:.0%}): their outputs, cotangents "
        f"and one block's backward working set. Without reconstruction the same stacks would "
        f"need {format_bytes(plain - no_stacks)} more.",
        f"- The other {no_stacks / rows[rev]['temp']:.0%} ({format_bytes(no_stacks)}) is the "
        f"part that is not reversible: the first unit of each stage changes width or resolution "
        f"(Gomez et al. 2017, Section 3.2). Under remat `full` (the default of `models.build`) "
        f"these units keep only their inputs and recompute the rest in the backward; their "
        f"residuals are {down / total_res:.0%} of all residual bytes. Stored instead "
        f"(`remat=none`, the paper's and MemCNN's layout) the network takes "
        f"{format_bytes(stored)}, 1/{rows[res]['temp'] / stored:.2f} of {res}'s. They run at "
        f"{rev}'s widths {arch.widths} (twice {res}'s {_arch(res, quick).widths}: each coupling "
        f"half has a ResNet stage's width)"
        + (
            f", and stage1's downsampling F applies BN-ReLU-conv1x1 at the full {image}x{image} "
            "resolution before its stride-2 3x3."
            if arch.bottleneck
            else "."
        ),
        f"- So the ratio is bounded by {res} temp / non-reversible temp = "
        f"{rows[res]['temp'] / no_stacks:.1f}x however deep the reversible stacks are; the "
        f"memory of the reversible part is not the limit. XLA keeps {per_layer:.1f} "
        f"activation-sized buffers per training-mode BN-ReLU-conv3x3 layer (slope of a plain "
        f"stack of them, 64 channels; {per_layer_nobn:.1f} without the BN): both networks pay "
        f"it, and it is what makes each stored unit costly.",
        "- MemCNN's ~9.5x (RevNet-110 vs ResNet-110) counts basic-block networks whose "
        "downsampling units are narrow"
        + (
            f" (here RevNet-110 / ResNet-110 = "
            f"{rows['resnet110']['temp'] / rows['revnet110']['temp']:.1f}x)"
            if "revnet110" in rows
            else ""
        )
        + "; for the bottleneck pair the three downsampling units, stored, weigh more against "
        "54 ResNet units: recomputing them (the default) is what takes the ratio past 8x.",
    ]

    # --- figure ---
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [n for p in pairs for n in (p[1], p[0])]
    colors = ["tab:gray" if n.startswith("resnet") else "tab:green" for n in names]
    ax1.bar(names, [rows[n]["temp"] / 2**20 for n in names], color=colors)
    ax1.set_ylabel("XLA temp of the grad step (MiB)")
    ax1.set_title(f"Grad-step activation memory ({setup})", fontsize=8)
    ax1.tick_params(axis="x", labelrotation=30)
    budget = next(iter(BUDGETS))
    ax2.bar(names, [rows[n]["max_batch"][budget] for n in names], color=colors)
    ax2.set_ylabel(f"largest batch with peak <= {budget}")
    ax2.set_title("Largest batch that fits (affine fit of XLA's peak)", fontsize=8)
    ax2.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()

    targets = [
        Target(
            f"{t_rev} grad step <= 1.5x {t_res}'s on CPU at equal batch",
            verdict(step_ratio, 1.5, steps.noise, at_most=True),
            f"{step_ratio:.2f}x at batch {time_batch} (reversible stacks unrolled; rolled "
            f"{rolled_ratio:.1f}x slower at batch {unroll_batch})",
            steps.noise_text(),
        ),
    ]
    if not quick:
        targets.insert(
            0,
            Target(
                f"{rev} grad-step temp <= 1/8 of {res}'s",
                ratio >= 8,
                f"{format_bytes(rows[rev]['temp'])} vs {format_bytes(rows[res]['temp'])}: "
                f"1/{ratio:.2f} (downsampling units stored, remat=none: "
                f"{format_bytes(stored)}, 1/{rows[res]['temp'] / stored:.2f})",
            ),
        )
    return Result("revnet", "\n".join(lines), {"revnet_memory.png": fig}, targets)
