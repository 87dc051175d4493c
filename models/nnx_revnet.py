"""A small reversible network written in Flax NNX, trained by the linen trainer through the bridge.

``NNXRevNet`` is an ``nnx.Module``: a stem convolution, two reversible stages
(:class:`remat_nn.nnx.ReversibleSequence` of :class:`remat_nn.nnx.AdditiveCoupling`, F and G
each BatchNorm -> ReLU -> 3x3 convolution), a strided downsampling unit between them (not
invertible: convolution -> BatchNorm -> ReLU, the convolution's output named ``conv_out``; it
keeps its input and, under a remat plan, recomputes through :func:`remat_nn.nnx.remat`), then
BatchNorm, ReLU, global average pooling and a linear head. The registry entry ``nnx_revnet``
wraps it with ``flax.nnx.bridge.to_linen`` so ``python -m train`` initializes and applies it like
any linen model: parameters under ``params``, BatchNorm averages under ``batch_stats``, the
``dropout`` key of the step handed to the NNX module's ``nnx.Rngs``. :func:`stage_stacks` gives it
as stem, stages and head for ``train.update_in_backward`` (:func:`remat_nn.fused_update_stages`).

Shape legend: B batch, H = W image size, C channels (``width``).

References:
  Gomez et al. (2017). The Reversible Residual Network: Backpropagation Without Storing
  Activations. NeurIPS. https://arxiv.org/abs/1707.04585
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx

import remat_nn as rn
from models._cifar import NAMES, REMAT_PRESETS, _policy
from models._spec import ModelSpec, StageStacks, at_least_float32, coupling_stage, remat_option
from remat_nn import names
from remat_nn import nnx as rnnx

__all__ = ["NNXRevNet", "NNXRevNetOptions", "build", "stage_stacks"]


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
      drift_fallback: ``fallback`` of the reversible stages (``rnnx.ReversibleSequence``): a
        coupling whose rebuilt input drifted past its measured tolerance raises (``"error"``),
        is recomputed (``"recompute"``, more temporary memory) or is not checked (``"none"``).
      remat: the downsampling unit's plan (a ``remat_nn.Plan`` or a remat_nn policy name;
        None: no remat).
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
        remat: rn.Plan | str | None = None,
        dtype: Any = jnp.float32,
        drift_fallback: str = "error",
        rngs: nnx.Rngs,
    ) -> None:
        def stage(channels: int) -> rnnx.ReversibleSequence:
            half = channels // 2

            def coupling(rngs: nnx.Rngs) -> rnnx.AdditiveCoupling:
                return rnnx.AdditiveCoupling(
                    _BNReLUConv(half, dtype=dtype, rngs=rngs),
                    _BNReLUConv(half, dtype=dtype, rngs=rngs),
                )

            return rnnx.ReversibleSequence(
                coupling, depth, reversible=reversible, fallback=drift_fallback, rngs=rngs
            )

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
        return _classify(self.norm, self.head, h, train)


def _classify(norm: nnx.BatchNorm, head: nnx.Linear, h: jax.Array, train: bool) -> jax.Array:
    """The head: BatchNorm, ReLU, global average pooling, then the linear layer in at least
    float32."""
    h = jax.nn.relu(norm(h, use_running_average=not train))  # (B, H, W, C)
    return head(h.mean(axis=(1, 2)).astype(at_least_float32(h.dtype)))  # (B, num_classes)


# --- the stages as stacks, for the optimizer update inside the backward pass ---------------------


def stage_stacks(module: nnx.bridge.ToLinen) -> StageStacks:
    """The NNX RevNet as stem, stages (downsampling unit, stack of couplings) and head.

    The same computation as ``module.apply(variables, images, train=True,
    mutable=["batch_stats"])`` on the bridge's variables (each stack's at
    ``params["stage1"]["layers"]``, stacked on a leading layer axis by ``nnx.vmap``), for
    :func:`remat_nn.fused_update_stages`: the stem, then per stage the downsampling unit
    (stage 2) under the model's remat plan and the stack of couplings, each layer run by
    :func:`remat_nn.nnx.coupling_layer` (the sequence's own block) and its input rebuilt from
    its output by the coupling's fused inverse and VJP (saved instead with
    ``reversible=False``); then the head. Each part is the model's own submodule, merged
    (``nnx.merge``) with its slice of the variables; the residual stream between the parts is
    the pair of channel halves.

    >>> m = build(width=4, depth=2)
    >>> x = jnp.ones((2, 8, 8, 1))
    >>> v = m.init(jax.random.key(0), x)
    >>> logits, stats = stage_stacks(m).apply(v["params"], v["batch_stats"], x)
    >>> want, new = m.apply(v, x, train=True, mutable=["batch_stats"])
    >>> bool(jnp.allclose(logits, want, atol=1e-6)), jax.tree.structure(stats) == (
    ...     jax.tree.structure(new["batch_stats"]))
    (True, True)
    """
    if not isinstance(module, nnx.bridge.ToLinen) or module.nnx_class is not NNXRevNet:
        raise TypeError(
            f"nnx_revnet.stage_stacks: `module` must be the model nnx_revnet.build returns (an "
            f"NNXRevNet under nnx.bridge.to_linen), got {type(module).__name__}. Fix: "
            "stage_stacks(nnx_revnet.build(...))."
        )
    # Structure only: the submodules' graph definitions and static attributes, no arrays.
    model = nnx.eval_shape(lambda: NNXRevNet(*module.args, **module.kwargs, rngs=nnx.Rngs(0)))
    stem, norm, head = (nnx.graphdef(getattr(model, k)) for k in ("stem", "norm", "head"))

    def embed(rest: Any, stats: Any, images: jax.Array) -> tuple[Any, Any]:
        return _pair(nnx.merge(stem, rest["stem"])(images)), stats

    def classify(rest: Any, stats: Any, h: Any) -> tuple[jax.Array, Any]:
        unit = nnx.merge(norm, rest["norm"], stats["norm"])
        logits = _classify(unit, nnx.merge(head, rest["head"]), _merged(h), True)
        return logits, {**stats, "norm": _stats(unit)}

    down = rn.checkpoint(partial(_down, nnx.graphdef(model.down)), policy=_policy(model.remat))
    stage1 = _coupling_stage(model.stage1, "stage1")
    return StageStacks(embed, (stage1, _coupling_stage(model.stage2, "stage2", down)), classify)


def _pair(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    x1, x2 = jnp.split(x, 2, axis=-1)  # (B, H, W, C/2) each, as the sequence splits it
    return x1, x2


def _merged(h: tuple[jax.Array, jax.Array]) -> jax.Array:
    return jnp.concatenate(h, axis=-1)  # (B, H, W, C)


def _stats(unit: nnx.Module) -> Any:
    """A unit's variables but its parameters (BatchNorm's averages), as the bridge stores them."""
    return nnx.to_pure_dict(nnx.state(unit, nnx.Not(nnx.Param)))


def _down(graphdef: nnx.GraphDef, rest: Any, stats: Any, h: Any) -> tuple[Any, Any]:
    """The downsampling unit on the stream ``h``, its batch statistics updated in ``stats``."""
    unit = nnx.merge(graphdef, rest["down"], stats["down"])
    y = unit(_merged(h), True)  # (B, H / 2, W / 2, 2C)
    return _pair(y), {**stats, "down": _stats(unit)}


def _coupling_stage(
    sequence: rnnx.ReversibleSequence, key: str, before: Any = None
) -> rn.FusedStage:
    """A stage's stack of couplings as its ``ReversibleSequence`` runs them, in training mode."""
    block = rnnx.coupling_layer(sequence, train=True)
    return coupling_stage(
        key, block, reversible=sequence.reversible, before=before, fallback=sequence.fallback
    )


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
    drift_fallback: Literal["error", "recompute", "none"] = pydantic.Field(
        "error",
        description="a coupling whose input, rebuilt in the backward pass, drifted past its "
        "measured tolerance: error (stop the step: NotInvertibleError), recompute (from the "
        "stage's kept input; more temporary memory) or none (no check)",
    )
    remat: str | dict[str, Any] | pydantic.InstanceOf[rn.Plan] | None = pydantic.Field(
        None,
        validate_default=True,
        description=f"the downsampling unit's plan: a preset ({', '.join(REMAT_PRESETS)}), a "
        "remat_nn policy name, a per-name plan on conv_out or a remat_nn.Plan; null: full",
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
        # Resolved here, once, the default (full) too: the validated options name the plan the
        # model runs (the Plan or policy name, or "none" for no remat).
        plan = remat_option(_or_default(v), presets=REMAT_PRESETS, model="nnx_revnet", names=NAMES)
        return "none" if plan is None else plan


def _or_default(remat: Any) -> Any:
    # Unset: recompute the downsampling unit (it keeps only its input).
    return "full" if remat is None else remat


def build(
    *,
    width: int = 16,
    depth: int = 3,
    num_classes: int = 10,
    in_channels: int = 1,
    reversible: bool = True,
    dtype: str = "float32",
    drift_fallback: str = "error",
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
    plan = remat_option(_or_default(remat), presets=REMAT_PRESETS, model="nnx_revnet", names=NAMES)
    return nnx.bridge.to_linen(
        NNXRevNet,
        width=width,
        depth=depth,
        num_classes=num_classes,
        in_channels=in_channels,
        reversible=reversible,
        remat=plan,
        dtype=jnp.dtype(dtype),
        drift_fallback=drift_fallback,
    )


#: The registry's entries of this file (registered at the first models.get).
SPECS: dict[str, ModelSpec] = {
    "nnx_revnet": ModelSpec(
        build,
        NNXRevNetOptions,
        "classify",
        "a small RevNet written in Flax NNX (remat_nn.nnx), trained through nnx.bridge.to_linen",
        REMAT_PRESETS,
        stage_stacks=stage_stacks,
    ),
}
