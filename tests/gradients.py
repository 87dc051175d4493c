"""The one gradient comparison of the suite: :func:`remat_nn.relative_error`.

XLA's code differs between CPU models, so gradients differ in the last bits from machine to
machine; an elementwise rtol on raw values fails where a value is near 0. Compare
``max|got - want| / max|want|`` per leaf on well-conditioned inputs (small init) instead, with a
stated tolerance. Doctests use the same function as ``rn.relative_error``.
"""

from __future__ import annotations

from remat_nn import relative_error as rel_err

__all__ = ["rel_err"]
