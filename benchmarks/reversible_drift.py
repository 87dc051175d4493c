"""``python -m benchmarks.reversible_drift``: a reversible stack whose activations grow, checked
by the backward's measured drift (issue #44; the table of docs/invertible.md).

The stack is the docs' own: ``rnn.ReversibleSequence(rnn.AdditiveCoupling(Dense(16),
Dense(16)), depth=d)`` (unnormalized linear branches: the forward grows layer after layer), on
``x ~ N(0, 1)`` of shape (64, 32), loss ``mean(y)``. For each depth, the gradient's error
``max|a - b| / max|b|`` against the float64 gradient of the same network run with
``reversible=False``, for: plain autodiff in float32 (its own error), reconstruction alone
(``fallback="none"``), the default (``"error"``: accepted or refused), and ``"recompute"`` at
the default tolerance and at ``drift_rtol=2.4e-5`` (with how many layers were recomputed).
"""

from __future__ import annotations

import logging
import sys

import flax.linen as fnn
import jax
import jax.numpy as jnp

import remat_nn as rn
from remat_nn import nn

DEPTHS = (8, 16, 24, 32)
TIGHT = 2.4e-5


def _model(depth: int, **kw) -> nn.ReversibleSequence:
    return nn.ReversibleSequence(nn.AdditiveCoupling(fnn.Dense(16), fnn.Dense(16)), depth, **kw)


def _grad(model: nn.ReversibleSequence):
    def loss(p, x):
        y: jax.Array = model.apply({"params": p}, x)  # type: ignore[assignment]
        return jnp.mean(y)

    return jax.jit(jax.grad(loss))


def row(depth: int) -> dict:
    x = jax.random.normal(jax.random.key(1), (64, 32))
    params = _model(depth).init(jax.random.key(0), x)["params"]
    with jax.enable_x64(True):
        f64 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float64), t)  # noqa: E731
        exact = _grad(_model(depth, reversible=False))(f64(params), f64(x))
    err = lambda g: rn.relative_error(g, exact)  # noqa: E731
    out = {"depth": depth, "own": err(_grad(_model(depth, reversible=False))(params, x))}
    out["none"] = err(_grad(_model(depth, fallback="none"))(params, x))
    try:
        out["error"] = err(jax.block_until_ready(_grad(_model(depth))(params, x)))
    except jax.errors.JaxRuntimeError as e:
        if "NotInvertibleError" not in str(e):
            raise
        out["error"] = None
    for key, rtol in (("recompute", None), ("tight", TIGHT)):
        rn.drift_recomputes(reset=True)
        g = jax.block_until_ready(
            _grad(_model(depth, fallback="recompute", drift_rtol=rtol))(params, x)
        )
        out[key], out[key + "_layers"] = err(g), len(rn.drift_recomputes(reset=True))
    return out


def table(rows: list[dict]) -> str:
    x = lambda e, own: f"{e:.1e} ({e / own:.3g}x)"  # noqa: E731
    lines = [
        '| depth | plain autodiff | reconstruction alone | default (`"error"`) '
        f'| `"recompute"` (default tolerance) | `"recompute"`, `drift_rtol={TIGHT}` |',
        "|--:|--:|--:|--|--:|--:|",
    ]
    for r in rows:
        own = r["own"]
        verdict = "refused" if r["error"] is None else f"accepted, {x(r['error'], own)}"
        lines.append(
            f"| {r['depth']} | {own:.1e} | {x(r['none'], own)} | {verdict} "
            f"| {x(r['recompute'], own)}, {r['recompute_layers']} layers "
            f"| {x(r['tight'], own)}, {r['tight_layers']} layers |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    logging.getLogger("jax._src.debugging").setLevel(logging.CRITICAL)
    logging.getLogger("remat_nn").setLevel(logging.ERROR)
    print(f"Command: `python -m benchmarks.reversible_drift` (jax {jax.__version__}, CPU)\n")
    print(table([row(d) for d in (map(int, sys.argv[1:]) if sys.argv[1:] else DEPTHS)]))
