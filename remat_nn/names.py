"""Activation names: ``rn.name`` and the canonical names remat_nn's own modules produce.

A name tags an intermediate value so that a remat policy or plan can decide, per name, whether
reverse-mode autodiff saves it, offloads it to host memory or recomputes it. Every name used by
remat_nn's modules and models is a constant below, documented once in :data:`ACTIVATIONS` (where
it is produced and its typical shape). The vocabulary follows MaxText where it has one.

Shape legend: B batch, T sequence length, D model width, H heads, K head width, F MLP width.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from remat_nn._jax_internals import source_info_util

__all__ = [
    "ACTIVATIONS",
    "ATTENTION_SCORES",
    "CONTEXT",
    "CONV_OUT",
    "COUPLING_F",
    "COUPLING_G",
    "DECODER_LAYER_INPUT",
    "KEY_PROJ",
    "MLP_HIDDEN",
    "MLP_IN",
    "MLP_OUT",
    "OUT_PROJ",
    "QUERY_PROJ",
    "RESIDUAL_BODY",
    "VALUE_PROJ",
    "name",
]

T = TypeVar("T")

# Name equations should point at the caller's line, not at this wrapper.
source_info_util.register_exclusion(__file__)

DECODER_LAYER_INPUT = "decoder_layer_input"
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
ATTENTION_SCORES = "attention_scores"
CONTEXT = "context"
OUT_PROJ = "out_proj"
MLP_IN = "mlp_in"
MLP_HIDDEN = "mlp_hidden"
MLP_OUT = "mlp_out"
RESIDUAL_BODY = "residual_body"
COUPLING_F = "coupling_f"
COUPLING_G = "coupling_g"
CONV_OUT = "conv_out"

#: name -> where it is produced and its typical shape. The one place each name is documented.
ACTIVATIONS: Mapping[str, str] = MappingProxyType(
    {
        DECODER_LAYER_INPUT: "input of each transformer block, after the previous residual add;"
        " (B, T, D)",
        QUERY_PROJ: "attention query projection, before the dot with keys; (B, T, H, K)",
        KEY_PROJ: "attention key projection; (B, T, H, K)",
        VALUE_PROJ: "attention value projection; (B, T, H, K)",
        ATTENTION_SCORES: "softmax(q k^T / sqrt(K)) when attention is materialized; (B, H, T, T)",
        CONTEXT: "attention output: scores applied to values, heads not yet merged; (B, T, H, K)",
        OUT_PROJ: "attention output projection, before the residual add; (B, T, D)",
        MLP_IN: "MLP input after the pre-norm; (B, T, D)",
        MLP_HIDDEN: "MLP hidden activation after the nonlinearity; (B, T, F)",
        MLP_OUT: "MLP output projection, before the residual add; (B, T, D)",
        RESIDUAL_BODY: "output of a RematBlock's body, before `x + body(x)`; shape of x",
        COUPLING_F: "F(x2) inside a reversible coupling; shape of one half of the input",
        COUPLING_G: "G(y1) inside a reversible coupling; shape of one half of the input",
        CONV_OUT: "output of each convolution of a CNN residual function (models._cifar's"
        " ResidualFn, in ResNet units and RevNet F / G), before its BatchNorm; (B, H, W, C)",
    }
)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def name(x: T, name: str) -> T:
    """Tags ``x`` (an array or a pytree of arrays) with an activation ``name``.

    The identity at run time; inside ``jax.checkpoint`` / ``nn.remat`` the name lets a policy
    or plan save, offload or recompute this value. Thin, checked wrapper over
    ``jax.ad_checkpoint.checkpoint_name``.

    Args:
      x: a JAX or NumPy array, or a pytree of them.
      name: a non-empty string, e.g. one of the constants of this module.

    Returns:
      ``x`` unchanged.

    Raises:
      TypeError: ``name`` is not a non-empty string, or a leaf of ``x`` is not an array.

    >>> import jax.numpy as jnp, remat_nn as rn
    >>> rn.name(jnp.ones(3), rn.names.MLP_HIDDEN)
    Array([1., 1., 1.], dtype=float32)
    """
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"rn.name: argument `name` must be a non-empty string, got {name!r} "
            f"({type(name).__name__}). Fix: rn.name(x, 'mlp_hidden')."
        )
    leaves, _ = jax.tree_util.tree_flatten(x)
    for i, leaf in enumerate(leaves):
        if not _is_array(leaf):
            where = "" if len(leaves) == 1 else f" (leaf {i} of the pytree)"
            raise TypeError(
                f"rn.name(x, {name!r}): argument `x` must be an array or a pytree of arrays, got "
                f"{type(leaf).__name__} {leaf!r}{where}. Fix: pass jnp.asarray(...) or drop it."
            )
    return checkpoint_name(x, name)
