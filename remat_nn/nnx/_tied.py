"""``rnnx.tied_remat``: a rematerialized NNX unit whose recomputation waits for the backward pass.

In unrolled code (a Python ``for`` loop of units) XLA:CPU runs a recomputation as soon as its
inputs exist, at the start of the backward pass, so a plain per-unit ``rnnx.remat`` saves nothing
there (see ``remat_nn._tie``). Here the unit's VJP is taken in the forward pass and called in the
backward pass with its residuals tied to the incoming cotangent, which orders the recomputation
where it belongs on every backend. The NNX twin of ``remat_nn.nn.tied_remat``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat_nn import _named_axes
from remat_nn._checkpoint import check_policy, checkpoint
from remat_nn._policies import NO_REMAT
from remat_nn._tie import tie_to_cotangent

__all__ = ["tied_remat"]


def tied_remat(unit: nnx.Module, x: Any, *, policy: Any) -> Any:
    """``unit(x)``, its activations recomputed in the backward pass under ``policy``, the
    recomputation ordered after the incoming cotangent.

    The unit's call is checkpointed (a plan checked against it: a name that never occurs is
    refused) and its VJP taken in the forward pass; the backward pass calls it with the residuals
    tied to the cotangent (an exact zero computed from it), so the recomputation runs there on
    every backend, XLA:CPU included, where ``prevent_cse`` does not hold. The unit's state other
    than parameters (BatchNorm averages, random-number streams) is updated once, by the forward
    pass, and the recomputation replays it (the same dropout mask); the gradient equals plain
    autodiff's. Inside ``nnx.scan`` a plain ``rnnx.remat`` (or :func:`remat_scan`) is enough:
    the loop orders the recomputation already.

    Args:
      unit: an ``nnx.Module`` called with one array (close over anything else, e.g. ``train``,
        with ``functools.partial`` in the unit's own ``__call__`` defaults).
      x: its input (a pytree of arrays).
      policy: what the unit saves, as :func:`remat_nn.nnx.remat` takes it (a policy name or
        alias, a :class:`remat_nn.Plan`, ...); ``"none"``: no remat, ``unit(x)`` as is.

    Returns:
      ``unit(x)``.

    Example::

      class Net(nnx.Module):
          def __init__(self, rngs):
              self.units = nnx.List([Unit(64, rngs=rngs) for _ in range(4)])

          def __call__(self, x):
              for unit in self.units:  # unrolled: each unit's input kept, the rest recomputed
                  x = rnnx.tied_remat(unit, x, policy="full")
              return x
    """
    if not isinstance(unit, nnx.Module):
        raise TypeError(
            f"nnx.tied_remat: argument `unit` must be an nnx.Module instance, got "
            f"{type(unit).__name__}. Fix: rnnx.tied_remat(self.block, x, policy='full')."
        )
    check_policy(policy, "nnx.tied_remat")
    if isinstance(policy, str) and policy == NO_REMAT:
        return unit(x)
    graphdef, params, rest = nnx.split(unit, nnx.Param, ...)

    def call(params: Any, x: Any, rest: Any) -> tuple[Any, Any]:
        module = nnx.merge(graphdef, params, rest)
        y = module(x)
        return y, nnx.state(module, nnx.Not(nnx.Param))

    run = checkpoint(call, policy=policy, prevent_cse=False)
    y, new_rest = _tied(run)(params, x, rest)
    nnx.update(unit, new_rest)
    return y


def _tied(run: Any) -> Any:
    """The custom_vjp of ``run(params, x, rest) -> (y, new_rest)``: its VJP taken in the forward
    pass, called in the backward with the residuals tied to the cotangent."""
    axes = _named_axes.BoundAxes()

    @jax.custom_vjp
    def tied(params: Any, x: Any, rest: Any) -> tuple[Any, Any]:
        return run(params, x, rest)

    def fwd(params: Any, x: Any, rest: Any) -> tuple[Any, Any]:
        axes.capture()
        # The VJP of the checkpointed call keeps what its policy saves (its inputs, for "full").
        y, vjp, new_rest = jax.vjp(lambda p, x: run(p, x, rest), params, x, has_aux=True)
        return (y, new_rest), (vjp, _zero_cotangents(rest))

    def bwd(res: Any, cts: Any) -> tuple[Any, Any, Any]:
        vjp, zeros = res
        dy, _ = cts  # the updated state is not differentiated
        with axes.rebound():  # the unit's collectives (BatchNorm's pmean) under vmap
            dparams, dx = tie_to_cotangent(vjp, dy)(dy)
        # (Inside shard_map the VJP's own transposes sum a replicated weight's cotangent.)
        return dparams, dx, zeros

    tied.defvjp(fwd, bwd)
    return tied


def _zero_cotangents(tree: Any) -> Any:
    def zero(a: Any) -> Any:
        if jnp.issubdtype(jnp.result_type(a), jnp.inexact):
            return jnp.zeros_like(a)
        return np.zeros(jnp.shape(a), jax.dtypes.float0)

    return jax.tree.map(zero, tree)
