"""``rnnx.remat_scan``: a stack of Flax NNX layers, their state stacked on a leading axis (as
``nnx.vmap`` of a constructor makes them), run as :func:`remat_nn.remat_scan`'s nested
checkpointed scan.

The NNX idiom it replaces, ``nnx.scan(nnx.remat(f), in_axes=(0, nnx.Carry, 0), out_axes=...)``,
keeps every layer's input (``n`` carries); here ``levels`` nest the scan, about
``levels * n**(1/levels)`` carries held for one extra forward per level, and the body takes a
policy or a plan (checked against the layer: a name that never occurs is refused). In a Python
``for`` loop, per-layer ``rnnx.remat`` saves nothing on XLA:CPU (it runs the recomputations as
soon as their inputs exist: see ``remat_nn._tie``); inside a scan it does, on every backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx

from remat_nn._checkpoint import check_policy
from remat_nn._remat_scan import remat_scan as rn_remat_scan

__all__ = ["remat_scan"]

WHERE = "nnx.remat_scan"


def remat_scan(
    f: Callable[..., tuple[Any, Any]],
    layers: nnx.Module,
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    levels: int | None = None,
    lengths: Sequence[int] | None = None,
    policy: Any = None,
    carry_policy: str | Sequence[str] = "recompute",
) -> tuple[Any, Any]:
    """``f(layer, carry, x) -> (carry, y)`` over the layers of ``layers``, nested-checkpointed.

    Args:
      f: one step: the layer (an ``nnx.Module`` holding one layer's slice of ``layers``), the
        carry and this step's slice of ``xs``; returns ``(carry, y)`` as ``lax.scan``'s body.
      layers: an ``nnx.Module`` whose every ``nnx.Param`` has a leading axis of the number of
        layers (``nnx.vmap`` of the layer's constructor, with ``nnx.split_rngs``), and no other
        state: layers with BatchNorm statistics or random-number streams go through
        ``nnx.scan``, which carries state (refused here, with that fix).
      init, xs, length, reverse, unroll: as ``lax.scan`` (``xs`` is scanned beside the layers).
      levels, lengths, policy, carry_policy: as :func:`remat_nn.remat_scan`.

    Returns:
      ``(final carry, stacked ys)``. Gradients reach ``layers``' parameters as for any
      function of an NNX module (``nnx.grad``, or ``nnx.split`` and ``jax.grad``).

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from remat_nn import nnx as rnnx
    >>> @nnx.split_rngs(splits=12)
    ... @nnx.vmap(in_axes=(0,), out_axes=0)
    ... def create(rngs):
    ...     return nnx.Linear(4, 4, rngs=rngs)
    >>> layers = create(nnx.Rngs(0))
    >>> step = lambda layer, h, _: (jnp.tanh(layer(h)), None)
    >>> h, _ = rnnx.remat_scan(step, layers, jnp.ones((2, 4)), levels=2, policy="full")
    >>> h.shape
    (2, 4)
    """
    if not callable(f) or isinstance(f, nnx.Module):
        raise TypeError(
            f"{WHERE}: argument `f` must be a function f(layer, carry, x) -> (carry, y), got "
            f"{type(f).__name__}. Fix: {WHERE}(lambda layer, h, x: (layer(h), None), layers, h)."
        )
    if not isinstance(layers, nnx.Module):
        raise TypeError(
            f"{WHERE}: argument `layers` must be an nnx.Module whose parameters are stacked on "
            f"a leading layer axis, got {type(layers).__name__}. Fix: build it with nnx.vmap "
            "of the layer's constructor (see the docstring)."
        )
    check_policy(policy, WHERE)
    graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
    extra = sorted({type(v).__name__ for _, v in nnx.to_flat_state(rest)})
    if extra:
        raise ValueError(
            f"{WHERE}: `layers` holds state besides nnx.Param ({', '.join(extra)}); only "
            "parameters are scanned here (BatchNorm statistics and random-number streams change "
            "in the forward pass). Fix: nnx.scan(nnx.remat(f), ...) for layers with state, or "
            "keep that state out of the scanned layers."
        )

    def body(carry: Any, step: tuple[Any, Any]) -> tuple[Any, Any]:
        p, x = step
        return f(nnx.merge(graphdef, p, rest), carry, x)

    return rn_remat_scan(
        body,
        init,
        (params, xs),
        length=length,
        reverse=reverse,
        unroll=unroll,
        levels=levels,
        lengths=lengths,
        policy=policy,
        carry_policy=carry_policy,
    )
