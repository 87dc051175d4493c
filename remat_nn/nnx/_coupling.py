"""Reversible couplings as NNX modules: ``AdditiveCoupling`` (RevNet) and ``AffineCoupling``.

The NNX twins of :mod:`remat_nn.nn`'s couplings, with the same laws (from the pure core,
:func:`remat_nn.additive_combine` / :func:`remat_nn.affine_combine`), the same input forms (a
pair ``(x1, x2)`` or one array split on its last axis) and the same activation names
(``coupling_f`` / ``coupling_g``). F and G are NNX modules held by the coupling.

References:
  Gomez et al. (2017). The Reversible Residual Network: Backpropagation Without Storing
  Activations. NeurIPS. https://arxiv.org/abs/1707.04585
  Dinh et al. (2017). Density estimation using Real NVP (affine coupling).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

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


class Coupling(nnx.Module):
    """Base of two-residual couplings ``y1 = combine(x1, F(x2)); y2 = combine(x2, G(y1))``.

    Subclasses set ``combine`` / ``uncombine`` (elementwise, invertible in the first argument).
    Keyword arguments of ``forward`` / ``inverse`` (e.g. ``train=True``) are passed to F and G.

    Args:
      f: the residual function F (an NNX module or any callable), applied to ``x2``.
      g: the residual function G, applied to ``y1``.
    """

    # Class attributes: the coupling law is part of the class, not of the module's state.
    combine = staticmethod(additive_combine)
    uncombine = staticmethod(additive_uncombine)

    def __init__(self, f: Any, g: Any) -> None:
        for arg, fn in (("f", f), ("g", g)):
            if not callable(fn):
                raise TypeError(
                    f"{type(self).__name__}: argument `{arg}` must be a callable NNX module, got "
                    f"{type(fn).__name__} {fn!r}. Fix: {type(self).__name__}(nnx.Linear(d, d, "
                    "rngs=rngs), nnx.Linear(d, d, rngs=rngs))."
                )
        self.f = f
        self.g = g

    def apply_f(self, x2: Any, **kwargs: Any) -> Any:
        """``F(x2)``, tagged :data:`remat_nn.names.COUPLING_F`."""
        return name(self.f(x2, **kwargs), names.COUPLING_F)

    def apply_g(self, y1: Any, **kwargs: Any) -> Any:
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

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import remat_nn as rn
    >>> from remat_nn import nnx as rnnx
    >>> rngs = nnx.Rngs(0)
    >>> layer = rnnx.AdditiveCoupling(nnx.Linear(2, 2, rngs=rngs), nnx.Linear(2, 2, rngs=rngs))
    >>> x = jnp.arange(8.0).reshape(2, 4)                  # halves (2, 2) and (2, 2)
    >>> rn.relative_error(layer.inverse(layer(x)), x) < 1e-6     # max|a - b| / max|b|
    True

    References:
      Gomez et al. (2017), The Reversible Residual Network, eq. (1)-(2).
    """


class AffineCoupling(Coupling):
    """An affine coupling with a positive, bounded scale (see
    :class:`remat_nn.nn.AffineCoupling`): F and G output twice the width of the half they
    update (log-scale, then shift); each scale ``exp(tanh(s))`` lies in ``[1/e, e]``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import remat_nn as rn
    >>> from remat_nn import nnx as rnnx
    >>> rngs = nnx.Rngs(0)
    >>> layer = rnnx.AffineCoupling(nnx.Linear(2, 4, rngs=rngs), nnx.Linear(2, 4, rngs=rngs))
    >>> x = jnp.arange(8.0).reshape(2, 4)
    >>> rn.relative_error(layer.inverse(layer(x)), x) < 1e-6     # max|a - b| / max|b|
    True

    References:
      Dinh et al. (2017), Real NVP; Gomez et al. (2017), The Reversible Residual Network.
    """

    combine = staticmethod(affine_combine)
    uncombine = staticmethod(affine_uncombine)
