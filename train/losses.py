"""The loss a run trains with (``model.loss``) and the metrics it reports.

A loss function is ``loss(outputs, targets) -> (losses, metrics)``: ``outputs`` the model's
output for a batch in at least float32 (:func:`at_least_float32`), ``targets`` the batch's
``y``; ``losses`` the loss of each example (shape (B,), or (B, T) for token models),
``metrics`` a dict of arrays of that shape (e.g. 1.0 where a prediction is right). The trainer
minimises the mean loss, and logs each metric's mean, masked in evaluation like the loss
(``eval_<name>`` may rank checkpoints, see ``checkpoint.best_metric``). Built in:
``cross_entropy`` (integer targets, metric ``accuracy``; the default of classification and
language models) and ``mse`` (float targets shaped like the outputs, metric ``mae``; the
default of ``model.task: regress``); any other is ``package.module:function``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import models
from train.errors import SetupError

__all__ = ["LOSSES", "LossFn", "at_least_float32", "cross_entropy", "mse", "resolve"]

LossFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def at_least_float32(outputs: jax.Array) -> jax.Array:
    """``outputs`` as the loss takes them, in the models' rule (:func:`models.at_least_float32`):
    bfloat16 and float16 widened to float32, float32 and float64 as they are (a float64 run
    keeps float64 down to its loss).

    >>> at_least_float32(jnp.ones(2, jnp.bfloat16)).dtype, at_least_float32(jnp.ones(2)).dtype
    (dtype('float32'), dtype('float32'))
    """
    return outputs.astype(models.at_least_float32(outputs.dtype))


def cross_entropy(outputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Softmax cross-entropy of logits (..., K) against integer targets (...); metric accuracy.

    >>> losses, m = cross_entropy(jnp.array([[9.0, 0.0], [9.0, 0.0]]), jnp.array([0, 1]))
    >>> m["accuracy"].tolist()
    [1.0, 0.0]
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
    correct = (jnp.argmax(outputs, -1) == targets).astype(jnp.float32)
    return losses, {"accuracy": correct}


def mse(outputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Squared error of outputs (B, ...) against targets of that shape, averaged over each
    example's values; metric mae (mean absolute error).

    >>> losses, m = mse(jnp.array([[1.0, 3.0]]), jnp.array([[0.0, 0.0]]))
    >>> losses.tolist(), m["mae"].tolist()
    ([5.0], [2.0])
    """
    err = outputs - targets.astype(outputs.dtype).reshape(outputs.shape)
    axes = tuple(range(1, err.ndim))
    return jnp.mean(err**2, axis=axes), {"mae": jnp.mean(jnp.abs(err), axis=axes)}


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}


def resolve(name: str) -> LossFn:
    """The loss ``model.loss`` names: a built-in name or ``package.module:function``.

    Raises:
      SetupError: not a built-in, and not an importable module and function.
    """
    if name in LOSSES:
        return LOSSES[name]
    mod_name, colon, attr = name.partition(":")
    fix = (
        f"Fix: one of {sorted(LOSSES)} or 'package.module:function' (see README 'Train your model')"
    )
    if not colon:
        raise SetupError(f"model.loss={name!r} is not a built-in loss. {fix}.")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise SetupError(f"model.loss={name!r}: cannot load it ({e}). {fix}.") from None
    if not callable(fn):
        raise SetupError(f"model.loss={name!r} is a {type(fn).__name__}, not a function. {fix}.")
    return fn
