"""``nn.RematBlock``: a residual block ``x + body(norm(x))`` whose body is rematerialized."""

from __future__ import annotations

from typing import Any

import flax.linen as fnn
import jax

from remat_nn import names
from remat_nn.nn._remat import remat

__all__ = ["RematBlock"]


class _Body(fnn.Module):
    """``name(body(norm(x)), RESIDUAL_BODY)``: the part of a RematBlock that is rematerialized.

    ``body`` and ``norm`` are bound to the enclosing RematBlock, so their parameters sit there
    whatever the policy; this module adds no variables of its own.
    """

    body: fnn.Module
    norm: fnn.Module | None = None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x if self.norm is None else self.norm(x)
        return names.name(self.body(h), names.RESIDUAL_BODY)


class RematBlock(fnn.Module):
    """A residual block ``x + body(x)`` (or ``x + body(LayerNorm(x))``) with a rematerialized body.

    The body always runs under :func:`remat_nn.nn.remat`, so the parameter tree, ``{"body": ...,
    "norm": ...}``, is the same whatever the policy, and switching the policy never invalidates a
    checkpoint. The body output is tagged :data:`remat_nn.names.RESIDUAL_BODY`.

    Attributes:
      body: a Module mapping ``x`` to an array of ``x``'s shape; settings such as a train flag
        are its attributes (the block passes ``x`` only).
      policy: what the backward pass keeps: a policy name or alias, a plan, a plan mapping or a
        callable (see :func:`remat_nn.policy`); the default ``"full"`` recomputes the whole
        body and keeps only ``x``; ``"none"``: no remat (the body is not wrapped).
      pre_norm: apply a LayerNorm (parameters ``norm``) to ``x`` before the body.
      carry: return ``(x + body(x), None)`` and accept an ignored second argument, the calling
        convention of ``flax.linen.scan`` over layers.
      prevent_cse: as in ``jax.checkpoint``; ``False`` is safe (and faster) inside a scan.

    >>> import jax, jax.numpy as jnp, flax.linen as fnn
    >>> from remat_nn import nn
    >>> block = nn.RematBlock(fnn.Dense(4), policy="dots", pre_norm=True)
    >>> x = jnp.ones((2, 4))
    >>> variables = block.init(jax.random.key(0), x)
    >>> sorted(variables["params"])
    ['body', 'norm']
    >>> block.apply(variables, x).shape
    (2, 4)

    Scanned over 3 layers (parameters stacked on a leading axis):

    >>> Stack = fnn.scan(nn.RematBlock, variable_axes={"params": 0},
    ...                  split_rngs={"params": True}, length=3)
    >>> stack = Stack(fnn.Dense(4), policy="full", carry=True, prevent_cse=False)
    >>> v = stack.init(jax.random.key(0), x, None)
    >>> v["params"]["body"]["kernel"].shape
    (3, 4, 4)
    """

    body: fnn.Module
    policy: Any = "full"
    pre_norm: bool = False
    carry: bool = False
    prevent_cse: bool = True

    @fnn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> jax.Array | tuple[jax.Array, None]:
        norm = fnn.LayerNorm(name="norm") if self.pre_norm else None
        body = remat(_Body, policy=self.policy, prevent_cse=self.prevent_cse)
        y = x + body(self.body, norm)(x)
        return (y, None) if self.carry else y
