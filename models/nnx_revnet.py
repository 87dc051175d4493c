"""A small reversible network written in Flax NNX, trained by the linen trainer through the bridge.

``NNXRevNet`` is an ``nnx.Module``: a stem convolution, two reversible stages
(:class:`remat_nn.nnx.ReversibleSequence` of :class:`remat_nn.nnx.AdditiveCoupling`, F and G
each BatchNorm -> ReLU -> 3x3 convolution), a strided downsampling unit between them (not
invertible: convolution -> BatchNorm -> ReLU, the convolution's output named ``conv_out``; it
keeps its input and, under a remat plan, recomputes through :func:`remat_nn.nnx.remat`), then
BatchNorm, ReLU, global average pooling and a linear head. The registry entry ``nnx_revnet``
wraps it with ``flax.nnx.bridge.to_linen`` so ``python -m train`` initializes and applies it like
any linen model: parameters under ``params``, BatchNorm averages under ``batch_stats``, the
``dropout`` key of the step handed to the NNX module's ``nnx.Rngs``.

Shape legend: B batch, H = W image size, C channels (``width``).

References:
  Gomez et al. (2017). The Reversible Residual Network: Backpropagation Without Storing
  Activations. NeurIPS. https://arxiv.org/abs/1707.04585
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx

import remat_nn as rn
from models._cifar import NAMES, REMAT_PRESETS
from models._spec import ModelSpec, remat_option
from remat_nn import names
from remat_nn import nnx as rnnx

__all__ = ["NNXRevNet", "NNXRevNetOptions", "build"]


class _BNReLUConv(nnx.Module):
    """F or G of a coupling: BatchNorm -> ReLU -> 3x3 convolution, channels kept."""

    def __init__(self, channels: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.bn = nnx.BatchNorm(channels, momentum=0.9, dtype=dtype, rngs=rngs)
        self.conv = nnx.Conv(channels, channels, (3, 3), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        return self.conv(jax.nn.relu(self.bn(x, use_running_average=not train)))


class _Down(nnx.Module):
    """The non-invertible unit between stages: strided 3x3 convolution -> BatchNorm -> ReLU."""

    def __init__(self, cin: int, cout: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(cin, cout, (3, 3), strides=2, dtype=dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(cout, momentum=0.9, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        h = rn.name(self.conv(x), names.CONV_OUT)  # (B, H / 2, W / 2, cout)
        return jax.nn.relu(self.bn(h, use_running_average=not train))


class NNXRevNet(nnx.Module):
    """Stem, reversible stage, downsampling unit, reversible stage, head; all NNX.

    Args:
      width: channels of the first stage (even: couplings split them in halves); the second
        stage has ``2 * width``.
      depth: couplings per reversible stage.
      num_classes: outputs of the head.
      in_channels: channels of the input images.
      reversible: ``False``: the same network with plain autodiff through the stages.
      remat: the downsampling unit's plan (a ``remat_nn.Plan``; None: no remat).
      dtype: compute dtype (parameters stay float32).
      rngs: ``nnx.Rngs`` for the parameters.
    """

    def __init__(
        self,
        *,
        width: int = 16,
        depth: int = 3,
        num_classes: int = 10,
        in_channels: int = 1,
        reversible: bool = True,
        remat: rn.Plan | None = None,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        def stage(channels: int) -> rnnx.ReversibleSequence:
            half = channels // 2

            def coupling(rngs: nnx.Rngs) -> rnnx.AdditiveCoupling:
                return rnnx.AdditiveCoupling(
                    _BNReLUConv(half, dtype=dtype, rngs=rngs),
                    _BNReLUConv(half, dtype=dtype, rngs=rngs),
                )

            return rnnx.ReversibleSequence(coupling, depth, reversible=reversible, rngs=rngs)

        self.stem = nnx.Conv(in_channels, width, (3, 3), dtype=dtype, rngs=rngs)
        self.stage1 = stage(width)
        self.down = _Down(width, 2 * width, dtype=dtype, rngs=rngs)
        self.stage2 = stage(2 * width)
        self.norm = nnx.BatchNorm(2 * width, momentum=0.9, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(2 * width, num_classes, rngs=rngs)
        self.remat = remat

    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        h = self.stage1(self.stem(x), train=train)  # (B, H, W, C), halves split on channels
        down = _Down.__call__
        if self.remat is not None:
            down = rnnx.remat(down, policy=self.remat, static_argnums=(2,))
        h = self.stage2(down(self.down, h, train), train=train)  # (B, H / 2, W / 2, 2C)
        h = jax.nn.relu(self.norm(h, use_running_average=not train))
        return self.head(h.mean(axis=(1, 2)).astype(jnp.float32))  # (B, num_classes)


# --- registry ---------------------------------------------------------------------------------


class NNXRevNetOptions(pydantic.BaseModel):
    """Options of ``nnx_revnet`` (unknown keys rejected)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    width: pydantic.PositiveInt = pydantic.Field(16, description="channels of stage 1 (even)")
    depth: pydantic.PositiveInt = pydantic.Field(3, description="couplings per stage")
    num_classes: pydantic.PositiveInt = 10
    image_size: pydantic.PositiveInt = pydantic.Field(8, description="H = W of the input")
    in_channels: pydantic.PositiveInt = 1
    reversible: bool = True
    dtype: Literal["float32", "bfloat16"] = "float32"
    remat: str | dict[str, Any] | pydantic.InstanceOf[rn.Plan] | None = pydantic.Field(
        None,
        description=f"the downsampling unit's plan: a preset ({', '.join(REMAT_PRESETS)}), a "
        "per-name plan on conv_out or a remat_nn.Plan; null: full",
    )

    @pydantic.field_validator("width")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError(
                f"nnx_revnet: width={v} must be even (couplings split the channels in halves). "
                f"Fix: width={v + 1}."
            )
        return v

    @pydantic.field_validator("remat", mode="before")
    @classmethod
    def _remat(cls, v: Any) -> Any:
        # Resolved here, once: the Plan, or "none" for no remat (None: the default, full).
        if v is None:
            return None
        plan = remat_option(v, presets=REMAT_PRESETS, model="nnx_revnet", names=NAMES)
        return "none" if plan is None else plan


def build(
    *,
    width: int = 16,
    depth: int = 3,
    num_classes: int = 10,
    in_channels: int = 1,
    reversible: bool = True,
    dtype: str = "float32",
    remat: str | Mapping[str, Any] | rn.Plan | None = None,
    **_: Any,
) -> Any:
    """``NNXRevNet`` as a linen module (``flax.nnx.bridge.to_linen``), what the trainer takes.

    ``remat`` unset: ``full`` (the downsampling unit keeps only its input).

    >>> import functools, jax, jax.numpy as jnp
    >>> model = build(width=4, depth=1)
    >>> init = functools.partial(model.init, train=False)  # shapes only: nothing compiled
    >>> variables = jax.eval_shape(init, jax.random.key(0), jnp.zeros((2, 8, 8, 1)))
    >>> sorted(variables), variables["params"]["stage1"]["layers"]["f"]["conv"]["kernel"].shape
    (['batch_stats', 'params'], (1, 3, 3, 2, 2))
    """
    plan = remat_option(
        "full" if remat is None else remat, presets=REMAT_PRESETS, model="nnx_revnet", names=NAMES
    )
    return nnx.bridge.to_linen(
        NNXRevNet,
        width=width,
        depth=depth,
        num_classes=num_classes,
        in_channels=in_channels,
        reversible=reversible,
        remat=plan,
        dtype=jnp.dtype(dtype),
    )


#: The registry's entries of this file (registered at the first models.get).
SPECS: dict[str, ModelSpec] = {
    "nnx_revnet": ModelSpec(
        build,
        NNXRevNetOptions,
        "classify",
        "a small RevNet written in Flax NNX (remat_nn.nnx), trained through nnx.bridge.to_linen",
        REMAT_PRESETS,
    ),
}
