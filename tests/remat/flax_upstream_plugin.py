"""pytest plugin: run flax's own tests with flax's remat replaced by remat_nn's.

``flax.linen.remat`` / ``checkpoint`` become ``remat_nn.nn.remat``; ``flax.nnx.remat`` becomes
``remat_nn.nnx.remat`` (which forwards to the original it imported before this patch).
"""

import flax.linen
from flax import nnx

from remat_nn import nn
from remat_nn import nnx as rnnx

flax.linen.remat = nn.remat
flax.linen.checkpoint = nn.remat
nnx.remat = rnnx.remat
