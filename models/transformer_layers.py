"""The pre-LayerNorm transformer's layers, each tagging the activations remat plans name
(:mod:`remat_nn.names`): causal self-attention with rotary or learned positions, the MLP, and
the block that joins them (residual, or as the two branches of a reversible coupling). The model
that stacks them, its remat presets and registry: :mod:`models.transformer`.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp

import remat_nn as rn
from models._spec import at_least_float32
from remat_nn import names

__all__ = ["MLP", "Attention", "Block", "CausalSelfAttention"]


def _rotary(x: jax.Array) -> jax.Array:
    """Rotates pairs of channels of ``x`` (B, T, H, K) by position-dependent angles (RoPE)."""
    _, t, _, k = x.shape
    half = k // 2
    freqs = 1.0 / (10_000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))  # (K/2,)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]  # (T, K/2)
    cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)  # (1, T, 1, K/2)
    sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)  # (1, T, 1, K/2)
    x1, x2 = x[..., :half], x[..., half:]  # (B, T, H, K/2) each
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)  # (B, T, H, K)


class CausalSelfAttention(fnn.Module):
    """Causal multi-head attention with materialized, named scores.

    Attributes:
      n_heads: number of heads H (d_model must be divisible by it).
      rotary: rotate queries and keys (RoPE) instead of relying on learned positions.
      dropout: dropout rate on the attention probabilities and the output.
      dtype: compute dtype (parameters stay float32).
    """

    n_heads: int
    rotary: bool = False
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @fnn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        b, t, d = x.shape
        h, k = self.n_heads, d // self.n_heads
        proj = lambda name: fnn.DenseGeneral((h, k), dtype=self.dtype, name=name)
        q = rn.name(proj("query")(x), names.QUERY_PROJ)  # (B, T, H, K)
        key = rn.name(proj("key")(x), names.KEY_PROJ)  # (B, T, H, K)
        v = rn.name(proj("value")(x), names.VALUE_PROJ)  # (B, T, H, K)
        if self.rotary:
            q, key = _rotary(q), _rotary(key)
        scores = jnp.einsum("bthk,bshk->bhts", q, key) / math.sqrt(k)  # (B, H, T, T)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # (T, T)
        scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
        # softmax in at least float32; stored (if saved) in the compute dtype.
        wide = at_least_float32(scores.dtype)
        probs = jax.nn.softmax(scores.astype(wide), axis=-1).astype(self.dtype)
        probs = rn.name(probs, names.ATTENTION_SCORES)  # (B, H, T, T)
        probs = fnn.Dropout(self.dropout, deterministic=not train)(probs)
        ctx = rn.name(jnp.einsum("bhts,bshk->bthk", probs, v), names.CONTEXT)  # (B, T, H, K)
        out = fnn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, name="out")(ctx)  # (B, T, D)
        out = rn.name(out, names.OUT_PROJ)
        return fnn.Dropout(self.dropout, deterministic=not train)(out)


class MLP(fnn.Module):
    """Pre-norm MLP: LayerNorm, Dense(F), gelu, Dense(D), each output named.

    Attributes:
      d_ff: hidden width F.
      dropout: dropout rate on the output.
      dtype: compute dtype.
    """

    d_ff: int
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @fnn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        h = rn.name(fnn.LayerNorm(dtype=self.dtype, name="ln")(x), names.MLP_IN)  # (B, T, D)
        h = jax.nn.gelu(fnn.Dense(self.d_ff, dtype=self.dtype, name="fc_in")(h))  # (B, T, F)
        h = rn.name(h, names.MLP_HIDDEN)
        out = fnn.Dense(x.shape[-1], dtype=self.dtype, name="fc_out")(h)  # (B, T, D)
        out = rn.name(out, names.MLP_OUT)
        return fnn.Dropout(self.dropout, deterministic=not train)(out)


class Attention(fnn.Module):
    """Pre-norm attention sub-layer: LayerNorm then :class:`CausalSelfAttention` (no residual).

    Attributes:
      n_heads: number of heads.
      rotary: use rotary position embedding.
      dropout: dropout rate.
      dtype: compute dtype.
    """

    n_heads: int
    rotary: bool = False
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @fnn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        y = fnn.LayerNorm(dtype=self.dtype, name="ln")(x)  # (B, T, D)
        attn = CausalSelfAttention(
            self.n_heads, rotary=self.rotary, dropout=self.dropout, dtype=self.dtype, name="attn"
        )
        return attn(y, train=train)


class Block(fnn.Module):
    """One pre-norm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    The call signature ``(carry, _) -> (carry, None)`` lets ``nn.scan`` run it over layers.

    Attributes:
      n_heads: number of heads.
      d_ff: MLP hidden width.
      rotary: rotary position embedding.
      dropout: dropout rate.
      dtype: compute dtype.
      train: training mode (dropout on); an attribute so that it is static under scan/remat.
    """

    n_heads: int
    d_ff: int
    rotary: bool = False
    dropout: float = 0.0
    dtype: Any = jnp.float32
    train: bool = False

    @fnn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        x = rn.name(x, names.DECODER_LAYER_INPUT)  # (B, T, D)
        x = x + Attention(self.n_heads, self.rotary, self.dropout, self.dtype, name="attention")(
            x, train=self.train
        )
        x = x + MLP(self.d_ff, self.dropout, self.dtype, name="mlp")(x, train=self.train)
        return x, None
