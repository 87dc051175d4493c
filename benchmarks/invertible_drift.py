"""``python -m benchmarks.invertible_drift``: which coupling stacks ``rn.invertible`` accepts, and
how exact their gradients are (issue #44).

The stack is the canonical one (``x1 += tanh(x2 @ wf); x2 += tanh(x1 @ wg)`` per layer, weights
``scale * N(0, 1)`` of shape (16, 16), inputs N(0, 1) of shape (4, 16), loss the sum of squares
of both outputs). For each depth and scale: whether the default ``rn.invertible`` (rtol 1e-5)
accepts it, and the gradient errors ``max|a - b| / max|b|`` of the walk (its failed checks not
raised, so it is measured where it is refused too) and of ``jax.grad`` against a float64
reference (NumPy backprop). Goal: no refusal where the walk's error is at most 10x jax.grad's,
no acceptance where it is above 100x.
"""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import remat_nn as rn
from remat_nn.invertible import _vjp

D, B = 16, 4
CASES = [(0.3, d) for d in (4, 6, 8, 16)] + [(0.1, d) for d in (2, 4, 6, 8, 12, 16)]


def stack(ws, x1, x2):
    for wf, wg in ws:
        x1 = x1 + jnp.tanh(x2 @ wf)
        x2 = x2 + jnp.tanh(x1 @ wg)
    return x1, x2


def loss(f):
    return lambda ws, x1, x2: sum(jnp.sum(y * y) for y in f(ws, x1, x2))


def problem(scale: float, depth: int, seed: int = 0, width: int = D, batch: int = B):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * depth + 2)
    ws = [
        (
            scale * jax.random.normal(keys[2 * i], (width, width)),
            scale * jax.random.normal(keys[2 * i + 1], (width, width)),
        )
        for i in range(depth)
    ]
    return ws, *(jax.random.normal(k, (batch, width)) for k in keys[-2:])


def reference(ws, x1, x2):
    """The gradient in float64 (NumPy): forward storing every layer, then backprop."""
    x1, x2 = np.asarray(x1, np.float64), np.asarray(x2, np.float64)
    ws = [(np.asarray(a, np.float64), np.asarray(b, np.float64)) for a, b in ws]
    tape = []
    for wf, wg in ws:
        t1 = np.tanh(x2 @ wf)
        x1n = x1 + t1
        t2 = np.tanh(x1n @ wg)
        tape.append((x2, t1, x1n, t2))
        x1, x2 = x1n, x2 + t2
    g1, g2 = 2 * x1, 2 * x2
    grads = []
    for (wf, wg), (x2in, t1, x1n, t2) in zip(ws[::-1], tape[::-1], strict=True):
        s2 = g2 * (1 - t2 * t2)  # x2 += tanh(x1n @ wg)
        dwg = x1n.T @ s2
        g1 = g1 + s2 @ wg.T
        s1 = g1 * (1 - t1 * t1)  # x1 += tanh(x2 @ wf)
        dwf = x2in.T @ s1
        g2 = g2 + s1 @ wf.T
        grads.append((dwf, dwg))
    return grads[::-1], g1, g2


def unchecked_walk(args):
    """The walk's gradient with its failed checks not raised (the values are the same)."""
    f = rn.invertible(stack, known_argnums=0)
    with mock.patch.object(_vjp, "stop_on_failed_check", lambda *_: None):
        return jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(*args)


def row(scale: float, depth: int, seed: int = 0) -> dict:
    args = problem(scale, depth, seed)
    want = reference(*args)
    grad = jax.jit(jax.grad(loss(stack), argnums=(0, 1, 2)))
    plain = grad(*args)
    walk = unchecked_walk(args)
    strict = rn.invertible(stack, known_argnums=0)
    try:
        jax.block_until_ready(jax.jit(jax.grad(loss(strict), argnums=(0, 1, 2)))(*args))
        verdict = "accepted"
    except Exception as e:  # a NotInvertibleError, under jit wrapped in a JaxRuntimeError
        if "rn.invertible" not in str(e):
            raise
        verdict = "refused"
    walk_f64 = rn.relative_error(walk, want)
    grad_f64 = rn.relative_error(plain, want)
    return {
        "scale": scale,
        "depth": depth,
        "verdict": verdict,
        "walk_vs_grad": rn.relative_error(walk, plain),
        "walk_vs_f64": walk_f64,
        "grad_vs_f64": grad_f64,
        "ratio": walk_f64 / grad_f64,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| scale | depth | rtol 1e-5 | walk vs jax.grad | walk vs f64 | jax.grad vs f64 | ratio "
        "| goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bad = (r["verdict"] == "refused" and r["ratio"] <= 10) or (
            r["verdict"] == "accepted" and r["ratio"] > 100
        )
        lines.append(
            f"| {r['scale']} | {r['depth']} | {r['verdict']} | {r['walk_vs_grad']:.2e} | "
            f"{r['walk_vs_f64']:.2e} | {r['grad_vs_f64']:.2e} | {r['ratio']:.2f} | "
            f"{'missed' if bad else 'met'} |"
        )
    return "\n".join(lines)


def memory(depth: int = 16, scale: float = 0.3) -> dict:
    """Compiled memory of the rn.invertible gradient of the depth-``depth`` stack (bytes)."""
    args = problem(scale, depth)
    f = jax.grad(loss(rn.invertible(stack, known_argnums=0)), argnums=(0, 1, 2))
    m = jax.jit(f).lower(*args).compile().memory_analysis()
    return {
        "temp": m.temp_size_in_bytes,
        "output": m.output_size_in_bytes,
        "argument": m.argument_size_in_bytes,
    }


if __name__ == "__main__":
    print(table([row(s, d) for s, d in CASES]))
    print("memory of the depth-16 gradient:", memory())
