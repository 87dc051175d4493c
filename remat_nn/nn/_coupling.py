"""Reversible couplings: ``AdditiveCoupling`` (RevNet) and ``AffineCoupling``.

A coupling holds two residual functions F and G (any flax.linen modules) and states both
directions in one class: ``forward`` and ``inverse``. Inputs are either a pair ``(x1, x2)`` (the
result is a pair) or a single array whose last axis is split in two equal halves (the result is
one array, the halves concatenated back). F's and G's outputs are tagged ``coupling_f`` /
``coupling_g`` (:mod:`remat_nn.names`), so a remat plan around a coupling can address them.

References:
  Gomez et al. (2017). The Reversible Residual Network: Backpropagation Without Storing
  Activations. NeurIPS. https://arxiv.org/abs/1707.04585
  Kitaev et al. (2020). Reformer: The Efficient Transformer. ICLR.
  https://arxiv.org/abs/2001.04451
  MemCNN (Van de Leemput et al. 2019): AdditiveCoupling / AffineCoupling.
  https://github.com/silvandeleemput/memcnn
"""

from __future__ import annotations

from typing import Any

import flax.linen as fnn
import jax

from remat_nn import names
from remat_nn._coupling import (
    additive_combine,
    additive_uncombine,
    affine_combine,
    affine_uncombine,
)
from remat_nn._halves import couple, uncouple
from remat_nn.names import name

__all__ = ["AdditiveCoupling", "AffineCoupling", "Coupling"]


class Coupling(fnn.Module):
    """Base of two-residual couplings ``y1 = combine(x1, F(x2)); y2 = combine(x2, G(y1))``.

    Subclasses set ``combine`` / ``uncombine`` (static, elementwise, invertible in the first
    argument). Keyword arguments of ``forward`` / ``inverse`` (e.g. ``train=True``) are passed
    to both F and G.

    Attributes:
      f: the residual function F (a flax module template), applied to ``x2``.
      g: the residual function G, applied to ``y1``.
    """

    f: fnn.Module
    g: fnn.Module

    # Class attributes, not dataclass fields: the coupling law is part of the class.
    combine = staticmethod(additive_combine)
    uncombine = staticmethod(additive_uncombine)

    def apply_f(self, x2: jax.Array, **kwargs: Any) -> jax.Array:
        """``F(x2)``, tagged :data:`remat_nn.names.COUPLING_F`."""
        return name(self.f(x2, **kwargs), names.COUPLING_F)

    def apply_g(self, y1: jax.Array, **kwargs: Any) -> jax.Array:
        """``G(y1)``, tagged :data:`remat_nn.names.COUPLING_G`."""
        return name(self.g(y1, **kwargs), names.COUPLING_G)

    def forward(self, x: Any, **kwargs: Any) -> Any:
        """``(x1, x2) -> (y1, y2)``; a single array is split on, and returned merged on, its last
        axis."""
        return couple(self, x, kwargs)

    def inverse(self, y: Any, **kwargs: Any) -> Any:
        """``(y1, y2) -> (x1, x2)`` with ``inverse(forward(x)) == x`` up to round-off."""
        return uncouple(self, y, kwargs)

    def __call__(self, x: Any, **kwargs: Any) -> Any:
        """Same as :meth:`forward`."""
        return self.forward(x, **kwargs)


class AdditiveCoupling(Coupling):
    """The RevNet coupling: ``y1 = x1 + F(x2); y2 = x2 + G(y1)``.

    Inverse: ``x2 = y2 - G(y1); x1 = y1 - F(x2)``. F maps a half to the shape of the other
    half (for equal halves: shape-preserving). Use it alone, or as the layer of
    :class:`remat_nn.nn.ReversibleSequence` to get a backward that stores no activations.

    Attributes:
      f: residual function F (flax module), applied to ``x2``.
      g: residual function G (flax module), applied to ``y1``.

    >>> import jax, jax.numpy as jnp, flax.linen as fnn
    >>> from remat_nn import nn
    >>> layer = nn.AdditiveCoupling(fnn.Dense(2), fnn.Dense(2))
    >>> x = jnp.arange(8.0).reshape(2, 4)                  # halves (2, 2) and (2, 2)
    >>> variables = layer.init(jax.random.key(0), x)
    >>> y = layer.apply(variables, x)
    >>> x_rec = layer.apply(variables, y, method="inverse")
    >>> import remat_nn as rn
    >>> rn.relative_error(x_rec, x) < 1e-6                   # max|a - b| / max|b|
    True

    References:
      Gomez et al. (2017), The Reversible Residual Network, eq. (1)-(2); MemCNN AdditiveCoupling.
    """


class AffineCoupling(Coupling):
    """An affine coupling with a positive, bounded scale.

    ``y1 = x1 * exp(tanh(s_F)) + t_F`` with ``(s_F, t_F) = split(F(x2), 2, axis=-1)``, then
    ``y2 = x2 * exp(tanh(s_G)) + t_G`` with ``(s_G, t_G) = split(G(y1), 2, axis=-1)``. So F and G
    output twice the width of the half they update (log-scale, then shift). The log-scale is
    bounded with ``tanh`` (not softplus): each scale lies in ``[1/e, e]``, so neither direction
    can blow up or collapse a feature, and the inverse ``x = (y - t) * exp(-tanh(s))`` is exact
    and as well conditioned as the forward.

    Attributes:
      f: residual function F (flax module), ``x2 -> 2 * width(x1)`` features.
      g: residual function G (flax module), ``y1 -> 2 * width(x2)`` features.

    >>> import jax, jax.numpy as jnp, flax.linen as fnn
    >>> from remat_nn import nn
    >>> layer = nn.AffineCoupling(fnn.Dense(4), fnn.Dense(4))   # halves of width 2
    >>> x = jnp.arange(8.0).reshape(2, 4)
    >>> variables = layer.init(jax.random.key(0), x)
    >>> y = layer.apply(variables, x)
    >>> import remat_nn as rn
    >>> rn.relative_error(layer.apply(variables, y, method="inverse"), x) < 1e-6
    True

    References:
      Dinh et al. (2017), Density estimation using Real NVP (affine coupling); Gomez et al.
      (2017), The Reversible Residual Network; MemCNN AffineCoupling.
    """

    combine = staticmethod(affine_combine)
    uncombine = staticmethod(affine_uncombine)
