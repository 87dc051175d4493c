"""The drift check of a reversible stack's backward (:func:`remat_nn.reversible_scan`).

Every rebuilt layer input is measured against the forward's sketch of it
(:mod:`remat_nn._drift`). A layer past the tolerance is flagged (the stack is then refused,
or run again recomputing such layers) or recomputed on the spot.

The default tolerance follows the stack's conditioning. In a chaotic stack (activations
that grow, nearly singular blocks) the forward pass itself amplifies rounding: plain
autodiff's gradient is then as far from exact arithmetic's as the rebuilt one, and refusing
the rebuilt one would be stricter than autodiff. A forward map ``x -> y`` turns a relative
error ``eps`` of its input into about ``eps * kappa`` of its output, ``kappa = |J| |x| / |y|``
its relative condition number (``J`` its Jacobian). The backward has an estimate for free:
``|J^T dy| / |dy|``, the growth of the cotangent it just propagated (``dx = J^T dy``), is
a typical singular value of ``J`` for the loss's generic ``dy``. So :func:`loosened` raises
``drift_rtol``'s default (2048 epsilons) to ``CONDITION_MULTIPLE * eps * kappa``, ``eps``
the machine epsilon of what the blocks compute in, ``|x|`` from the forward's sketch of the
input, when that is larger: a few norms per stack, nothing stored or recomputed.

Set on the canonical-stacks matrix (``benchmarks/results/invertible.md``), from per-layer
drifts and the cotangents of the unchecked reconstruction measured outside the check: among
its 288 scan cells the reversible stacks' false refusals (refused, unchecked gradient within
10x plain autodiff's own error against float64) fell from 43 to 17 at 30 (11 at 100, 22 at
10), with no accepted cell further than 53x autodiff's error (the same worst as the fixed
default; the first accepted cell past 100x, 119x, appeared at 300). Run with the check as
built (``python -m benchmarks.reversible_matrix``): 16 false refusals, none accepted past
100x. What it leaves refused:
affine couplings whose inverse amplifies rounding far more than their forward (the drift is
100-10,000 times ``eps * kappa``), where the unchecked gradient is mostly hundreds of times
autodiff's error. A cotangent that grows along the drifted trajectory itself (a garbage
rebuild) raises the estimate too: no matrix cell was accepted that way, but the estimate is
of the stack's conditioning, not a bound. Blocks that compute in bfloat16 (``eps`` 2^-7) get at
least 0.23 for a condition number of 1, above the fixed default's 0.1: on the matrix that
turned 14 of its 19 bfloat16 false refusals into accepted cells, none past 100x autodiff's
error.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from remat_nn import _drift
from remat_nn._coupling import ReversibleBlock
from remat_nn._drift import norm

PyTree = Any


class Check(NamedTuple):
    """The drift check of one backward scan over layers: the forward's sketch of every layer's
    input, and for ``fallback="recompute"`` the kept value the layers start from."""

    fallback: str
    rtol: float
    sketches: jax.Array  # (layers, k + 2)
    start: PyTree  # the first layer's input, kept (None unless fallback="recompute")
    offset: jax.Array | int  # the first layer's index in the whole stack
    report: bool  # recomputes are counted in the backward's result, not by a host callback
    after: Any = None  # values the first layer's reconstruction waits for (or None)


def block_vjp(block: ReversibleBlock, p, c, y, dy):
    """``(x, dp, dx)``: the block's input rebuilt from ``y`` and its VJP there."""
    if block.backward is not None:
        return block.backward(p, c, y, dy)
    x = block.inverse(p, c, y)
    return (x, *vjp_at(block, p, c, x, dy))


def vjp_at(block: ReversibleBlock, p, c, x, dy):
    _, vjp = jax.vjp(lambda p_, x_: block.forward(p_, c, x_)[0], p, x)
    return vjp(dy)


def recompute(block: ReversibleBlock, params, consts, start, i):
    """The input of layer ``i`` computed forward from ``start``, the input of layer 0 (as many
    block forwards as ``params`` has layers: the segment of ``anchor_every``, or the stack)."""

    def layer(j, h):
        p, c = jax.tree.map(lambda a: a[j], (params, consts))
        return block.forward(p, c, h)[0]

    depth = jax.tree.leaves((params, consts))[0].shape[0]  # checked by reversible_scan
    return _drift.replay(layer, start, depth, i)


def loosened(rtol: float, eps: float, x_sketch, y_norm, dy_norm, dx) -> jax.Array:
    """The default tolerance of a stack: ``rtol``, raised to ``_drift.allowance``:
    ``CONDITION_MULTIPLE`` times ``eps`` times the stack's relative condition number as its
    backward measured it (float32 scalar; module docstring).

    ``kappa = (|dx| / |dy|) (|x| / |y|)``: ``dy`` the output's cotangent, ``dx`` the input's
    that the backward computed, ``|x|`` the true input's norm (from its sketch ``x_sketch``:
    scale times the norm of the scaled value), ``y`` the output (their norms given:
    :func:`norm`). Not finite (a zero cotangent, an overflow): ``rtol``."""
    x_norm = x_sketch[0] * x_sketch[1]
    return jnp.maximum(jnp.float32(rtol), _drift.allowance(eps, x_norm, y_norm, dy_norm, norm(dx)))


DRIFTED = """\
reversible stack: the input of layer {layer}, rebuilt from its output by the block's inverse, \
is off by {drift:.3g} of its norm (tolerance {rtol:g}: drift_rtol, by default 2048 epsilons or, \
if more, 30 epsilons times the stack's relative condition number; measured from random \
projections kept in the forward pass), so its gradient would be wrong. \
The stack amplifies \
rounding error when inverted: its activations grow or its blocks are nearly singular. Fix: \
anchor_every=k (keep every k-th layer's input), normalized branches (LayerNorm), a wider \
recon_dtype; fallback="recompute" (recompute a drifted layer's input from the nearest kept \
value: the compiled backward then holds more temporary memory); or reversible=False."""


def _recomputed(layer) -> None:
    _drift.recomputed(f"reversible layer {int(layer)}")


def checked(block, params, consts, check: Check, p, c, dy, i, ref, rebuilt):
    """``(rebuilt, drifted, drift)``: ``rebuilt`` (``(x, dp, dx)`` of layer ``i``) if its ``x``
    passes the drift check against the forward's sketch ``ref``; else, by ``check.fallback``,
    recomputed from the kept start (``"recompute"``) or returned as it is, flagged
    (``"flag"``: the caller refuses or reruns once for the whole stack)."""
    drift = _drift.drift(rebuilt[0], ref)
    bad = ~(drift <= check.rtol)  # nan (a non-finite rebuilt value) fails
    if check.fallback != "recompute":
        return rebuilt, bad, drift

    def again(params, consts, start, i, layer, p, c, dy):
        if not check.report:
            jax.debug.callback(_recomputed, layer)
        x = recompute(block, params, consts, start, i)
        return (x, *vjp_at(block, p, c, x, dy))

    # p and c: the layer's own, tied as the main path's (under shard_map, of the same types).
    args = (params, consts, check.start, i, check.offset + i, p, c, dy)
    return _drift.when(bad, again, args, rebuilt), bad, drift


def none_drifted() -> tuple[jax.Array, jax.Array, jax.Array]:
    """No layer drifted: ``(layer, its drift, count)`` of the worst that did and of how many
    did, as the backward carries it (layer -1, count 0)."""
    return jnp.int32(-1), jnp.float32(0.0), jnp.int32(0)


def worst(seen, bad, layer, drift, count=1):
    """The worst drifted layer, its drift and the count: ``seen``, updated with ``(layer,
    drift)`` if ``bad`` and it drifted more (or is the first; a nan drift is the worst), and
    ``count`` more drifted layers if ``bad``."""
    layer, drift = jnp.asarray(layer, jnp.int32), jnp.asarray(drift, jnp.float32)
    take = bad & ((seen[0] < 0) | (~jnp.isnan(seen[1]) & ~(drift <= seen[1])))
    total = seen[2] + jnp.where(bad, jnp.asarray(count, jnp.int32), 0)
    return jnp.where(take, layer, seen[0]), jnp.where(take, drift, seen[1]), total
