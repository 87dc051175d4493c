"""Workloads the benchmarks share: models from the registry with their losses, one compile that
gives both XLA's memory analysis and the executable, and this machine's matmul speed."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import models
import remat_nn as rn
from models import transformer as tf


def compile_step(
    fn: Callable[..., Any], *args: Any, **jit_kwargs: Any
) -> tuple[Any, rn.CompiledMemory]:
    """Compiles ``jax.jit(fn, **jit_kwargs)`` once: the executable and XLA's memory analysis.

    The same numbers as :func:`remat_nn.compiled_memory`, without compiling a second time to
    run the step (compiles take tens of seconds for the deep CIFAR networks on CPU).
    """
    compiled = jax.jit(fn, **jit_kwargs).lower(*args).compile()
    m = compiled.memory_analysis()
    memory = rn.CompiledMemory(
        temp_bytes=int(m.temp_size_in_bytes),
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        generated_code_bytes=int(m.generated_code_size_in_bytes),
    )
    return compiled, memory


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of ``tree``."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def matmul_fn(n: int) -> Callable[[], jax.Array]:
    """A dense float32 ``(n, n) @ (n, n)`` on the default device, compiled and warmed up: the
    reference the efficiency benchmark times in the same rounds as the steps it rates."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    return functools.partial(f, a)


def matmul_flops(n: int) -> int:
    """FLOPs of :func:`matmul_fn` (2 x multiply-adds)."""
    return 2 * n**3


# --- CIFAR classifiers -------------------------------------------------------------------------


@dataclass
class Classifier:
    """A registry image classifier in training mode with its grad step inputs."""

    name: str
    module: Any
    params: Any
    batch_stats: Any
    images: jax.Array  # (B, H, W, 3)
    labels: jax.Array  # (B,)

    def loss(self, params: Any, batch_stats: Any, images: jax.Array, labels: jax.Array):
        """Cross-entropy with BatchNorm in training mode; returns (loss, new batch_stats)."""
        logits, updates = self.module.apply(
            {"params": params, "batch_stats": batch_stats},
            images,
            train=True,
            mutable=["batch_stats"],
        )
        return cross_entropy(logits, labels), updates

    @property
    def grad_step(self) -> Callable[..., Any]:
        """``(params, batch_stats, images, labels) -> (grads, new batch_stats)``."""
        return jax.grad(self.loss, has_aux=True)

    @property
    def args(self) -> tuple[Any, ...]:
        return self.params, self.batch_stats, self.images, self.labels


def fake_init(abstract: Any, seed: int = 0) -> Any:
    """Random variables of the shapes in ``abstract`` without compiling ``module.init``.

    Compiling the init of a deep unrolled network takes longer than its grad step; the
    benchmarks need values of the right scale, not flax's exact initializers: He-normal kernels,
    unit BatchNorm scales and variances, zero biases and means.
    """
    # Drawn on the host with numpy: op-by-op jax.random would compile a kernel per shape.
    leaves, tree = jax.tree_util.tree_flatten_with_path(abstract)
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf in leaves:
        name = str(getattr(path[-1], "key", path[-1]))
        if name in ("scale", "var"):
            value = np.ones(leaf.shape)
        elif name in ("bias", "mean"):
            value = np.zeros(leaf.shape)
        else:
            fan_in = math.prod(leaf.shape[:-1][-3:]) or 1
            value = rng.standard_normal(leaf.shape) * (2 / fan_in) ** 0.5
        out.append(jnp.asarray(value, leaf.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


def classifier(
    name: str, *, batch: int, image_size: int = 32, module: Any = None, materialize: bool = True
) -> Classifier:
    """A registry model (``resnet32``, ``revnet164``, ...) at ``batch`` x ``image_size``^2 x 3.

    ``materialize=False`` keeps everything abstract (memory analysis only, nothing runs; a step
    compiled for it runs on :func:`concrete` of it).
    """
    module = module if module is not None else models.build(name, image_size=image_size)
    images = jax.ShapeDtypeStruct((batch, image_size, image_size, 3), jnp.float32)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
    variables = jax.eval_shape(module.init, jax.random.key(0), images)
    model = Classifier(name, module, variables["params"], variables["batch_stats"], images, labels)
    return concrete(model) if materialize else model


def concrete(model: Classifier) -> Classifier:
    """An abstract ``model`` with values: :func:`fake_init` variables and random inputs (fixed
    seeds, so the same shapes get the same values)."""
    variables = fake_init({"params": model.params, "batch_stats": model.batch_stats})
    rng = np.random.default_rng(1)
    images = jnp.asarray(rng.uniform(size=model.images.shape), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, model.labels.shape), jnp.int32)
    return dataclasses.replace(
        model,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        images=images,
        labels=labels,
    )


# --- the scanned transformer -------------------------------------------------------------------


@dataclass(frozen=True)
class LMConfig:
    """The scanned transformer of the transformer / planner / efficiency benchmarks."""

    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    batch: int
    vocab_size: int = 256

    def options(self) -> dict[str, int]:
        """The transformer's options of this size (``models.build("transformer", **...)``)."""
        return dict(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            max_len=self.seq_len,
        )

    def __str__(self) -> str:
        return (
            f"{self.n_layers} layers, d_model {self.d_model}, {self.n_heads} heads, "
            f"d_ff {4 * self.d_model}, T {self.seq_len}, batch {self.batch}, vocab "
            f"{self.vocab_size}, float32, scan over layers"
        )


LM_FULL = LMConfig(n_layers=4, d_model=256, n_heads=4, seq_len=256, batch=8)
LM_QUICK = LMConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16, batch=2)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits`` (B, classes) against integer ``labels`` (B,)."""
    logp = jax.nn.log_softmax(logits)  # (B, classes)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits`` (B, T, V), computed from ``tokens[:, :-1]``, against
    the next tokens ``tokens[:, 1:]``."""
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@dataclass
class LM:
    """The transformer with a loss that takes its remat plan as ``policy=``."""

    config: LMConfig
    module: tf.Transformer
    params: Any
    tokens: jax.Array  # (B, T) int32

    def loss(self, params: Any, tokens: jax.Array, *, policy: Any = "none") -> jax.Array:
        """Next-token cross-entropy; ``policy`` is a preset name, a ``rn.Plan`` or ``"none"``.

        The form :func:`remat_nn.plan_for_budget` and :func:`remat_nn.compare_policies` call:
        the candidate plan becomes the model's own ``remat`` plan (its scan body's policy).
        """
        if isinstance(policy, str):
            policy = tf.remat_plan(policy)  # preset name; "none" -> None
        module = self.module.clone(remat=policy)
        return next_token_loss(module.apply({"params": params}, tokens[:, :-1]), tokens)

    def grad_step(self, policy: Any) -> Callable[[Any, jax.Array], Any]:
        """``(params, tokens) -> grads`` under ``policy``."""
        return jax.grad(functools.partial(self.loss, policy=policy))


@functools.cache
def _lm_module(config: LMConfig) -> tuple[tf.Transformer, Callable[..., Any]]:
    # One module and one jitted init per size: every benchmark that builds the model (and the
    # transformer, planner and efficiency benchmarks each build it more than once) compiles
    # its init once per process.
    module = models.build("transformer", **config.options(), remat="none")
    return module, jax.jit(module.init)


def lm_tokens(config: LMConfig) -> jax.Array:
    """The random tokens of :func:`lm`: ``(batch, seq_len + 1)`` int32, inputs the first T and
    targets the last T."""
    return jax.random.randint(
        jax.random.key(1), (config.batch, config.seq_len + 1), 0, config.vocab_size, jnp.int32
    )


def lm(config: LMConfig) -> LM:
    """Builds the transformer of ``config`` with initialized parameters and random tokens
    (fresh arrays at every call: a donated step may consume them)."""
    module, init = _lm_module(config)
    tokens = lm_tokens(config)
    params = init(jax.random.key(0), tokens[:, :-1])["params"]
    return LM(config, module, params, tokens)
