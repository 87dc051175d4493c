"""Ordering a backward pass's recomputation after the values it must follow.

XLA:CPU expands (drops) optimization barriers before scheduling, so ``prevent_cse``'s barrier
does not hold there; its scheduler then runs a recomputation (a rematerialized unit, a
reversible block's reconstruction) as soon as its inputs exist, which in unrolled code is at
the start of the backward pass: every recomputed activation is live at once and remat or
reconstruction saves nothing. Making the recomputation's input depend, through an exact zero,
on a value of the step before orders it where it belongs on every backend.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def zero_after(tree: Any, dtype: Any = jnp.float32) -> jax.Array:
    """An exact 0 of ``dtype`` computed from one element of each leaf of ``tree`` (a constant 0
    if ``tree`` has no leaves).

    ``isfinite(c) * 0`` is 0 for any ``c`` (inf and nan included), and XLA does not fold a float
    multiply by 0, so whatever uses the zero cannot start before every leaf of ``tree`` exists.
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), dtype)
    finite = jnp.stack([jnp.isfinite(leaf.ravel()[0]) for leaf in leaves])
    return jnp.all(finite).astype(dtype) * jnp.zeros((), dtype)  # ()


def tie(tree: Any, zero: jax.Array) -> Any:
    """``tree`` with ``zero`` (from :func:`zero_after`) added to its float leaves."""

    def add(leaf: Any) -> Any:
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return leaf + zero.astype(leaf.dtype)
        return leaf

    return jax.tree.map(add, tree)


def tie_to_cotangent(tree: Any, cotangent: Any) -> Any:
    """``tree`` tied to every leaf of ``cotangent``: see :func:`zero_after`."""
    return tie(tree, zero_after(cotangent))
