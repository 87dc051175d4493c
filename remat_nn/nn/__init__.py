"""remat_nn.nn: flax.linen modules and transforms built on the remat_nn core.

>>> from remat_nn import nn
"""

try:
    import flax  # noqa: F401  (the one optional dependency of this package: say how to get it)
except ImportError as e:
    raise ImportError(
        "remat_nn.nn builds on flax.linen, and flax is not installed. Fix: pip install "
        "'remat_nn[flax]' (the core, `import remat_nn`, needs only jax, numpy and pyyaml)"
    ) from e

# --- remat transform (nn.checkpoint is nn.remat, as in flax.linen) --------------------------------
from remat_nn.nn._remat import checkpoint, remat
from remat_nn.nn._remat_scan import remat_scan
from remat_nn.nn._tied import tied_remat

# --- reversible couplings and sequences -----------------------------------------------------------
from remat_nn._halves import merge_halves, split_halves
from remat_nn.nn._coupling import AdditiveCoupling, AffineCoupling, Coupling
from remat_nn.nn._reversible import ReversibleSequence, coupling_layer

# --- blocks ---------------------------------------------------------------------------------------
from remat_nn.nn._blocks import RematBlock

__all__: list[str] = [
    "RematBlock",
    "checkpoint",
    "remat",
    "remat_scan",
    "tied_remat",
    # reversible
    "AdditiveCoupling",
    "AffineCoupling",
    "Coupling",
    "ReversibleSequence",
    "coupling_layer",
    "merge_halves",
    "split_halves",
]
