"""``nn.tied_remat``: a rematerialized unit whose recomputation waits for the backward pass.

In unrolled code XLA:CPU runs a recomputation as soon as its inputs exist, at the start of the
backward pass, so a plain per-unit remat saves nothing there (see ``remat_nn._tie``). Here the
unit's VJP is taken in the forward pass and called in the backward pass with its residuals tied
to the incoming cotangent, which orders the recomputation where it belongs on every backend.
"""

from __future__ import annotations

from typing import Any

import flax.linen as fnn
import jax

from remat_nn._tie import tie_to_cotangent
from remat_nn.nn._remat import remat

__all__ = ["tied_remat"]


def _call(unit: fnn.Module, x: jax.Array) -> jax.Array:
    return unit(x)


def _call_fwd(unit: fnn.Module, x: jax.Array) -> tuple[jax.Array, Any]:
    # The VJP of the rematerialized unit keeps what its policy saves (its input, for "full").
    return fnn.vjp(_call, unit, x, vjp_variables=True)


def _call_bwd(vjp_fn: Any, dy: jax.Array) -> Any:
    return tie_to_cotangent(vjp_fn, dy)(dy)


def tied_remat(
    parent: fnn.Module,
    cls: type[fnn.Module],
    x: jax.Array,
    *args: Any,
    policy: Any,
    name: str,
) -> jax.Array:
    """``cls(*args, name=name)(x)``, its activations recomputed in the backward pass under
    ``policy``, the recomputation ordered after the incoming cotangent.

    The unit is ``nn.remat(cls, policy=policy)`` (a plan checked against its body) whose VJP is
    taken in the forward pass and called in the backward pass with its residuals tied to the
    cotangent (an exact zero computed from it), so the recomputation runs in the backward pass
    on every backend, XLA:CPU included, where ``prevent_cse`` does not hold. Same variables as
    ``cls`` (BatchNorm statistics updated once, by the forward pass); the gradient equals plain
    autodiff's. Inside ``nn.scan`` / ``lax.scan`` a plain ``nn.remat`` is enough: the loop
    orders the recomputation already.

    Args:
      parent: the module calling this from its ``@compact`` method (``self``): the unit is its
        submodule ``name``.
      cls: the unit's ``flax.linen.Module`` class; ``cls(*args)`` takes one array and draws no
        random numbers (the remat lifts no PRNG key).
      x: the unit's input.
      *args: ``cls``'s attributes, positional.
      policy: what the unit saves, as :func:`remat_nn.nn.remat` takes it (a policy name or
        alias, a :class:`remat_nn.Plan`, ...); ``"none"``: no remat, ``cls`` called as is.
      name: the unit's name in ``parent`` (its variables' key).

    Returns:
      The unit's output. While ``parent`` initializes, ``cls`` is called as is (there is no
      backward pass to order).

    Example::

      class Net(fnn.Module):
          @fnn.compact
          def __call__(self, x, *, train=False):
              for i in range(4):  # an unrolled stack: each unit's input kept, the rest recomputed
                  x = rnn.tied_remat(self, Unit, x, 64, train, policy="full", name=f"unit{i}")
              return x
    """
    # Initialisation has no backward pass; flax's custom_vjp would close over the init key,
    # which jax_custom_vjp3 refuses.
    if (isinstance(policy, str) and policy == "none") or parent.is_initializing():
        return cls(*args, name=name)(x)
    # The custom_vjp may close over no tracer (jax_custom_vjp3 refuses one): every collection is
    # its input (BatchNorm reads its running statistics in training), and the unit draws no
    # random numbers, so the remat lifts no PRNG key (a trainer may pass a dropout key).
    unit = remat(cls, policy=policy, prevent_cse=False, rngs=False)(*args, name=name)
    vjp = fnn.custom_vjp(_call, forward_fn=_call_fwd, backward_fn=_call_bwd, grad_vars=True)
    return vjp(unit, x)
