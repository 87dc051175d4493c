"""pytest plugin: run flax's own tests with flax.linen.remat / checkpoint replaced by nn.remat."""

import flax.linen

from remat_nn import nn

flax.linen.remat = nn.remat
flax.linen.checkpoint = nn.remat
