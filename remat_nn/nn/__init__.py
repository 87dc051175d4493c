"""remat_nn.nn: flax.linen modules and transforms built on the remat_nn core.

>>> from remat_nn import nn
"""

# --- remat transform ------------------------------------------------------------------------------
from remat_nn.nn._remat import checkpoint, remat

# --- reversible couplings and sequences -----------------------------------------------------------

# --- blocks ---------------------------------------------------------------------------------------

__all__: list[str] = [
    "checkpoint",
    "remat",
]
