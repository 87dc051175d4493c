"""``nnx.pure``: an NNX module and a function of it as a pure function of its parameters.

:func:`remat_nn.memory_report`, :func:`remat_nn.compiled_memory` and
:func:`remat_nn.plan_for_budget` take pure functions of pytrees (they differentiate with respect
to their arguments). An NNX train step is a function of a stateful module; ``nnx.split``
separates the module into a static graph definition and its state, and ``nnx.merge`` rebuilds it
inside the pure function, so the parameters become an ordinary argument.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax import nnx

__all__ = ["pure"]


def pure(
    fn: Callable[..., Any], module: nnx.Module, *, wrt: Any = nnx.Param
) -> tuple[Callable[..., Any], nnx.State]:
    """Splits ``module`` so that ``fn(module, *args, **kwargs)`` becomes a pure function.

    Args:
      fn: ``fn(module, *args, **kwargs)``, e.g. a loss; it may take a ``policy=`` keyword
        (what :func:`remat_nn.plan_for_budget` passes) and hand it to :func:`remat_nn.nnx.remat`.
      module: the NNX module (not modified: state updates inside ``fn``, such as BatchNorm
        averages or RNG counts, are discarded).
      wrt: an ``nnx`` filter of the state that becomes the first argument (default
        ``nnx.Param``); the rest of the state is held fixed.

    Returns:
      ``(pure_fn, state)`` with ``pure_fn(state, *args, **kwargs) == fn(module, *args,
      **kwargs)``.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import remat_nn as rn
    >>> from remat_nn import nnx as rnnx
    >>> model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    >>> f = lambda m, x: jnp.sin(rn.name(m(x), "mlp_hidden"))
    >>> body = rnnx.remat(f, policy="save=mlp_hidden")
    >>> loss_fn, params = rnnx.pure(lambda m, x: jnp.sum(body(m, x)), model)
    >>> rn.memory_report(loss_fn, params, jnp.ones((2, 4))).by_name()["mlp_hidden"]["count"]
    1
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"nnx.pure: argument `module` must be an nnx.Module, got {type(module).__name__}. "
            "Fix: rnnx.pure(loss_fn, model) with model an nnx.Module instance."
        )
    if not callable(fn):
        raise TypeError(
            f"nnx.pure: argument `fn` must be a function fn(module, *args), got "
            f"{type(fn).__name__} {fn!r}. Fix: rnnx.pure(lambda m, x: loss(m(x)), model)."
        )
    graphdef, state, rest = nnx.split(module, wrt, ...)

    @functools.wraps(fn)
    def pure_fn(state: nnx.State, *args: Any, **kwargs: Any) -> Any:
        return fn(nnx.merge(graphdef, state, rest, copy=True), *args, **kwargs)

    return pure_fn, state
