"""A small scanned MLP stack used by ``python -m remat_nn`` and the memory tests.

Sixteen residual MLP layers applied with ``lax.scan`` (remat inside a scan is what XLA:CPU keeps;
in an unrolled Python loop it undoes remat). Each layer tags ``mlp_hidden`` and ``mlp_out``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from remat_nn import names
from remat_nn._checkpoint import checkpoint
from remat_nn.names import name


def init(key: jax.Array, *, depth: int = 16, width: int = 256, hidden: int = 1024) -> dict:
    """Stacked parameters: ``w_in`` (depth, width, hidden), ``w_out`` (depth, hidden, width)."""
    k1, k2 = jax.random.split(key)
    return {
        "w_in": jax.random.normal(k1, (depth, width, hidden)) / jnp.sqrt(width),
        "w_out": jax.random.normal(k2, (depth, hidden, width)) / jnp.sqrt(hidden),
    }


def loss(params: dict, x: jax.Array, *, policy: Any = "none") -> jax.Array:
    """Mean square of the stack's output; ``policy=None`` or ``"none"`` means no remat."""

    def layer(h, p):
        u = name(jax.nn.gelu(h @ p["w_in"]), names.MLP_HIDDEN)  # (B, hidden)
        return h + name(u @ p["w_out"], names.MLP_OUT), None  # (B, width)

    if policy not in (None, "none"):
        layer = checkpoint(layer, policy=policy, prevent_cse=False)
    out, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(out**2)
