"""Efficiency: achieved FLOP/s of a training step against this machine's dense matmul FLOP/s.

FLOPs of the grad step are counted from its jaxpr (``rn.count_flops``: 2 x MACs for dots and
convolutions, one per element for other arithmetic, scan bodies times their length) and divided
by the step time; the reference is a dense float32 2048 x 2048 matmul timed in the same shuffled
rounds as the step, so the fraction is the median over rounds of the step's FLOP/s over the
matmul's in that round. The transformer's rounds are the transformer benchmark's own (the same
measurement, so the two files show the same step time). Where the time goes: a
``jax.profiler`` trace of the step, each XLA thunk's exclusive time attributed to matmul /
convolution work (a dot, a convolution, or a fusion containing one, per the compiled HLO) or to
the rest (elementwise and reduction
fusions: softmax, LayerNorm, GELU, BatchNorm, the optimizer-free gradient sums; copies; loops).
"""

from __future__ import annotations

import collections
import functools
import glob
import gzip
import json
import re
import tempfile
from typing import Any

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks import transformer as tb  # noqa: E402
from benchmarks._common import Paired, Result, Target, paired, verdict  # noqa: E402
from models import revnet as R  # noqa: E402

#: XLA:CPU thunk names (before the first ".") by the kind of work a profile attributes to them.
_ELEMENTWISE = frozenset(
    "add subtract multiply divide reduce exponential maximum select compare reduce-window "
    "convert".split()
)
_DATA_MOVEMENT = frozenset(
    "copy transpose dynamic-update-slice dynamic-slice slice concatenate pad broadcast bitcast "
    "reverse iota scatter gather".split()
)


def _matmul_instructions(hlo: str) -> set[str]:
    """Names of HLO instructions that are, or fuse, a dot or a convolution."""
    heavy = {"dot", "convolution"}
    bodies, current = {}, None
    for line in hlo.splitlines():
        if m := re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line):
            current = m.group(1)
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    has_heavy = {
        name
        for name, lines in bodies.items()
        if any(re.search(r"= \S+ (dot|convolution)\(", ln) for ln in lines)
    }
    out = set()
    for lines in bodies.values():
        for ln in lines:
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ (\w[\w\-]*)\(", ln)
            if not m:
                continue
            name, op = m.groups()
            calls = re.findall(r"calls=%?([\w.\-]+)", ln)
            if op in heavy or any(c in has_heavy for c in calls):
                out.add(name)
    return out


def _profile(compiled: Any, args: tuple, steps: int = 3) -> dict[str, float]:
    """Exclusive seconds per category of the XLA thunks of ``steps`` runs of ``compiled``."""
    heavy = _matmul_instructions(compiled.as_text())
    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        (path,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    instr = re.compile(r"^[a-z][\w\-]*\.\d+$|^[a-z][\w\-]*$")
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and instr.match(e["name"]) and not e["name"].startswith("$"):
            by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    totals: dict[str, float] = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda t: (t[0], -t[1]))
        stack: list[list] = []  # [end, name, start, time of children]
        exclusive: dict[str, float] = collections.Counter()
        for start, end, name in [*evs, (float("inf"), float("inf"), "")]:
            # Close every open event that ended before this one starts (a thunk of a loop body
            # nests inside its while thunk on the same thread).
            while stack and stack[-1][0] <= start:
                s_end, s_name, s_start, s_child = stack.pop()
                exclusive[s_name] += (s_end - s_start) - s_child
                if stack:
                    stack[-1][3] += s_end - s_start
            stack.append([end, name, start, 0.0])
        for name, us in exclusive.items():
            base = name.split(".")[0].removeprefix("wrapped_")
            if name in heavy:
                key = "matmul / convolution (dots and fusions containing one)"
            elif base in ("while", "call", "conditional"):
                key = "loop control (while / call)"
            elif "fusion" in base or base in _ELEMENTWISE:
                key = "elementwise / reduction fusions"
            elif base in _DATA_MOVEMENT:
                key = "copies and data movement"
            else:
                key = f"other ({base})"
            totals[key] += us / 1e6 / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _row(
    label: str, step: Any, compiled: Any, args: tuple, times: Paired, key: str, n: int
) -> dict:
    """A step's FLOPs, time and FLOP/s against the matmul timed in the same rounds; ``compiled``
    is ``jax.jit(step)``'s executable for ``args`` (the one timed), profiled here."""
    flops = rn.count_flops(step, *args)
    # step FLOP/s / matmul FLOP/s in a round = flops / matmul flops x matmul time / step time.
    fraction = flops / wl.matmul_flops(n) * times.ratio(tb.MATMUL, key)
    seconds = times.seconds(key)
    row = {
        "label": label,
        "flops": flops,
        "matmul_flops": rn.matmul_flops(step, *args),
        "seconds": seconds,
        "rate": flops / seconds,
        "fraction": fraction,
        "peak": wl.matmul_flops(n) / times.seconds(tb.MATMUL),
        "times": times,
        "profile": _profile(compiled, args),
    }
    print(f"{label}: {flops / seconds / 1e9:.1f} GFLOP/s = {fraction:.0%}", flush=True)
    return row


def run(quick: bool = False) -> Result:
    n = tb.matmul_size(quick)
    config = wl.LM_QUICK if quick else wl.LM_FULL
    rounds = tb.rounds(quick)
    model = wl.lm(config)
    presets = tb.QUICK_PRESETS if quick else tuple(tb.REMAT_PRESETS)
    lm_times = tb.timed(config, presets, rounds, n)  # cached when the transformer benchmark ran
    rows = [
        _row(
            f"transformer ({config}), no remat",
            model.grad_step("none"),
            tb.compile_presets(config, presets)["none"][0],  # the executable timed (cached)
            (model.params, model.tokens),
            lm_times,
            "none",
            n,
        )
    ]
    # RevNet at a small batch: its convolutions run inside lax.scan, which XLA:CPU executes far
    # slower than unrolled convolutions (jax#12868; see the revnet benchmark).
    # Quick: the revnet benchmark's quick RevNet-38 stored (remat none) at its batch and size,
    # the same program (the tests share their compiles between benchmarks).
    batch, image = 8, (8 if quick else 32)
    arch = R.ARCHS["revnet38"]
    module = R.RevNet(arch if not quick else R.Arch((2, 2, 2), arch.widths, arch.stem, False))
    clf = wl.classifier("revnet38", batch=batch, image_size=image, module=module)
    clf_step = jax.jit(clf.grad_step).lower(*clf.args).compile()
    label = "revnet38"
    clf_times = paired(
        {label: functools.partial(clf_step, *clf.args), tb.MATMUL: wl.matmul_fn(n)},
        itself=label,
        rounds=rounds,
    )
    rows.append(
        _row(
            f"RevNet-38 grad step (batch {batch}, {image}x{image}x3, BatchNorm train)",
            clf.grad_step,
            clf_step,
            clf.args,
            clf_times,
            label,
            n,
        )
    )

    lines = [
        f"Reference: a dense float32 {n}x{n} matmul, timed in the same shuffled rounds as each "
        "step (the transformer's are the transformer benchmark's rounds). Step FLOPs counted "
        "from the jaxpr; step time and the matmul's GFLOP/s are medians over rounds; the share "
        "of the matmul's FLOP/s is the median over rounds of the ratio within a round, with the "
        "step timed against itself as its noise.",
        "",
        "| step | GFLOPs / step | matmul share of FLOPs | step time | achieved GFLOP/s "
        "| matmul GFLOP/s (same rounds) | of matmul FLOP/s | noise |",
        "|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['flops'] / 1e9:.2f} | {r['matmul_flops'] / r['flops']:.1%} | "
            f"{r['seconds']:.3f} s | {r['rate'] / 1e9:.1f} | {r['peak'] / 1e9:.1f} | "
            f"{r['fraction']:.1%} | {r['times'].noise_text()} |"
        )
    lines += ["", "Where the time goes (profiled XLA thunks, exclusive time per step):", ""]
    for r in rows:
        total = sum(r["profile"].values())
        lines += [
            f"**{r['label']}** (profiled total {total:.3f} s/step)",
            "",
            "| category | s / step | share |",
            "|---|--:|--:|",
        ]
        lines += [f"| {k} | {v:.3f} | {v / total:.0%} |" for k, v in r["profile"].items()]
        mm = next((v for k, v in r["profile"].items() if k.startswith("matmul")), 0.0)
        if mm:
            rate = r["matmul_flops"] / mm
            lines += [
                "",
                f"Matmul work alone runs at {rate / 1e9:.1f} GFLOP/s "
                f"({rate / r['peak']:.0%} of the {n}x{n} matmul's median).",
                "",
            ]
        else:
            lines.append("")

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    labels = [r["label"].split(" (")[0] for r in rows]
    cats = sorted({k for r in rows for k in r["profile"]})
    left = [0.0] * len(rows)
    for c in cats:
        widths = [r["profile"].get(c, 0.0) for r in rows]
        ax.barh(labels, widths, left=left, label=c)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("seconds per step (profiled XLA thunks, exclusive)")
    fractions = ", ".join(f"{r['fraction']:.0%}" for r in rows)
    ax.set_title(f"Step time by kind of work; {fractions} of {n}x{n} matmul FLOP/s", fontsize=8)
    ax.legend(fontsize=6, loc="lower right")

    tf = rows[0]
    noise = tf["times"].noise
    targets = [
        Target(
            "transformer step >= 50% of dense matmul FLOP/s",
            verdict(tf["fraction"], 0.5, noise, at_most=False),
            f"{tf['fraction']:.1%} ({tf['rate'] / 1e9:.1f} of {tf['peak'] / 1e9:.1f} GFLOP/s, "
            "medians)",
            tf["times"].noise_text(),
        ),
    ]
    return Result("efficiency", "\n".join(lines), {"efficiency.png": fig}, targets)
