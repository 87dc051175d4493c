"""remat_nn.nnx: remat, reversible couplings and stacks for Flax NNX, built on the remat_nn core.

``import remat_nn`` never imports flax; this package does (``flax.nnx``).

>>> from remat_nn import nnx as rnnx
"""

# --- remat transform: flax.nnx.remat plus names, policies and validated plans ---------------------
from remat_nn.nnx._remat import checkpoint, remat

# --- reversible couplings and sequences -----------------------------------------------------------
from remat_nn.nnx._coupling import AdditiveCoupling, AffineCoupling, Coupling
from remat_nn.nnx._reversible import ReversibleSequence

# --- memory report and planner on NNX modules ----------------------------------------------------
from remat_nn.nnx._pure import pure

__all__: list[str] = [
    "checkpoint",
    "remat",
    # reversible
    "AdditiveCoupling",
    "AffineCoupling",
    "Coupling",
    "ReversibleSequence",
    # memory report and planner
    "pure",
]
