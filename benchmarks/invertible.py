"""rn.invertible's analysis: time against the number of equations, and the guarantees it keeps.

The function is an unrolled stack of additive couplings (``y1 = x1 + tanh(x2 @ w)``,
``y2 = x2 + tanh(y1 @ w)``, six equations each, one weight matrix per half-coupling), traced
once; the time is that of the analysis (the monotone closure that decides what the walk rebuilds
and keeps) plus building the backward walk's schedule, the least of several runs, for both
``fallback`` settings, in CPU seconds of this process (the analysis is single-threaded Python;
on a shared machine wall time also counts the other processes' turns). Beside it: the
gradient error against plain autodiff at depth 64, the compiled temp bytes of the gradient
at depth 8 and 64 (flat: no activation is stored) and the XLA compile seconds of the gradient
against plain autodiff's (a known cost: the walk's checks are a few hundred scalar operations
per equation of the function, each compiled). Then the canonical-stacks matrix
(:mod:`benchmarks.invertible_matrix`): rn.invertible and the reversible stack's drift check,
cell by cell, against jax.grad's own error.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks import invertible_matrix as matrix  # noqa: E402
from benchmarks._common import Result, Target, verdict  # noqa: E402
from remat_nn._timing import timing_rounds  # noqa: E402
from remat_nn.invertible import _sketch  # noqa: E402
from remat_nn.invertible._analysis import analyze  # noqa: E402
from remat_nn.invertible._api import _trace  # noqa: E402
from remat_nn.invertible._scan_sketch import sketched  # noqa: E402

D, B = 16, 32


def stack(x1, x2, ws):
    for i in range(len(ws) // 2):
        x1 = x1 + jnp.tanh(x2 @ ws[2 * i])
        x2 = x2 + jnp.tanh(x1 @ ws[2 * i + 1])
    return x1, x2


def make_stack(n: int):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    w = 0.1 * jax.random.normal(k[0], (2 * n, D, D)) / np.sqrt(D)
    return jax.random.normal(k[1], (B, D)), jax.random.normal(k[2], (B, D)), list(w)


def _loss(f):
    return lambda *a: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(f(*a)))


def _analyse(traced, lossy_ok: bool) -> None:
    analysis = analyze(traced.jaxpr, lossy_ok=lossy_ok, num_constants=len(traced.consts))
    analysis.schedule(True, False)  # the backward walk's steps


def analysis_seconds(couplings: list[int], rounds: int) -> tuple[list[int], dict, float]:
    """Analysis time per stack size and fallback, in shuffled interleaved rounds.

    Returns the equation counts, the least seconds per (fallback, size) over the rounds (a
    collection of Python's cyclic GC adds ~0.15 s to whichever analysis it falls in), and the
    noise: the ratio of those least times of the largest-but-one size and an identical second
    copy of itself.
    """
    jobs = {}
    eqns = []
    for n in couplings:
        for name, lossy_ok in (("error", True), ("recompute", False)):
            traced = _trace(stack, make_stack(n), {}, lossy_ok=lossy_ok)
            jobs[name, n] = (traced, lossy_ok)
        eqns.append(len(traced.jaxpr.eqns))
    jobs["itself", couplings[-2]] = jobs["error", couplings[-2]]
    fns = {k: functools.partial(_analyse, *job) for k, job in jobs.items()}
    samples, _ = timing_rounds(fns, rounds=rounds, warmup=0, clock=time.process_time)
    least = {k: min(v) for k, v in samples.items()}
    noise = least["itself", couplings[-2]] / least["error", couplings[-2]]
    return eqns, least, noise


def compile_seconds(depths: list[int], rounds: int) -> tuple[dict, float]:
    """XLA's compile seconds of the gradient of the ``n``-coupling stack, ``rn.invertible``'s
    and plain autodiff's, in shuffled interleaved rounds (``timing_rounds``), each compile of a
    fresh lowering made beforehand (``jit(...).lower`` of a new function, untimed: JAX keeps a
    lowering's executable and caches traces by function): the median per (kind, n), and the
    noise (the smallest invertible compile against an identical copy of itself). A persistent
    compilation cache, if the process has one (``JAX_COMPILATION_CACHE_DIR``: the suite's quick
    run), may serve them instead: the text says so."""
    grads = {}
    for n in depths:
        for kind, f in (("invertible", rn.invertible(stack)), ("plain", stack)):
            grads[kind, n] = (jax.grad(_loss(f), argnums=(0, 1, 2)), make_stack(n))
    grads["itself", depths[0]] = grads["invertible", depths[0]]
    lowered = {
        k: [jax.jit(lambda *a, g=g: g(*a)).lower(*args) for _ in range(rounds)]
        for k, (g, args) in grads.items()
    }
    fns = {k: (lambda todo=todo: todo.pop().compile()) for k, todo in lowered.items()}
    samples, _ = timing_rounds(fns, rounds=rounds, warmup=0)
    med = {k: float(np.median(v)) for k, v in samples.items()}
    return med, med["itself", depths[0]] / med["invertible", depths[0]]


def _compile_rows(depths: list[int], rounds: int) -> str:
    med, noise = compile_seconds(depths, rounds)
    cached = jax.config.jax_compilation_cache_dir
    where = f"the persistent cache at {cached} may serve them" if cached else "no cache"
    rows = [
        "| depth (couplings) | rn.invertible | plain autodiff | ratio |",
        "|--:|--:|--:|--:|",
    ]
    for n in depths:
        inv, plain = med["invertible", n], med["plain", n]
        rows.append(f"| {n} | {inv:.2f} s | {plain:.2f} s | {inv / plain:.0f}x |")
    return (
        f"XLA compile seconds of the gradient (median of {rounds} shuffled, interleaved rounds, "
        f"{where}; noise, the depth-{depths[0]} compile against itself: "
        f"{noise:.3f}x). A known cost, not a target: the walk's checks (sketches, propagated "
        "errors, derivative checks, their codes) are a few hundred scalar operations per "
        "equation of the function, and XLA compiles each.\n\n" + "\n".join(rows)
    )


def _matrix(quick: bool) -> tuple[str, list[Target]]:
    """The canonical-stacks matrix's section and its two targets (the issue's acceptance)."""
    section, false, silent = matrix.section(quick)
    targets = [
        Target(
            f"matrix: no false refusals (unchecked error <= {matrix.FALSE}x jax.grad's own)",
            false == 0,
            f"{false} cells",
        ),
        Target(
            f"matrix: no silent errors (accepted, error > {matrix.SILENT}x jax.grad's own)",
            silent == 0,
            f"{silent} cells",
        ),
    ]
    return section, targets


def run(quick: bool = False) -> Result:
    couplings = [20, 40, 80] if quick else [53, 107, 213, 427, 853]  # 6 equations each
    rounds = 3 if quick else 9
    eqns, med, noise = analysis_seconds(couplings, rounds)
    secs = {f: [med[f, n] for n in couplings] for f in ("error", "recompute")}
    rows = [
        "| equations | analysis, fallback=error | analysis, fallback=recompute |",
        "|--:|--:|--:|",
    ]
    for e, t_err, t_rec in zip(eqns, secs["error"], secs["recompute"], strict=True):
        rows.append(f"| {e:,} | {t_err * 1e3:.1f} ms | {t_rec * 1e3:.1f} ms |")

    depth = 8 if quick else 64
    args = make_stack(depth)
    g_inv = jax.jit(jax.grad(_loss(rn.invertible(stack)), argnums=(0, 1, 2)))(*args)
    g_ref = jax.jit(jax.grad(_loss(stack), argnums=(0, 1, 2)))(*args)
    err = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(jax.tree.leaves(g_inv), jax.tree.leaves(g_ref), strict=True)
    )
    temp, sketches = {}, {}
    for n in (2, 8) if quick else (8, 64):
        grad = jax.grad(_loss(rn.invertible(stack)), argnums=(0, 1, 2))
        temp[n] = rn.compiled_memory(grad, *make_stack(n)).temp_size_in_bytes
        schedule = rn.invertible(stack).trace(*make_stack(n)).analysis.schedule(True, False)
        sketches[n] = len(sketched(schedule)) * (_sketch.K + 1) * 4  # the forward's residuals
    lo, hi = sorted(temp)
    sketch_growth = sketches[hi] - sketches[lo]

    body = (
        "Analysis CPU time of an unrolled stack of additive couplings (least of "
        f"{rounds} shuffled, interleaved rounds; noise, the {eqns[-2]:,}-equation analysis "
        f"against itself: {noise:.3f}x):\n\n" + "\n".join(rows) + "\n\n"
        f"Gradient rel err (max-abs scaled) against plain autodiff at depth {depth}: "
        f"{err:.2e}.  \nCompiled temp bytes of the gradient: depth {lo}: {temp[lo]:,} B, "
        f"depth {hi}: {temp[hi]:,} B; the forward pass's sketches of the values the walk "
        f"derives from rebuilt ones (K + 1 four-byte numbers each) grow by {sketch_growth:,} B."
    )
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, v in secs.items():
        ax.loglog(eqns, v, marker="o", label=f"fallback={k}")
    ax.loglog(eqns, [secs["error"][0] * e / eqns[0] for e in eqns], "k:", label="linear")
    ax.set_xticks(eqns, [f"{e:,}" for e in eqns])
    ax.minorticks_off()
    ax.set_xlabel("equations")
    ax.set_ylabel("analysis CPU seconds")
    ax.set_title("rn.invertible analysis time (unrolled coupling stack)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    i = len(eqns) - 2 if not quick else len(eqns) - 1  # 2,562 equations in the full run
    growth = (secs["error"][-1] / secs["error"][-2]) / (eqns[-1] / eqns[-2])
    rel_noise = abs(noise - 1)
    noise_text = f"±{rel_noise:.1%} ({eqns[-2]:,} equations vs itself, least of {rounds})"
    targets = [
        Target(
            f"analysis of {eqns[i]:,} equations <= 0.3 s (CPU)",
            verdict(secs["error"][i], 0.3, rel_noise, at_most=True),
            f"{secs['error'][i]:.3f} s (fallback=recompute {secs['recompute'][i]:.3f} s)",
            noise_text,
        ),
        Target(
            "linear in equations (time ratio / size ratio of the last doubling <= 1.3)",
            verdict(growth, 1.3, rel_noise, at_most=True),
            f"{growth:.2f}",
            noise_text,
        ),
        Target(f"gradient rel err at depth {depth} <= 1e-5", err <= 1e-5, f"{err:.2e}"),
        Target(
            f"temp from depth {lo} to {hi} grows by no more than the sketches (no activation "
            "stored)",
            temp[hi] - temp[lo] <= sketch_growth + 64,
            f"{temp[lo]:,} B -> {temp[hi]:,} B (sketches +{sketch_growth:,} B)",
        ),
    ]
    compile_text = _compile_rows([2, 4] if quick else [8, 16, 32], rounds=1 if quick else 3)
    section, matrix_targets = _matrix(quick)
    return Result(
        "invertible",
        body + "\n\n" + compile_text + "\n\n" + section,
        {"invertible_analysis.png": fig},
        targets + matrix_targets,
    )
