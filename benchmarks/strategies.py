"""Memory strategies side by side: XLA temp vs step time of each, and the Pareto front.

For ResNet-164 (CIFAR 32x32x3, BatchNorm in training mode) and the scanned transformer, every way
this toolkit trades compute for memory: no remat, per-unit (per-block) full remat, saving the
matmul / convolution outputs only, one checkpointed scan over the units, a nested checkpointed
scan (``rn.remat_scan`` via the models' ``scan_levels``), and reversible networks. Memory: XLA's
compiled temp bytes of ``jax.jit(jax.grad(loss))`` (exact). Time: every strategy's grad step of a
model, and its ``none`` a second time (the noise), in one set of shuffled, interleaved rounds; a
ratio is the median over rounds of two times from the same round. The Pareto front is the set of
strategies no other beats in both temp and median step time. Gradients of the nested scans are
compared with plain autodiff's (``rn.relative_error``) on the very weights and batch timed.
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

import models  # noqa: E402
import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks._common import Paired, Result, Target, paired, rounds_text  # noqa: E402
from models import resnet as RN  # noqa: E402
from models import revnet as R  # noqa: E402
from remat_nn import format_bytes  # noqa: E402

FULL, DOTS = R.REMAT_PRESETS["full"], R.REMAT_PRESETS["save_conv_out"]
LEVELS = 2  # levels of the nested scans
GRAD_TOL = 1e-5  # float32, max-scaled (rn.relative_error)
# A leaf whose exact gradient is 0 holds only round-off (the transformer's key bias: softmax
# ignores it): its scale is floored at 1% of the largest leaf's, as
# tests/models/test_models.py does.
FLOOR = 1e-2
QUICK_RES, QUICK_REV = (1, 3, 1), (1, 2, 1)  # units per stage in quick mode (compiles dominate)
NONE = "none"
NESTED = f"nested scan ({LEVELS} levels)"
REV_STORED = "reversible, downsampling stored"
REV_FULL = "reversible + recomputed downsampling"


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One row: the network it runs on, how it is built, and the options that make it."""

    name: str
    network: str
    options: str
    module: Any


def _cnn_strategies(quick: bool) -> list[Strategy]:
    res, rev = R.ARCHS["resnet164"], R.ARCHS["revnet164"]
    if quick:  # tiny: 2 identical (scannable) units in stage 1, 1 reversible unit in stage 1
        res, rev = (
            dataclasses.replace(a, units=u) for a, u in ((res, QUICK_RES), (rev, QUICK_REV))
        )
    resnet = functools.partial(RN.ResNet, res)
    return [
        Strategy(NONE, "ResNet-164", "remat none", resnet()),
        Strategy("per-unit full", "ResNet-164", "remat full", resnet(remat=FULL)),
        Strategy(
            "dots (conv outputs saved)", "ResNet-164", "remat save_conv_out", resnet(remat=DOTS)
        ),
        Strategy(
            "scanned units + full",
            "ResNet-164",
            "scan_units, remat full",
            resnet(remat=FULL, scan_units=True),
        ),
        Strategy(
            NESTED,
            "ResNet-164",
            f"scan_units, scan_levels {LEVELS}, remat full",
            resnet(remat=FULL, scan_units=True, scan_levels=LEVELS),
        ),
        Strategy(REV_STORED, "RevNet-164", "remat none", R.RevNet(rev)),
        Strategy(
            REV_FULL, "RevNet-164", "remat full (registry default)", R.RevNet(rev, remat=FULL)
        ),
    ]


def _lm_strategies(config: wl.LMConfig) -> list[Strategy]:
    build = lambda **kw: models.build("transformer", **config.options(), **kw)  # noqa: E731
    return [
        Strategy(NONE, "transformer", "scan_layers, remat none", build(remat="none")),
        Strategy("per-block full", "transformer", "remat full", build(remat="full")),
        Strategy(
            "dots (attention matmul outputs saved)",
            "transformer",
            "remat save_dot_except_mlp",
            build(remat="save_dot_except_mlp"),
        ),
        Strategy(
            NESTED,
            "transformer",
            f"scan_levels {LEVELS}, remat full",
            build(remat="full", scan_levels=LEVELS),
        ),
        Strategy("reversible", "transformer", "reversible", build(reversible=True)),
    ]


# --- measurements ------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    strategy: Strategy
    temp: int
    fn: Callable[[], Any]  # the compiled grad step on its inputs


def _scan_layout(model: wl.Classifier, module: Any) -> wl.Classifier:
    """``model``'s weights in ``module``'s layout (scanned units stacked: ``convert_units``)."""
    if not getattr(module, "scan_units", False):
        return dataclasses.replace(model, module=module)
    convert = functools.partial(RN.convert_units, arch=module.arch, scanned=True)
    return dataclasses.replace(
        model,
        module=module,
        params=convert(model.params),
        batch_stats=convert(model.batch_stats),
    )


def _cnn_rows(quick: bool, mem_batch: int, time_batch: int, image: int) -> list[Row]:
    rows = []
    base = None  # the ResNet's weights, shared by every ResNet layout (gradients comparable)
    for s in _cnn_strategies(quick):
        if isinstance(s.module, RN.ResNet):
            if base is None:
                base = wl.classifier(s.name, batch=time_batch, image_size=image, module=s.module)
            model = _scan_layout(base, s.module)
        else:
            model = wl.classifier(s.name, batch=time_batch, image_size=image, module=s.module)
        compiled, mem = wl.compile_step(model.grad_step, *model.args)
        if mem_batch != time_batch:  # memory at its own batch: one more compile, nothing runs
            abstract = wl.classifier(
                s.name, batch=mem_batch, image_size=image, module=s.module, materialize=False
            )
            _, mem = wl.compile_step(abstract.grad_step, *abstract.args)
        rows.append(Row(s, mem.temp_size_in_bytes, functools.partial(compiled, *model.args)))
        print(f"{s.network} {s.name}: temp {format_bytes(mem.temp_size_in_bytes)}", flush=True)
    return rows


def _lm_loss(module: Any, params: Any, tokens: jax.Array) -> jax.Array:
    return wl.next_token_loss(module.apply({"params": params}, tokens[:, :-1]), tokens)


def _lm_rows(config: wl.LMConfig) -> list[Row]:
    tokens = wl.lm_tokens(config)  # (B, T + 1)
    rows, params = [], {}
    for s in _lm_strategies(config):
        reversible = s.module.reversible
        if reversible not in params:  # one set of weights per layout (scanned / reversible)
            params[reversible] = jax.jit(s.module.init)(jax.random.key(0), tokens[:, :-1])
        p = params[reversible]["params"]
        step = jax.grad(functools.partial(_lm_loss, s.module))
        compiled, mem = wl.compile_step(step, p, tokens)
        rows.append(Row(s, mem.temp_size_in_bytes, functools.partial(compiled, p, tokens)))
        print(f"transformer {s.name}: temp {format_bytes(mem.temp_size_in_bytes)}", flush=True)
    return rows


def _time(rows: list[Row], rounds: int, quick: bool) -> Paired:
    fns = {r.strategy.name: r.fn for r in rows}
    # Quick sizes take milliseconds a step: repeat within a slot so timer resolution is no noise.
    times = paired(fns, itself=NONE, rounds=rounds, min_seconds=0.01 if quick else 0.0)
    print(", ".join(f"{k} {times.seconds(k):.3f} s" for k in times.samples), flush=True)
    return times


def _grad_errors(rows: list[Row], name: str, unscan: Any = None) -> tuple[float, float]:
    """``rn.relative_error`` of strategy ``name``'s step output against ``none``'s: every leaf
    on its own scale, and with the scales floored at ``FLOOR`` of the largest leaf's."""
    by = {r.strategy.name: r for r in rows}
    got, want = by[name].fn(), by[NONE].fn()
    if unscan is not None:  # ResNet: (grads, batch_stats) in the scanned layout
        got = (unscan(got[0]), unscan(got[1]["batch_stats"]))
        want = (want[0], want[1]["batch_stats"])
    return rn.relative_error(got, want), rn.relative_error(got, want, floor=FLOOR)


def pareto(points: dict[str, tuple[float, float]]) -> list[str]:
    """Names not dominated in (temp, time): no other point at most as high in both and lower in
    one. Ordered by time.

    >>> pareto({"a": (1, 5), "b": (2, 2), "c": (3, 3), "d": (1, 6)})
    ['b', 'a']
    """
    front = [
        k
        for k, (m, t) in points.items()
        if not any(m2 <= m and t2 <= t and (m2, t2) != (m, t) for m2, t2 in points.values())
    ]
    return sorted(front, key=lambda k: points[k][1])


# --- report ------------------------------------------------------------------------------------


def _table(rows: list[Row], times: Paired, front: list[str]) -> list[str]:
    base = next(r for r in rows if r.strategy.name == NONE)
    lines = [
        "| strategy | network | options | XLA temp | temp vs none | step time | time vs none "
        "(paired) | Pareto front |",
        "|---|---|---|--:|--:|--:|--:|:-:|",
    ]
    for r in rows:
        s = r.strategy
        lines.append(
            f"| {s.name} | {s.network} | {s.options} | {format_bytes(r.temp)} | "
            f"{r.temp / base.temp:.3f} | {times.seconds(s.name):.3f} s | "
            f"{times.ratio(s.name, NONE):.2f}x | {'yes' if s.name in front else ''} |"
        )
    return lines


def _panel(ax: Any, rows: list[Row], times: Paired, front: list[str], title: str) -> None:
    pts = {r.strategy.name: (times.seconds(r.strategy.name), r.temp / 2**20) for r in rows}
    for name, (t, m) in pts.items():
        ax.scatter([t], [m], color="tab:green" if name in front else "tab:gray", zorder=3)
        ax.annotate(name, (t, m), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.plot(*zip(*(pts[k] for k in front), strict=True), color="tab:green", lw=1, zorder=2)
    ax.set_xlabel("grad step time, median over rounds (s)")
    ax.set_ylabel("XLA temp of the grad step (MiB)")
    ax.set_title(title, fontsize=8)


def run(quick: bool = False) -> Result:
    mem_batch, time_batch, image = (8, 8, 8) if quick else (128, 8, 32)
    cnn_rounds, lm_rounds = (1, 1) if quick else (3, 5)
    config = wl.LM_QUICK if quick else wl.LM_FULL

    cnn = _cnn_rows(quick, mem_batch, time_batch, image)
    cnn_times = _time(cnn, cnn_rounds, quick)
    lm = _lm_rows(config)
    lm_times = _time(lm, lm_rounds, quick)

    res_arch = next(r for r in cnn if r.strategy.name == NESTED).strategy.module.arch
    unscan = functools.partial(RN.convert_units, arch=res_arch, scanned=False)
    cnn_err, cnn_floored = _grad_errors(cnn, NESTED, unscan)
    lm_raw, lm_err = _grad_errors(lm, NESTED)
    print(
        f"nested-scan gradient error: ResNet {cnn_err:.2e} (floored {cnn_floored:.2e}), "
        f"transformer {lm_err:.2e} floored (unfloored {lm_raw:.2e})",
        flush=True,
    )

    fronts = {}
    for key, rows, times in (("cnn", cnn, cnn_times), ("lm", lm, lm_times)):
        pts = {r.strategy.name: (float(r.temp), times.seconds(r.strategy.name)) for r in rows}
        fronts[key] = pareto(pts)

    cnn_setup = (
        f"CIFAR {image}x{image}x3, float32, BatchNorm in training mode; temp at batch {mem_batch}, "
        f"time at batch {time_batch}"
    )
    if quick:
        cnn_setup += f"; quick: ResNet units {QUICK_RES}, RevNet units {QUICK_REV}"
    scanned = res_arch.units[1] - 1  # identical units of stage 1 (the scanned ones)
    lengths = rn.remat_scan_lengths(scanned, LEVELS)
    lm_lengths = rn.remat_scan_lengths(config.n_layers, LEVELS)
    lines = [
        f"## ResNet-164 and RevNet-164 ({cnn_setup})",
        "",
        "Grad step `jax.jit(jax.grad(loss, has_aux=True))`. XLA temp: compiled memory analysis "
        f"(exact). Time: {rounds_text(cnn_times.rounds)}, each running every strategy's step "
        f"and `none` a second time in a fresh random order; noise {cnn_times.noise_text()}.",
        "",
        *_table(cnn, cnn_times, fronts["cnn"]),
        "",
        f"Pareto front (temp vs step time): {' -> '.join(fronts['cnn'])}.",
        "",
        "- RevNet-164 is a different network from ResNet-164 (its own widths, 1.75M vs 1.70M "
        "parameters; Gomez et al. 2017, Table 1): the two reversible rows compare networks of "
        "the same depth and size, not one network run two ways. `reversible + recomputed "
        "downsampling` is RevNet-164 as `models.build('revnet164')` builds it.",
        "- `dots` for a CNN is `save_conv_out`: each convolution's output is kept, BatchNorm and "
        "ReLU are recomputed (what `dots_saveable` is to a transformer).",
        f"- The scanned strategies run each stage's identical units in a loop (nested: "
        f"`rn.remat_scan`, {scanned} units of a stage in lengths {lengths}); XLA:CPU runs "
        "convolutions inside a loop far slower than unrolled (jax-ml/jax#12868), so their step "
        "times here are this backend's, not the recomputation's.",
        f"- Nested-scan gradient (and BatchNorm statistics) vs `none`, same weights and batch "
        f"(variables converted with `convert_units`): `rn.relative_error` = {cnn_err:.2e} "
        f"(each leaf on its own scale; {cnn_floored:.2e} with scales floored at "
        f"{FLOOR:.0%} of the largest leaf's).",
        "",
        f"## Transformer ({config})",
        "",
        f"Grad step `jax.jit(jax.grad(loss))`; XLA temp exact. Time: "
        f"{rounds_text(lm_times.rounds)}, every strategy and `none` again in a fresh random "
        f"order; noise {lm_times.noise_text()}.",
        "",
        *_table(lm, lm_times, fronts["lm"]),
        "",
        f"Pareto front (temp vs step time): {' -> '.join(fronts['lm'])}.",
        "",
        "- `dots` is `save_dot_except_mlp` (the attention projections q, k, v and out_proj "
        "saved, the MLP recomputed): the preset of `models.transformer.REMAT_PRESETS` closest "
        "to `dots_saveable`.",
        f"- Nested scan: `scan_levels {LEVELS}`, {config.n_layers} layers in lengths "
        f"{lm_lengths}: {sum(lm_lengths)} block inputs held at the peak vs "
        f"{config.n_layers} for one level; nesting pays from more layers on.",
        f"- Nested-scan gradient vs `none`, same parameters and tokens: `rn.relative_error` = "
        f"{lm_err:.2e} with each leaf's scale floored at {FLOOR:.0%} of the largest leaf's "
        f"(as tests/models/test_models.py compares the transformer); {lm_raw:.2e} with every leaf "
        "on its own scale. The floor is for the key biases: their exact gradient is 0 (softmax is "
        "invariant to them), so that leaf holds only round-off in both steps.",
    ]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    _panel(ax1, cnn, cnn_times, fronts["cnn"], f"ResNet-164 / RevNet-164 ({cnn_setup})")
    _panel(ax2, lm, lm_times, fronts["lm"], f"Transformer ({config})")
    fig.suptitle("Memory vs step time of each strategy; the Pareto front connected", fontsize=9)
    fig.tight_layout()

    temp = {r.strategy.name: r.temp for r in cnn}
    scan_full = temp["scanned units + full"]
    targets = [
        Target(
            f"ResNet-164 nested scan (scan_levels {LEVELS}): gradient equals plain autodiff "
            f"(rel. error <= {GRAD_TOL:.0e})",
            cnn_err <= GRAD_TOL,
            f"{cnn_err:.2e} at batch {time_batch}",
        ),
        Target(
            f"Transformer nested scan (scan_levels {LEVELS}): gradient equals plain autodiff "
            f"(rel. error <= {GRAD_TOL:.0e}, leaf scales floored at {FLOOR:.0%})",
            lm_err <= GRAD_TOL,
            f"{lm_err:.2e}",
        ),
        Target(
            f"ResNet-164 nested scan temp < one-level scanned units + full (batch {mem_batch})",
            temp[NESTED] < scan_full,
            f"{format_bytes(temp[NESTED])} vs {format_bytes(scan_full)}",
        ),
        Target(
            f"RevNet-164 with recomputed downsampling: the least temp of the CNN strategies "
            f"(batch {mem_batch})",
            temp[REV_FULL] == min(temp.values()),
            f"{format_bytes(temp[REV_FULL])}; next {format_bytes(sorted(temp.values())[1])}",
        ),
    ]
    return Result("strategies", "\n".join(lines), {"strategies.png": fig}, targets)
