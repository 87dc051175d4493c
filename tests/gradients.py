"""The one gradient comparison of the suite, :func:`remat_nn.relative_error`, and the variables
it compares gradients at, :func:`random_variables`.

XLA's code differs between CPU models, so gradients differ in the last bits from machine to
machine; an elementwise rtol on raw values fails where a value is near 0. Compare
``max|got - want| / max|want|`` per leaf on well-conditioned inputs (small init) instead, with a
stated tolerance. Doctests use the same function as ``rn.relative_error``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from remat_nn import relative_error as rel_err

__all__ = ["counts_agree", "random_variables", "rel_err"]


def random_variables(tree, seed: int = 0, *, kernel_scale: float = 1.0):
    """Concrete variables of the shapes in ``tree``, made with NumPy (no init compile).

    Kernels and embeddings ~ N(0, kernel_scale**2 / fan_in); norm scales and BatchNorm
    variances near 1; biases and means small. Any weights serve a gradient comparison; XLA:CPU
    takes a minute to compile some models' `init`, this takes milliseconds.
    """
    rng = np.random.default_rng(seed)

    def make(path, leaf):
        key = jax.tree_util.keystr(path)
        shape = leaf.shape
        if key.endswith("['scale']") or key.endswith("['var']"):
            a = 1.0 + 0.1 * rng.uniform(-1, 1, shape)
        elif key.endswith("['bias']") or key.endswith("['mean']"):
            a = 0.1 * rng.standard_normal(shape)
        else:  # kernels ([L,] [H, W,] fan_in, fan_out) and embeddings (vocab, D)
            fan_in = math.prod(shape[-4:-1]) if len(shape) >= 4 else shape[-2]
            a = kernel_scale * rng.standard_normal(shape) / math.sqrt(fan_in)
        return jnp.asarray(a, leaf.dtype)

    return jax.tree_util.tree_map_with_path(make, tree)


def counts_agree(got: float, want: float) -> bool:
    """Whether two compiled programs (say, a drift check reporting by host callback and the same
    check reporting in the program's outputs) counted the same drifted layers: they may round a
    layer whose drift sits at the tolerance to either side of it, so within a quarter (at
    least one)."""
    return abs(got - want) <= max(1, want // 4)
