"""``nn.remat_scan``: a flax.linen layer stack under :func:`remat_nn.remat_scan`, with its
parameters stacked exactly as ``flax.linen.scan`` stacks them.

``nn.remat_scan(Block, length=n, ...)`` is a drop-in for ``flax.linen.scan(Block,
variable_axes={"params": 0}, split_rngs={"params": True}, length=n)``: the same constructor
fields, the same call ``(carry, *xs) -> (carry, ys)``, and the same parameter tree (every leaf
with a leading axis of ``n``), so a checkpoint moves between the two. ``init`` runs that very
``flax.linen.scan`` (the same initial values); ``apply`` runs the nested checkpointed scan over
the stacked parameters. Unlike ``flax.linen.remat_scan``, whose parameters are nested
``(n_0, n_1, ..., *shape)`` and whose lengths must multiply to the depth, any depth works and the
body takes a policy or a plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as fnn

from remat_nn._checkpoint import check_bool, check_policy
from remat_nn._remat_scan import remat_scan as rn_remat_scan

__all__ = ["remat_scan"]

WHERE = "nn.remat_scan"


def remat_scan(
    target: type[fnn.Module],
    *,
    length: int | None = None,
    levels: int | None = None,
    lengths: Sequence[int] | None = None,
    policy: Any = None,
    carry_policy: str | Sequence[str] = "recompute",
    reverse: bool = False,
    unroll: int | bool = 1,
) -> type[fnn.Module]:
    """Repeats ``target`` as a nested checkpointed scan, its parameters stacked as ``nn.scan``'s.

    Args:
      target: a ``flax.linen.Module`` subclass whose ``__call__(carry, *xs)`` returns
        ``(carry, y)``; its only variables are ``params`` (no BatchNorm statistics, no random
        numbers in ``apply``: use ``flax.linen.scan`` for those).
      length: the number of layers, needed when the call scans over no ``xs`` (as in
        ``flax.linen.scan``).
      levels, lengths, policy, carry_policy, reverse, unroll: as :func:`remat_nn.remat_scan`.

    Returns:
      A Module class with ``target``'s fields, called as ``(carry, *xs) -> (carry, ys)``.

    >>> import jax, jax.numpy as jnp, flax.linen as fnn
    >>> from remat_nn import nn
    >>> class Layer(fnn.Module):
    ...     @fnn.compact
    ...     def __call__(self, h):
    ...         return jnp.tanh(fnn.Dense(4)(h)), None
    >>> Stack = nn.remat_scan(Layer, length=10, levels=2)
    >>> Scanned = fnn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
    ...                    length=10)
    >>> x = jnp.ones((2, 4))
    >>> variables = Scanned().init(jax.random.key(0), x)  # a checkpoint of the plain scan
    >>> jax.tree.map(jnp.shape, variables["params"]["Dense_0"])
    {'bias': (10, 4), 'kernel': (10, 4, 4)}
    >>> import remat_nn as rn
    >>> rn.relative_error(Stack().apply(variables, x)[0], Scanned().apply(variables, x)[0]) < 1e-6
    True
    """
    if not (isinstance(target, type) and issubclass(target, fnn.Module)):
        raise TypeError(
            f"{WHERE}: argument `target` must be a flax.linen.Module subclass (the class, not an "
            f"instance), got {type(target).__name__} {target!r}. "
            f"Fix: {WHERE}(MyBlock, length=12)."
        )
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
        raise TypeError(
            f"{WHERE}: argument `length` must be an int or None, got {type(length).__name__} "
            f"{length!r}. Fix: {WHERE}(MyBlock, length=12)."
        )
    check_policy(policy, WHERE)
    check_bool(reverse, "reverse", WHERE)
    scanned = fnn.scan(
        target,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=length,
        reverse=reverse,
        unroll=unroll,
    )
    fields = [
        f.name for f in dataclasses.fields(target) if f.init and f.name not in ("parent", "name")
    ]

    def __call__(self: Any, carry: Any, *xs: Any) -> Any:
        if self.is_initializing():  # flax.linen.scan's own init: the same parameters and values
            return scanned.__call__(self, carry, *xs)
        extra = sorted(set(self.variables) - {"params"})
        if extra:
            raise ValueError(
                f"{WHERE}({target.__name__}): the layer holds variable collections {extra} "
                "besides 'params'; only parameters are scanned here. Fix: use "
                "flax.linen.scan for layers with state (e.g. BatchNorm statistics)."
            )
        layer = target(**{f: getattr(self, f) for f in fields}, parent=None)

        def body(h: Any, step: tuple[Any, tuple[Any, ...]]) -> Any:
            params, x = step
            return layer.apply({"params": params}, h, *x)

        params = self.variables.get("params", {})
        return rn_remat_scan(
            body,
            carry,
            (params, xs),
            length=length,
            reverse=reverse,
            unroll=unroll,
            levels=levels,
            lengths=lengths,
            policy=policy,
            carry_policy=carry_policy,
        )

    # flax.linen.scan's class name, so auto-named instances ("ScanBlock_0") get the same
    # parameter paths with either transform.
    attrs = {"__call__": __call__, "__module__": __name__, "__qualname__": scanned.__qualname__}
    return type(scanned.__name__, (scanned,), attrs)
