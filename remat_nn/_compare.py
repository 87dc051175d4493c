"""One way to compare gradients: the error relative to the reference's largest value."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def relative_error(got: Any, want: Any, *, floor: float = 0.0) -> float:
    """Max over leaves of ``max|got - want| / max|want|`` (a leaf of zeros: ``max|got|``).

    Gradients computed two ways (reconstructed vs stored, remat vs not, another CPU) differ in
    the last bits, and an elementwise ``rtol`` fails wherever a value happens to be near 0. This
    error scales each leaf's difference by that leaf's largest value instead; on a
    well-conditioned example (small init) float32 agreement is about ``1e-6``. Computed on the
    host in float64, so float64 trees are compared at their own precision.

    Args:
      got: a pytree of arrays.
      want: the reference, a pytree of the same structure and shapes.
      floor: each leaf's scale ``max|want|`` is at least ``floor`` times the largest over all
        leaves: for a leaf whose exact gradient is 0 (e.g. a key bias, which softmax ignores)
        and which holds only round-off. ``0.0``: every leaf on its own scale.

    Returns:
      The largest per-leaf error, a Python float (0.0 for identical trees), which also names
      where it is (:class:`RelativeError`): printed, it says which leaf dominates and, where that
      leaf's scale is a tiny share of the tree's, that ``floor=`` is the fix (an exact-zero
      gradient holding round-off).

    >>> import jax.numpy as jnp, remat_nn as rn
    >>> rn.relative_error({"w": jnp.array([10.0, 0.0])}, {"w": jnp.array([10.0, 1e-3])})
    0.0001... (largest at ['w'])
    >>> err = rn.relative_error({"w": jnp.ones(2), "b": jnp.array([1e-7])},
    ...                         {"w": jnp.ones(2), "b": jnp.array([1e-9])})
    >>> err
    99.0... (largest at ['b'], whose max|want| is 1e-09 of the tree's largest: round-off on an
    exact zero? floor=1e-3 scales such leaves by the tree's largest)
    >>> float(err) > 1, rn.relative_error({"w": jnp.ones(2), "b": jnp.array([1e-7])},
    ...                                   {"w": jnp.ones(2), "b": jnp.array([1e-9])}, floor=1e-3)
    (True, 9.9...e-05 (largest at ['b']))
    """
    got_leaves = jax.tree.leaves(got)
    want_leaves = jax.tree_util.tree_leaves_with_path(want)
    if len(got_leaves) != len(want_leaves):
        raise ValueError(
            f"relative_error: `got` has {len(got_leaves)} leaves and `want` {len(want_leaves)}. "
            "Fix: compare trees of the same structure."
        )
    scales = [_largest(w) for _, w in want_leaves]
    top = max(scales, default=0.0)
    least = floor * top
    worst, where, share = 0.0, "", 1.0
    for g, (path, w), scale in zip(got_leaves, want_leaves, scales, strict=True):
        path = jax.tree_util.keystr(path)
        g, w = _host(g), _host(w)
        if g.shape != w.shape:
            raise ValueError(
                f"relative_error: leaf {path or '(root)'} has shape {g.shape} in `got` and "
                f"{w.shape} in `want`. Fix: compare arrays of the same shape."
            )
        if not w.size:
            continue
        scale = max(scale, least)
        diff = _largest(g - w)
        err = diff / scale if scale > 0 else diff
        if err > worst:
            worst, where, share = err, path or "(root)", scale / top if top > 0 else 1.0
    return RelativeError(worst, where, share)


class RelativeError(float):
    """:func:`relative_error`'s value, a float, with the leaf where it is largest (``leaf``,
    empty for 0.0) and that leaf's scale as a share of the tree's largest (``share``); its
    ``repr`` names them, and suggests ``floor=`` where the share is below :data:`TINY_SHARE`
    (``str`` and f-strings give the number alone)."""

    leaf: str
    share: float

    def __new__(cls, value: float, leaf: str = "", share: float = 1.0) -> RelativeError:
        out = super().__new__(cls, value)
        out.leaf, out.share = leaf, share
        return out

    def __str__(self) -> str:  # print, f-strings and tables: the number alone
        return float.__repr__(self)

    def __repr__(self) -> str:  # the REPL, containers, assertion messages: and where
        number = float.__repr__(self)
        if not self.leaf:
            return number
        if self.share >= TINY_SHARE:
            return f"{number} (largest at {self.leaf})"
        return (
            f"{number} (largest at {self.leaf}, whose max|want| is {self.share:.0e} of the "
            "tree's largest: round-off on an exact zero? floor=1e-3 scales such leaves by the "
            "tree's largest)"
        )


#: A leaf whose largest value is below this share of the tree's largest: its error may be
#: round-off on an exact zero (a key bias softmax ignores, a bias under BatchNorm).
TINY_SHARE = 1e-4


def _host(x: Any) -> np.ndarray:
    # On the host (the two trees may live on different devices or meshes), in float64: the
    # difference of two float32 (or 16-bit) values is exact there, and float64 trees keep
    # their own precision (float32 would hide everything below ~6e-8).
    return np.asarray(jax.device_get(x), np.float64)


def _largest(x: Any) -> float:
    x = _host(x)
    return float(np.max(np.abs(x))) if x.size else 0.0
