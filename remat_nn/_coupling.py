"""Reversible blocks: the :class:`ReversibleBlock` protocol a reversible stack scans, the
combine laws of a two-residual coupling (additive, affine) and :func:`coupling_block`, the
coupling as a block whose fused backward reconstructs the inputs with the very forward passes of
``F`` and ``G`` whose VJPs it takes (4/3 of a stored-activation gradient in matmul FLOPs, not
5/3); :func:`check_invertible`, a module's measured round trip. The scans that run blocks:
:mod:`remat_nn._reversible`.

References:
  Gomez, Ren, Urtasun, Grosse (2017). The Reversible Residual Network: Backpropagation Without
  Storing Activations. NeurIPS. https://arxiv.org/abs/1707.04585
  Dinh, Sohl-Dickstein, Bengio (2017). Density estimation using Real NVP. ICLR (affine
  couplings). https://arxiv.org/abs/1605.08803
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "ReversibleBlock",
    "additive_combine",
    "additive_uncombine",
    "affine_combine",
    "affine_uncombine",
    "check_invertible",
    "coupling_block",
]

PyTree = Any
Pair = tuple[jax.Array, jax.Array]


class ReversibleBlock(NamedTuple):
    """One invertible layer of a reversible stack, as three pure functions.

    Every function receives one layer's slice of the stacked ``params`` and ``consts`` (leading
    axis removed). ``consts`` are per-layer values that are not differentiated: PRNG keys,
    BatchNorm statistics, ... (``None`` if the stack has none).

    Fields:
      forward: ``(params, consts, x) -> (y, new_consts)``. ``new_consts`` is the layer's
        updated constants (e.g. BatchNorm running averages after this step); it is returned to
        the caller of the forward pass and never recomputed or used by the backward.
      inverse: ``(params, consts, y) -> x`` with ``inverse(p, c, forward(p, c, x)[0]) == x``.
      backward: ``(params, consts, y, dy) -> (x, dparams, dx)``, the inverse fused with the VJP
        of ``forward`` at the reconstructed ``x``; or ``None`` to use ``inverse`` followed by
        ``jax.vjp(forward)`` (one more forward pass of the block per layer).
    """

    forward: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
    inverse: Callable[[PyTree, PyTree, PyTree], PyTree]
    backward: Callable[[PyTree, PyTree, PyTree, PyTree], tuple[PyTree, PyTree, PyTree]] | None = (
        None
    )


# --- couplings ------------------------------------------------------------------------------------


def _check_branch(x: jax.Array, h: jax.Array, want: tuple[int, ...], law: str) -> None:
    # A branch that changes the shape would broadcast into a block that is no longer invertible
    # (or fail deep in XLA); say which shapes and how to fix it.
    if tuple(h.shape) != want:
        raise ValueError(
            f"{law} coupling: a residual branch returned shape {tuple(h.shape)} for a half of "
            f"shape {tuple(x.shape)}; it must return {want} (F(x2) the shape of x1, G(y1) the "
            f"shape of x2, so that the block is invertible). Fix: make the branch's output "
            f"width {want[-1] if want else 'match'}, e.g. nn.Dense({want[-1] if want else 'C'})"
            " as its last layer, and keep its other axes (no pooling or striding)."
        )


def additive_combine(x: jax.Array, h: jax.Array) -> jax.Array:
    """``x + h``: the additive coupling law of RevNet (Gomez et al. 2017); ``h`` has ``x``'s
    shape (a ValueError says so otherwise)."""
    _check_branch(x, h, tuple(x.shape), "additive")
    return x + h.astype(x.dtype)


def additive_uncombine(y: jax.Array, h: jax.Array) -> jax.Array:
    """``y - h``: inverse of :func:`additive_combine` in its first argument."""
    _check_branch(y, h, tuple(y.shape), "additive")
    return y - h.astype(y.dtype)


def _scale_shift(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    dtype = x.dtype
    if h.ndim and h.shape[-1] % 2 == 0:
        _check_branch(x, h, (*x.shape[:-1], 2 * x.shape[-1]), "affine")
    if h.shape[-1] % 2:
        raise ValueError(
            f"affine coupling: the residual function must return 2 * C features on the last axis "
            f"(log-scale and shift), got shape {h.shape}. Fix: make F and G output twice the "
            "width of one half, e.g. nn.Dense(2 * C)."
        )
    s, t = jnp.split(h.astype(dtype), 2, axis=-1)
    # tanh bounds the log-scale to [-1, 1]: every block scales by a factor in [1/e, e], so the
    # inverse is as well conditioned as the forward (a softplus scale can approach 0).
    return jnp.tanh(s), t


def affine_combine(x: jax.Array, h: jax.Array) -> jax.Array:
    """``x * exp(tanh(s)) + t`` with ``(s, t) = split(h, 2, axis=-1)``: the affine coupling law.

    The scale ``exp(tanh(s))`` is positive and bounded in ``[1/e, e]``.
    """
    log_scale, t = _scale_shift(h, x)
    return x * jnp.exp(log_scale) + t


def affine_uncombine(y: jax.Array, h: jax.Array) -> jax.Array:
    """``(y - t) * exp(-tanh(s))``: inverse of :func:`affine_combine` in its first argument."""
    log_scale, t = _scale_shift(h, y)
    return (y - t) * jnp.exp(-log_scale)


def _tree_add(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(jnp.add, a, b)


def coupling_block(
    f: Callable[[PyTree, PyTree, jax.Array], tuple[jax.Array, PyTree]],
    g: Callable[[PyTree, PyTree, jax.Array], tuple[jax.Array, PyTree]],
    *,
    combine: Callable[[jax.Array, jax.Array], jax.Array] = additive_combine,
    uncombine: Callable[[jax.Array, jax.Array], jax.Array] = additive_uncombine,
    compute_dtype: Any = None,
) -> ReversibleBlock:
    """Builds the :class:`ReversibleBlock` of a two-residual coupling with a fused backward.

    Forward ``y1 = combine(x1, F(x2)); y2 = combine(x2, G(y1))``; inverse
    ``x2 = uncombine(y2, G(y1)); x1 = uncombine(y1, F(x2))``. The backward evaluates G at ``y1``
    and F at the reconstructed ``x2`` once each, under ``jax.vjp``: those evaluations both
    reconstruct the input and linearize the block (Gomez et al. 2017, Algorithm 1).

    Args:
      f: ``(params, consts, x2) -> (F(x2), new_consts)``; ``params`` / ``consts`` are one
        layer's (the same ones ``g`` receives). In the forward pass ``g`` receives the
        ``new_consts`` of ``f``; the backward calls both with the layer's original ``consts``
        and discards the new ones, so state updates happen once, in the forward pass.
      g: ``(params, consts, y1) -> (G(y1), new_consts)``.
      combine: ``(x, h) -> y``, invertible in ``x`` for fixed ``h``, e.g.
        :func:`additive_combine` or :func:`affine_combine`.
      uncombine: its inverse, ``(y, h) -> x``.
      compute_dtype: if given, F and G receive their inputs cast to this dtype (the residual
        stream may be wider, see ``recon_dtype`` of :func:`reversible_scan`).

    Returns:
      A :class:`ReversibleBlock` over pairs ``(x1, x2)``.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> f = lambda p, c, x: (jnp.tanh(x @ p["wf"]), c)
    >>> g = lambda p, c, x: (jnp.tanh(x @ p["wg"]), c)
    >>> block = rn.coupling_block(f, g)
    >>> p = {"wf": jnp.eye(2), "wg": -jnp.eye(2)}
    >>> x = (jnp.ones((1, 2)), jnp.zeros((1, 2)))
    >>> y, _ = block.forward(p, None, x)
    >>> rn.relative_error(block.inverse(p, None, y), x) < 1e-6  # max|a - b| / max|b|
    True

    References:
      Gomez et al. (2017), The Reversible Residual Network, Algorithm 1.
    """

    def call(fn: Callable, params: PyTree, consts: PyTree, x: jax.Array) -> tuple[Any, Any]:
        h, new_consts = fn(params, consts, x if compute_dtype is None else x.astype(compute_dtype))
        return h.astype(x.dtype), new_consts

    def forward(params: PyTree, consts: PyTree, x: Pair) -> tuple[Pair, PyTree]:
        x1, x2 = x
        hf, consts = call(f, params, consts, x2)
        y1 = combine(x1, hf)
        hg, consts = call(g, params, consts, y1)
        return (y1, combine(x2, hg)), consts

    def inverse(params: PyTree, consts: PyTree, y: Pair) -> Pair:
        y1, y2 = y
        x2 = uncombine(y2, call(g, params, consts, y1)[0])
        x1 = uncombine(y1, call(f, params, consts, x2)[0])
        return x1, x2

    def backward(params: PyTree, consts: PyTree, y: Pair, dy: Pair) -> tuple[Pair, Any, Pair]:
        (y1, y2), (dy1, dy2) = y, dy
        hg, g_vjp = jax.vjp(lambda p, a: call(g, p, consts, a)[0], params, y1)
        x2 = uncombine(y2, hg)
        dx2, dhg = jax.vjp(combine, x2, hg)[1](dy2)
        dparams_g, dy1_from_g = g_vjp(dhg)
        dy1 = dy1 + dy1_from_g  # total cotangent of y1 (it feeds y1 out and G)
        hf, f_vjp = jax.vjp(lambda p, a: call(f, p, consts, a)[0], params, x2)
        x1 = uncombine(y1, hf)
        dx1, dhf = jax.vjp(combine, x1, hf)[1](dy1)
        dparams_f, dx2_from_f = f_vjp(dhf)
        return (x1, x2), _tree_add(dparams_f, dparams_g), (dx1, dx2 + dx2_from_f)

    return ReversibleBlock(forward, inverse, backward)


# --- round trip ---------------------------------------------------------------------------------


def check_invertible(
    module: Any,
    variables: PyTree,
    x: PyTree,
    *,
    rngs: Any = None,
    **kwargs: Any,
) -> jax.Array:
    """Measures the reconstruction error ``max |inverse(forward(x)) - x|`` of a module.

    Works with any flax module that has ``forward`` and ``inverse`` methods (the couplings and
    :class:`remat_nn.nn.ReversibleSequence`). Non-parameter collections (BatchNorm statistics)
    are treated as mutable and their updates discarded, so a training-mode module is measured
    without changing its state.

    Args:
      module: a flax module with ``forward`` and ``inverse`` methods.
      variables: its variables, e.g. from ``module.init``.
      x: an input the module accepts.
      rngs: PRNG keys for ``apply`` (e.g. ``{"dropout": key}``); the same keys are given to the
        forward and the inverse, so dropout masks match.
      **kwargs: static keyword arguments for both methods (e.g. ``train=True``).

    Returns:
      A float32 scalar: the largest absolute reconstruction error over all leaves of ``x``.

    >>> import jax, jax.numpy as jnp, flax.linen as fnn, remat_nn as rn
    >>> from remat_nn import nn
    >>> layer = nn.AdditiveCoupling(fnn.Dense(2), fnn.Dense(2))
    >>> x = jnp.ones((3, 4))
    >>> variables = layer.init(jax.random.key(0), x)
    >>> bool(rn.check_invertible(layer, variables, x) < 1e-5)
    True
    """
    for method in ("forward", "inverse"):
        if not callable(getattr(module, method, None)):
            raise TypeError(
                f"check_invertible: `module` must have a `{method}` method, got "
                f"{type(module).__name__}. Fix: pass a remat_nn.nn coupling or ReversibleSequence."
            )
    mutable = [c for c in variables if c != "params"]

    def run(variables: PyTree, method: str, value: PyTree, rngs: Any) -> PyTree:
        out = module.apply(
            variables, value, method=method, rngs=rngs, mutable=mutable or False, **kwargs
        )
        return out[0] if mutable else out

    @jax.jit  # one compiled program instead of op-by-op dispatch of two scans
    def error(variables: PyTree, x: PyTree, rngs: Any) -> jax.Array:
        x_rec = run(variables, "inverse", run(variables, "forward", x, rngs), rngs)
        errors = jax.tree.map(
            lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))), x_rec, x
        )
        return jnp.max(jnp.stack(jax.tree.leaves(errors)))

    return error(variables, x, rngs)
