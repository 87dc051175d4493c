"""Depth scaling: grad-step temp memory and step time against depth, for five ways to get
gradients of the same residual stack.

The stack is a scan over ``depth`` additive couplings (y1 = x1 + F(x2), y2 = x2 + G(y1), F and G
two-layer MLPs), so every variant computes the same function with the same parameters:
  - plain: ``lax.scan`` with stored activations (plain autodiff);
  - remat nothing_saveable / dots_saveable: the scan body under ``rn.checkpoint``;
  - reversible: ``rn.reversible_scan`` (what ``nn.ReversibleSequence`` runs);
  - invertible: ``rn.invertible`` over the plain scan (reconstruction at the jaxpr level).
Memory: XLA's compiled temp bytes of ``jax.jit(jax.grad(loss))``. Time: at each depth, the five
steps and ``plain`` a second time (the noise) in shuffled rounds; a ratio is the median over
rounds of two times from the same round.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import remat_nn as rn  # noqa: E402
from benchmarks._common import Result, Target, paired, rounds_text, verdict  # noqa: E402
from remat_nn import format_bytes  # noqa: E402


def _mlp(p, c, x):
    return jnp.tanh(x @ p["w1"]) @ p["w2"], c


BLOCK = rn.coupling_block(lambda p, c, x: _mlp(p["f"], c, x), lambda p, c, x: _mlp(p["g"], c, x))


def init(depth: int, half: int, hidden: int, key: jax.Array) -> dict:
    ks = jax.random.split(key, 4)
    scale1, scale2 = 1 / half**0.5, 0.5 / hidden**0.5 / depth**0.5

    def mlp(k1, k2):
        return {
            "w1": jax.random.normal(k1, (depth, half, hidden)) * scale1,
            "w2": jax.random.normal(k2, (depth, hidden, half)) * scale2,
        }

    return {"f": mlp(ks[0], ks[1]), "g": mlp(ks[2], ks[3])}


def _remat_scan(policy, params, x):
    step = rn.checkpoint(
        lambda h, p: (BLOCK.forward(p, None, h)[0], None), policy=policy, prevent_cse=False
    )
    return jax.lax.scan(step, x, params)[0]


VARIANTS = {
    "plain": lambda p, x: rn.plain_scan(BLOCK, p, x)[0],
    "remat nothing_saveable": functools.partial(_remat_scan, "nothing_saveable"),
    "remat dots_saveable": functools.partial(_remat_scan, "dots_saveable"),
    "reversible": lambda p, x: rn.reversible_scan(BLOCK, p, x)[0],
    "invertible": rn.invertible(lambda p, x: rn.plain_scan(BLOCK, p, x)[0]),
}


def _loss(forward, params, x):
    y1, y2 = forward(params, x)
    return jnp.mean(y1**2) + jnp.mean(y2**2)


def run(quick: bool = False) -> Result:
    depths = [8, 16, 32] if quick else [8, 16, 32, 64, 128, 256, 512]
    batch, half, hidden = (8, 16, 32) if quick else (64, 128, 512)
    x = tuple(jax.random.normal(k, (batch, half)) for k in jax.random.split(jax.random.key(1)))
    temp: dict[str, list[int]] = {v: [] for v in VARIANTS}
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    noise: list[float] = []
    for depth in depths:
        params = init(depth, half, hidden, jax.random.key(0))
        steps = {}
        for name, fwd in VARIANTS.items():
            grad = jax.grad(functools.partial(_loss, fwd))
            temp[name].append(rn.compiled_memory(grad, params, x).temp_size_in_bytes)
            steps[name] = functools.partial(jax.jit(grad), params, x)
        timed = paired(
            steps, itself="plain", rounds=1 if quick else 9, min_seconds=0.01 if quick else 0.1
        )
        for name in VARIANTS:
            ratios[name].append(timed.ratio(name, "plain"))
        noise.append(timed.noise)
        rounds = timed.rounds
        print(
            f"depth {depth}: " + ", ".join(f"{n} {format_bytes(t[-1])}" for n, t in temp.items()),
            flush=True,
        )

    head = "| depth | " + " | ".join(VARIANTS) + " |"
    rows = [head, "|--:|" + "--:|" * len(VARIANTS)]
    for i, d in enumerate(depths):
        rows.append(f"| {d} | " + " | ".join(format_bytes(temp[v][i]) for v in VARIANTS) + " |")
    rows += [
        "",
        f"Step time relative to plain, same depth: {rounds} shuffled rounds per depth, each "
        "running the five steps and plain a second time; a ratio is the median over rounds of "
        "the two times in the same round; noise is plain against itself.",
        "",
        head[:-1] + "| noise (plain vs itself) |",
        "|--:|" + "--:|" * (len(VARIANTS) + 1),
    ]
    for i, d in enumerate(depths):
        cells = [f"{ratios[v][i]:.3f}x" for v in VARIANTS] + [f"±{noise[i]:.1%}"]
        rows.append(f"| {d} | " + " | ".join(cells) + " |")
    setup = f"batch {batch}, coupling halves {half}, MLP hidden {hidden}, float32"
    body = f"Compiled temp bytes of `jax.jit(jax.grad(loss))` ({setup}).\n\n" + "\n".join(rows)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for v in VARIANTS:
        ax.loglog(depths, temp[v], marker="o", label=v)
    ax.set_xlabel("depth (couplings)")
    ax.set_ylabel("XLA temp bytes of the gradient")
    ax.set_title(f"Activation memory vs depth ({setup})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    lo, hi = depths[0], depths[-1]
    rev_ratio = temp["reversible"][-1] / temp["reversible"][0]
    plain_ratio = temp["plain"][-1] / temp["plain"][0]
    t_ratio = ratios["reversible"][-1]
    t_noise = f"±{noise[-1]:.1%} (plain vs itself, {rounds_text(rounds)})"
    targets = [
        Target(
            f"reversible temp at depth {hi} within 10% of depth {lo}",
            rev_ratio <= 1.10,
            f"{rev_ratio:.3f}x ({format_bytes(temp['reversible'][0])} -> "
            f"{format_bytes(temp['reversible'][-1])})",
        ),
        Target(
            f"plain grows linearly (depth {hi}/{lo} = {hi // lo}x)",
            plain_ratio >= 0.5 * hi / lo,
            f"{plain_ratio:.1f}x",
        ),
        Target(
            "reversible step time at most 1.4x plain",
            verdict(t_ratio, 1.4, noise[-1], at_most=True),
            f"{t_ratio:.3f}x at depth {hi}",
            t_noise,
        ),
    ]
    return Result("depth", body, {"depth_memory.png": fig}, targets)
