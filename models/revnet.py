"""Reversible residual networks (RevNet) for CIFAR-sized images.

RevNet (Gomez et al. 2017): the channels are split into halves (x1, x2) and each unit is an
additive coupling ``y1 = x1 + F(x2); y2 = x2 + G(y1)`` whose F and G are the pre-activation
residual functions of the ResNets (:class:`ResidualFn`) on half the channels, so inputs are
reconstructed from outputs and activations need not be stored. The units that change the
resolution or the width (the first of a stage) are not invertible and store their activations
in the paper (Section 3.2); here they are recomputed in the backward pass by default (``remat``,
:data:`REMAT_PRESETS`): stored, they would hold most of the step's memory at RevNet-164's size
(benchmarks/results/revnet.md). The architectures are in :data:`ARCHS` (:mod:`models._cifar`).

References:
  Gomez, Ren, Urtasun, Grosse 2017, "The Reversible Residual Network: Backpropagation Without
    Storing Activations", NeurIPS (Table 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, ClassVar, Literal

import flax.linen as fnn
import jax
import jax.numpy as jnp
import pydantic

import remat_nn as rn
from models._cifar import (
    ARCHS,
    NAMES,
    REMAT_PRESETS,
    Arch,
    ResidualFn,
    Shortcut,
    _conv,
    _Head,
    _ImageOptions,
    _plan,
    _policy,
    family_specs,
)
from models._spec import ModelSpec, StageStacks, coupling_stage
from remat_nn import nn as rnn

__all__ = [
    "ARCHS",
    "NAMES",
    "REMAT_PRESETS",
    "Arch",
    "ResidualFn",
    "RevNet",
    "RevNetOptions",
    "build_revnet",
    "stage_stacks",
]


class RevDownsample(fnn.Module):
    """The non-invertible first unit of a RevNet stage; stores its activations.

    ``y1 = shortcut(x1) + F(x2); y2 = shortcut(x2) + G(y1)`` where F changes the resolution
    and/or the width; the halves are concatenated on the channel axis.

    Attributes:
      features: output channels (both halves).
      strides: stride of F and of the shortcuts.
      bottleneck: bottleneck F and G, projection shortcuts.
      train: training mode.
      dtype: compute dtype.
    """

    features: int
    strides: int = 1
    bottleneck: bool = False
    train: bool = False
    dtype: Any = jnp.float32

    @fnn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        half = self.features // 2
        x1, x2 = jnp.split(x, 2, axis=-1)  # (B, H, W, C/2) each
        fn = lambda s, n: ResidualFn(half, s, self.bottleneck, self.train, self.dtype, name=n)
        short = lambda n: Shortcut(half, self.strides, self.bottleneck, self.dtype, name=n)
        y1 = short("shortcut1")(x1) + fn(self.strides, "f")(x2)  # (B, H', W', features/2)
        y2 = short("shortcut2")(x2) + fn(1, "g")(y1)  # (B, H', W', features/2)
        return jnp.concatenate([y1, y2], axis=-1)  # (B, H', W', features)


def _anchor(anchor_every: int | None, depth: int) -> int | None:
    """The largest divisor of ``depth`` not above ``anchor_every`` (reversible_scan needs one)."""
    if anchor_every is None:
        return None
    return max(d for d in range(1, min(anchor_every, depth) + 1) if depth % d == 0)


class RevNet(fnn.Module):
    """CIFAR RevNet: ``apply(variables, images (B, H, W, C), train=bool) -> logits``.

    Each stage is an optional non-reversible :class:`RevDownsample` unit followed by one
    ``nn.ReversibleSequence`` of ``nn.AdditiveCoupling(F, G)`` units (F, G: :class:`ResidualFn`
    on half the channels). In training mode BatchNorm uses batch statistics in the forward pass
    and the same statistics (recomputed from the reconstructed inputs) in the backward pass;
    the running averages are updated once, by the forward pass (``mutable=["batch_stats"]``).

    Attributes:
      arch: the :class:`Arch` (see :data:`ARCHS`).
      num_classes: classifier outputs.
      reversible: reconstruct activations in the backward pass; ``False`` is the same network
        (same variables) differentiated by plain autodiff, the gradient reference.
      anchor_every: store a unit's input at most every ``anchor_every`` reversible units of a
        stage (the largest divisor of the stage's depth not above it) to bound drift.
      dtype: compute dtype: every convolution, and BatchNorm's output (its statistics are
        float32); parameters and logits stay float32.
      recon_dtype: dtype of the reversible stages' residual stream ``(x1, x2)``: F and G compute
        in ``dtype`` and their outputs are added in ``recon_dtype``, so the backward's
        reconstruction ``x1 = y1 - F(x2)`` is float32 under bfloat16 compute and does not drift
        with depth (``bfloat16`` here is the drifting variant, for tests).
      remat: the plan of the non-reversible downsampling units (see :data:`REMAT_PRESETS`), or
        None: they store their activations, as in the paper. At RevNet-164's size they hold most
        of the step's memory, and ``full`` recomputes them in the backward pass from their
        inputs (the registry's default for ``reversible=True``; see :func:`build_revnet`).
        Reversible units reconstruct instead, and stem and head hold nothing across units
        (see :class:`models.resnet.ResNet`), so the plan applies to the downsampling units only.
      unroll: ``unroll`` of the reversible stages' scans (``nn.ReversibleSequence``); ``None``:
        its default for convolutional blocks (unrolled on CPU, a loop on GPU/TPU). Speed only.
      drift_fallback: ``fallback`` of the reversible stages (``nn.ReversibleSequence``): a unit
        whose rebuilt input drifted past its measured tolerance raises (``"error"``), is
        recomputed (``"recompute"``, more temporary memory) or is not checked (``"none"``).

    >>> import jax, jax.numpy as jnp
    >>> m = RevNet(ARCHS["revnet38"], num_classes=10)
    >>> x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    >>> v = jax.eval_shape(m.init, jax.random.key(0), x)   # shapes only: nothing runs
    >>> sorted(v["params"])
    ['head', 'stage0', 'stage1', 'stage1_down', 'stage2', 'stage2_down', 'stem']
    >>> from models.summary import count_params
    >>> count_params(v["params"])   # RevNet paper, Table 1: 0.46M
    464858
    >>> jax.eval_shape(m.apply, v, x).shape
    (2, 10)

    References:
      Gomez et al. 2017, "The Reversible Residual Network", Section 3 and Table 1.
    """

    arch: Arch
    num_classes: int = 10
    reversible: bool = True
    anchor_every: int | None = None
    dtype: Any = jnp.float32
    recon_dtype: Any = jnp.float32
    remat: rn.Plan | str | None = None
    drift_fallback: str = "error"
    unroll: int | bool | None = None

    @fnn.compact
    def __call__(self, images: jax.Array, *, train: bool = False) -> jax.Array:
        x = _conv(self.arch.stem, 3, 1, self.dtype, "stem")(images.astype(self.dtype))
        for s, (n, width) in enumerate(zip(self.arch.units, self.arch.widths, strict=True)):
            strides = 2 if s > 0 else 1
            if strides != 1 or x.shape[-1] != width:
                args = (width, strides, self.arch.bottleneck, train, self.dtype)
                # (B, H / 2^s, W / 2^s, width); activations stored, or recomputed under remat
                x = rnn.tied_remat(
                    self, RevDownsample, x, *args, policy=_policy(self.remat), name=f"stage{s}_down"
                )
                n -= 1
            if n == 0:
                continue
            f, g = (ResidualFn(width // 2, 1, self.arch.bottleneck, dtype=self.dtype) for _ in "fg")
            stack = rnn.ReversibleSequence(
                rnn.AdditiveCoupling(f, g),
                depth=n,
                anchor_every=_anchor(self.anchor_every, n),
                recon_dtype=self.recon_dtype,
                reversible=self.reversible,
                unroll=self.unroll,
                fallback=self.drift_fallback,
                name=f"stage{s}",
            )
            x = stack(x, train=train)  # (B, H / 2^s, W / 2^s, width), halves split on channels
        return _Head(self.num_classes, train, self.dtype, name="head")(x)


# --- the stages as stacks, for the optimizer update inside the backward pass ---------------------


def stage_stacks(module: RevNet) -> StageStacks:
    """The RevNet as stem, stages (downsampling unit, stack of couplings) and head.

    The same computation as ``module.apply(variables, images, train=True,
    mutable=["batch_stats"])``, for :func:`remat_nn.fused_update_stages`: the stacks at the
    stages' keys (``params["stage1"]["layers"]``), each downsampling unit under the model's
    remat plan, each coupling's input rebuilt from its output by the coupling's fused inverse
    and VJP (saved instead with ``reversible=False``). The residual stream between the parts
    is the pair of channel halves in ``recon_dtype``, as in ``nn.ReversibleSequence``; a
    stack's inputs are rebuilt from its output through all its layers (``anchor_every`` does
    not apply).

    Raises:
      ValueError: a stage holds its downsampling unit only (no stack).

    >>> m = RevNet(ARCHS["revnet38"].scaled(0.25), num_classes=3)
    >>> x = jnp.ones((2, 8, 8, 3))
    >>> v = m.init(jax.random.key(0), x)
    >>> logits, stats = stage_stacks(m).apply(v["params"], v["batch_stats"], x)
    >>> want, new = m.apply(v, x, train=True, mutable=["batch_stats"])
    >>> bool(jnp.allclose(logits, want, atol=1e-5)), jax.tree.structure(stats) == (
    ...     jax.tree.structure(new["batch_stats"]))
    (True, True)
    """
    o, arch = module, module.arch
    stream = o.dtype if o.recon_dtype is None else o.recon_dtype

    def pair(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x1, x2 = jnp.split(x, 2, axis=-1)  # (B, H, W, C/2) each
        return x1.astype(stream), x2.astype(stream)

    def merged(h: tuple[jax.Array, jax.Array]) -> jax.Array:
        return jnp.concatenate(h, axis=-1).astype(o.dtype)  # (B, H, W, C)

    def embed(rest: Any, stats: Any, images: jax.Array) -> tuple[Any, Any]:
        stem = _conv(arch.stem, 3, 1, o.dtype, "stem")
        return pair(stem.apply({"params": rest["stem"]}, images.astype(o.dtype))), stats

    def head(rest: Any, stats: Any, h: Any) -> tuple[jax.Array, Any]:
        unit = _Head(o.num_classes, True, o.dtype)
        variables = {"params": rest["head"], "batch_stats": stats["head"]}
        logits, new = unit.apply(variables, merged(h), mutable=["batch_stats"])
        return logits, {**stats, "head": new["batch_stats"]}

    stages, channels = [], arch.stem
    for s, (n, width) in enumerate(zip(arch.units, arch.widths, strict=True)):
        strides = 2 if s > 0 else 1
        before = None
        if strides != 1 or channels != width:
            unit = RevDownsample(width, strides, arch.bottleneck, True, o.dtype)
            before = rn.checkpoint(
                partial(_unit, unit, f"stage{s}_down", pair, merged), policy=_policy(o.remat)
            )
            n -= 1
        if n == 0:
            raise ValueError(
                f"revnet: stage {s} is its downsampling unit only, so it has no stack of layers "
                "for the optimizer update inside the backward pass. Fix: "
                "train.update_in_backward=false."
            )
        stages.append(_coupling_stage(o, f"stage{s}", width, before))
        channels = width
    return StageStacks(embed, tuple(stages), head)


def _unit(
    unit: fnn.Module, name: str, pair: Any, merged: Any, rest: Any, stats: Any, h: Any
) -> tuple[Any, Any]:
    """A downsampling unit on the stream ``h``, its batch statistics updated in ``stats``."""
    variables = {"params": rest[name], "batch_stats": stats[name]}
    y, new = unit.apply(variables, merged(h), mutable=["batch_stats"])
    return pair(y), {**stats, name: new["batch_stats"]}


def _coupling_stage(o: RevNet, key: str, width: int, before: Any) -> rn.FusedStage:
    """A stage's stack of couplings as ``nn.ReversibleSequence`` runs them, in training mode."""
    f, g = (ResidualFn(width // 2, 1, o.arch.bottleneck, dtype=o.dtype) for _ in "fg")
    compute_dtype = None if o.recon_dtype is None else o.dtype
    block = rnn.coupling_layer(
        rnn.AdditiveCoupling(f, g),
        compute_dtype=compute_dtype,
        state_collections=("batch_stats",),
        train=True,
    )
    return coupling_stage(
        key,
        block,
        reversible=o.reversible,
        before=before,
        collection="batch_stats",
        fallback=o.drift_fallback,
    )


# --- registry ---------------------------------------------------------------------------------


class RevNetOptions(_ImageOptions):
    """Options of the RevNets (unknown keys rejected)."""

    registered_name: ClassVar[str] = "revnet"
    depth: Literal[38, 110, 164] = 38
    reversible: bool = True
    anchor_every: pydantic.PositiveInt | None = None
    unroll: bool | pydantic.PositiveInt | None = pydantic.Field(
        None,
        description="unroll of the reversible stages' scans (true: no loop, n: n units per "
        "iteration); null: unrolled on CPU, a loop on GPU/TPU",
    )
    drift_fallback: Literal["error", "recompute", "none"] = pydantic.Field(
        "error",
        description="a reversible unit whose input, rebuilt in the backward pass, drifted past "
        "its measured tolerance: error (stop the step: NotInvertibleError), recompute (from the "
        "nearest kept input; the compiled backward holds more temporary memory) or "
        "none (no check)",
    )

    def default_remat(self) -> str:
        return _default_remat(self.reversible)


def _default_remat(reversible: bool) -> str:
    return "full" if reversible else "none"


def build_revnet(
    *,
    depth: int = 38,
    width: float = 1.0,
    num_classes: int = 10,
    dtype: str = "float32",
    reversible: bool = True,
    anchor_every: int | None = None,
    remat: str | Mapping[str, Any] | rn.Plan | None = None,
    unroll: int | bool | None = None,
    drift_fallback: str = "error",
    **_: Any,
) -> RevNet:
    """Builds RevNet-``depth`` (38, 110 or 164); see :class:`RevNet` for the options.

    ``remat`` (the downsampling units' plan) unset: ``full`` with ``reversible=True`` (a RevNet
    is trained for its memory, and the three stored downsampling units would hold most of it at
    RevNet-164's size (benchmarks/results/revnet.md), and recomputing them costs one more
    forward pass of those 2 or 3 units per step), ``none`` with ``reversible=False`` (the
    plain-autodiff reference keeps everything). ``remat=none`` is the paper's RevNet,
    downsampling activations stored.

    >>> build_revnet(depth=110).arch.widths
    (32, 64, 128)
    >>> str(build_revnet().remat), build_revnet(reversible=False).remat
    ('default=recompute', None)
    """
    arch = ARCHS[f"revnet{depth}"].scaled(width)
    return RevNet(
        arch,
        num_classes=num_classes,
        reversible=reversible,
        anchor_every=anchor_every,
        dtype=jnp.dtype(dtype),
        remat=_plan(remat, _default_remat(reversible), f"revnet{depth}"),
        unroll=unroll,
        drift_fallback=drift_fallback,
    )


#: The registry's entries of this file (registered at the first models.get). RevNets offer no
#: other form: their reversible stages keep nothing per unit already (reversible=false and
#: anchor_every keep more), and their downsampling units are 2-3.
SPECS: dict[str, ModelSpec] = family_specs(
    "revnet",
    "RevNet",
    RevNetOptions,
    build_revnet,
    "reversible CIFAR RevNet (Gomez et al. 2017)",
    stage_stacks=stage_stacks,
)
