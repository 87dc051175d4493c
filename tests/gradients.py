"""The one gradient comparison of the suite: error relative to the reference's largest value.

XLA's code differs between CPU models, so gradients differ in the last bits from machine to
machine; an elementwise rtol on raw values fails where a value is near 0. Compare
``max|got - want| / max|want|`` per leaf on well-conditioned inputs instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rel_err(got, want) -> float:
    """Max over leaves of ``max|got - want| / max|want|`` (want all zero: ``max|got|``)."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), f"{len(got)} leaves vs {len(want)}"
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        g, w = jnp.asarray(g, jnp.float32), jnp.asarray(w, jnp.float32)
        assert g.shape == w.shape, f"shape {g.shape} vs {w.shape}"
        scale = float(jnp.max(jnp.abs(w))) if w.size else 0.0
        diff = float(jnp.max(jnp.abs(g - w))) if w.size else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst
