"""The tiny models the trainer tests register, each under its own name, and their options.

One place for them, so the test process (a module-scoped fixture, :func:`registered`) and a child
``python -m train`` (``launch(register="tests.train.tiny_models:register_<name>")``) register the
same model. Each is registered only while the tests that use it run, so registry-wide tests
elsewhere never see it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import flax.linen as fnn
import jax.numpy as jnp
import pydantic

import models

TRAIN_MLP = "tiny_mlp_for_train_tests"
DENSE = "tiny_dense_for_feature_tests"
FAULT_MLP = "tiny_mlp_for_fault_tests"


class TinyOptions(pydantic.BaseModel):
    """``model.options`` of a tiny test MLP: classes out, hidden width."""

    model_config = pydantic.ConfigDict(extra="forbid")
    num_classes: int = 10
    width: int = 16


class FaultOptions(TinyOptions):
    """The fault tests' MLP also takes a depth and a parameter dtype."""

    depth: int = 1
    param_dtype: str = "float32"


def _uniform():
    # Uniform init: cheap to compile on CPU.
    return fnn.initializers.variance_scaling(1.0, "fan_in", "uniform")


class TinyMLP(fnn.Module):
    """BatchNorm and dropout, so batch stats and the rng are part of what must resume exactly."""

    num_classes: int = 10
    width: int = 16

    @fnn.compact
    def __call__(self, x, train: bool = False):
        # x (B, H, W, C) -> logits (B, K)
        h = fnn.Dense(self.width, kernel_init=_uniform())(x.reshape(x.shape[0], -1))
        h = fnn.BatchNorm(use_running_average=not train)(h)
        h = fnn.Dropout(0.1, deterministic=not train)(fnn.relu(h))
        return fnn.Dense(self.num_classes, kernel_init=_uniform())(h)


class TinyDense(fnn.Module):
    """No BatchNorm, no dropout: an example's output depends on that example only, so
    accumulating micro-batches is exactly one large batch."""

    num_classes: int = 10
    width: int = 16

    @fnn.compact
    def __call__(self, x, train: bool = False):
        # x (B, H, W, C) -> logits (B, K)
        h = fnn.relu(fnn.Dense(self.width)(x.reshape(x.shape[0], -1)))
        return fnn.Dense(self.num_classes)(h)


class FaultMLP(fnn.Module):
    """``depth`` hidden layers (a larger checkpoint when asked) in ``param_dtype``, and dropout."""

    num_classes: int = 10
    width: int = 16
    depth: int = 1
    param_dtype: str = "float32"

    @fnn.compact
    def __call__(self, x, train: bool = False):
        # x (B, H, W, C) -> logits (B, K)
        dtype = jnp.dtype(self.param_dtype)
        dense = lambda n: fnn.Dense(n, kernel_init=_uniform(), param_dtype=dtype)
        h = x.reshape(x.shape[0], -1)
        for _ in range(self.depth):
            h = fnn.relu(dense(self.width)(h))
        h = fnn.Dropout(0.1, deterministic=not train)(h)
        return dense(self.num_classes)(h).astype(jnp.float32)


_SPECS = {
    TRAIN_MLP: (TinyMLP, TinyOptions),
    DENSE: (TinyDense, TinyOptions),
    FAULT_MLP: (FaultMLP, FaultOptions),
}


def register(name: str) -> None:
    """Registers the tiny model ``name`` (one of this module's names) if it is not yet."""
    if name not in models.REGISTRY:
        build, options = _SPECS[name]
        spec = models.ModelSpec(build=build, options=options, task="classify", doc="tests")
        models.register(name, spec)


@contextlib.contextmanager
def registered(name: str) -> Iterator[str]:
    """``name`` registered for the duration of the block, then removed from the registry."""
    register(name)
    try:
        yield name
    finally:
        models.REGISTRY.pop(name, None)


# For a child process: ``launch(register="tests.train.tiny_models:register_train_mlp")``.
def register_train_mlp() -> None:
    register(TRAIN_MLP)


def register_fault_mlp() -> None:
    register(FAULT_MLP)
