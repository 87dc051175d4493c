"""The two halves of a coupling, framework-free: splitting an input into ``(x1, x2)`` and back,
and a coupling's two directions over any layer with ``apply_f`` / ``apply_g`` / ``combine`` /
``uncombine`` (the flax.linen couplings in :mod:`remat_nn.nn` and the NNX ones in
:mod:`remat_nn.nnx` share them).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["couple", "merge_halves", "split_halves", "uncouple"]

Pair = tuple[jax.Array, jax.Array]


def split_halves(x: Any) -> tuple[Pair, bool]:
    """Splits a coupling input into ``(x1, x2)``; also says whether it was a single array.

    Args:
      x: a pair ``(x1, x2)`` of arrays, or one array whose last axis has even size (split into
        its first and second halves).

    Returns:
      ``((x1, x2), was_array)``; pass ``was_array`` to :func:`merge_halves`.

    >>> import jax.numpy as jnp
    >>> from remat_nn import nn
    >>> (x1, x2), was_array = nn.split_halves(jnp.arange(4.0))
    >>> x1, x2, was_array
    (Array([0., 1.], dtype=float32), Array([2., 3.], dtype=float32), True)
    """
    if isinstance(x, tuple | list):
        if len(x) != 2:
            raise ValueError(
                f"coupling input: a sequence input must be a pair (x1, x2), got {len(x)} items. "
                "Fix: pass (x1, x2), or one array split on its last axis."
            )
        return (x[0], x[1]), False
    if not isinstance(x, jax.Array) or x.ndim == 0 or x.shape[-1] % 2:
        raise ValueError(
            "coupling input: expected a pair (x1, x2) or an array whose last axis has even size, "
            f"got {type(x).__name__} of shape {getattr(x, 'shape', None)}. Fix: pad the "
            "channels to an even number, or pass the two halves as a tuple."
        )
    x1, x2 = jnp.split(x, 2, axis=-1)
    return (x1, x2), True


def merge_halves(pair: Pair, was_array: bool) -> Any:
    """Inverse of :func:`split_halves`: concatenates on the last axis if the input was an array.

    >>> import jax.numpy as jnp
    >>> from remat_nn import nn
    >>> nn.merge_halves((jnp.zeros(1), jnp.ones(1)), True)
    Array([0., 1.], dtype=float32)
    """
    return jnp.concatenate(pair, axis=-1) if was_array else tuple(pair)


def couple(layer: Any, x: Any, kwargs: dict[str, Any]) -> Any:
    """``forward`` of a coupling ``layer`` (linen or NNX: anything with ``apply_f``,
    ``apply_g``, ``combine``): ``y1 = combine(x1, F(x2)); y2 = combine(x2, G(y1))``."""
    (x1, x2), was_array = split_halves(x)
    y1 = layer.combine(x1, layer.apply_f(x2, **kwargs))
    y2 = layer.combine(x2, layer.apply_g(y1, **kwargs))
    return merge_halves((y1, y2), was_array)


def uncouple(layer: Any, y: Any, kwargs: dict[str, Any]) -> Any:
    """``inverse`` of :func:`couple`: ``x2 = uncombine(y2, G(y1)); x1 = uncombine(y1, F(x2))``."""
    (y1, y2), was_array = split_halves(y)
    x2 = layer.uncombine(y2, layer.apply_g(y1, **kwargs))
    x1 = layer.uncombine(y1, layer.apply_f(x2, **kwargs))
    return merge_halves((x1, x2), was_array)
