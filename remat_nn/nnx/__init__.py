"""remat_nn.nnx: remat, reversible couplings and stacks for Flax NNX, built on the remat_nn core.

``import remat_nn`` never imports flax; this package does (``flax.nnx``).

>>> from remat_nn import nnx as rnnx
"""

try:
    import flax  # noqa: F401  (the one optional dependency of this package: say how to get it)
except ImportError as e:
    raise ImportError(
        "remat_nn.nnx builds on flax.nnx, and flax is not installed. Fix: pip install "
        "'remat_nn[flax]' (the core, `import remat_nn`, needs only jax, numpy and pyyaml)"
    ) from e

# --- remat transform: flax.nnx.remat plus names, policies and validated plans ---------------------
from remat_nn.nnx._remat import checkpoint, remat
from remat_nn.nnx._remat_scan import remat_scan
from remat_nn.nnx._tied import tied_remat

# --- reversible couplings and sequences -----------------------------------------------------------
from remat_nn.nnx._coupling import AdditiveCoupling, AffineCoupling, Coupling
from remat_nn.nnx._reversible import ReversibleSequence, coupling_layer

# --- memory report and planner on NNX modules ----------------------------------------------------
from remat_nn.nnx._pure import pure

__all__: list[str] = [
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
    # memory report and planner
    "pure",
]
