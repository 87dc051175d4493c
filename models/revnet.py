"""Reversible residual networks (RevNet) and their ResNet baselines, for CIFAR-sized images.

ResNet (pre-activation, He et al. 2016b): a 3x3 stem convolution, three stages of residual units
(the first unit of stages 2 and 3 halves the resolution), then BN-ReLU, global average pooling
and a linear classifier. Basic units are BN-ReLU-conv3x3 twice; bottleneck units are
BN-ReLU-conv1x1 (w/4), BN-ReLU-conv3x3 (w/4), BN-ReLU-conv1x1 (w). Shortcuts that change shape
are parameter-free for basic units (strided average pooling + zero channels, "option A") and a
1x1 convolution for bottleneck units, which is what reproduces the paper's parameter counts.

RevNet (Gomez et al. 2017): the channels are split into halves (x1, x2) and each unit is an
additive coupling ``y1 = x1 + F(x2); y2 = x2 + G(y1)`` whose F and G are the residual functions
above on half the channels, so inputs are reconstructed from outputs and activations need not
be stored. The units that change the resolution or the width (the first of a stage) are not
invertible and store their activations, as in the paper (Section 3.2).

Architectures (RevNet paper, Table 1; "Channels" lists the stem width then each stage's width,
the bottleneck width for -164 models whose stage outputs are 4x):

  =========  =======  =============  ===================================================
  name       units    channels       params, CIFAR-10 (paper)
  resnet32   5-5-5    16-16-32-64    0.46M
  resnet110  18-18-18 16-16-32-64    1.73M
  resnet164  18-18-18 16-16-32-64    1.70M  (bottleneck)
  revnet38   3-3-3    32-32-64-112   0.46M
  revnet110  9-9-9    32-32-64-128   1.73M
  revnet164  9-9-9    32-32-64-128   1.75M  (bottleneck)
  =========  =======  =============  ===================================================

References:
  He, Zhang, Ren, Sun 2016a, "Deep Residual Learning for Image Recognition" (CIFAR ResNets).
  He, Zhang, Ren, Sun 2016b, "Identity Mappings in Deep Residual Networks" (pre-activation,
    ResNet-164).
  Gomez, Ren, Urtasun, Grosse 2017, "The Reversible Residual Network: Backpropagation Without
    Storing Activations", NeurIPS (Table 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import flax.linen as fnn
import jax
import jax.numpy as jnp
import pydantic

import models
import remat_nn as rn
from remat_nn import nn as rnn

__all__ = [
    "ARCHS",
    "Arch",
    "ResNet",
    "ResNetOptions",
    "ResidualFn",
    "RevNet",
    "RevNetOptions",
    "build_resnet",
    "build_revnet",
]

_BN_MOMENTUM = 0.9  # CIFAR ResNet training recipes (PyTorch momentum 0.1)
_BN_EPS = 1e-5


@dataclass(frozen=True)
class Arch:
    """One architecture of the table in the module docstring.

    Attributes:
      units: residual units per stage.
      widths: output channels of each stage (the whole width: both halves for a RevNet).
      stem: output channels of the first 3x3 convolution.
      bottleneck: bottleneck units (1x1, 3x3, 1x1 with a 4x expansion) instead of basic ones.
    """

    units: tuple[int, int, int]
    widths: tuple[int, int, int]
    stem: int
    bottleneck: bool

    def scaled(self, width: float) -> Arch:
        """The same architecture with every width multiplied by ``width``."""
        # Multiples of 8 keep RevNet halves, bottleneck quarters (and halves of those) integral.
        q = 8 if self.bottleneck else 2
        r = lambda c: max(q, q * round(c * width / q))
        return Arch(self.units, tuple(map(r, self.widths)), r(self.stem), self.bottleneck)  # type: ignore[arg-type]


#: name -> architecture (depth counts convolutions + the classifier).
ARCHS: dict[str, Arch] = {
    "resnet32": Arch((5, 5, 5), (16, 32, 64), 16, bottleneck=False),
    "resnet110": Arch((18, 18, 18), (16, 32, 64), 16, bottleneck=False),
    "resnet164": Arch((18, 18, 18), (64, 128, 256), 16, bottleneck=True),
    "revnet38": Arch((3, 3, 3), (32, 64, 112), 32, bottleneck=False),
    "revnet110": Arch((9, 9, 9), (32, 64, 128), 32, bottleneck=False),
    "revnet164": Arch((9, 9, 9), (128, 256, 512), 32, bottleneck=True),
}


# --- building blocks --------------------------------------------------------------------------


def _bn(train: bool, dtype: Any, name: str) -> fnn.BatchNorm:
    return fnn.BatchNorm(
        use_running_average=not train,
        momentum=_BN_MOMENTUM,
        epsilon=_BN_EPS,
        dtype=dtype,
        name=name,
    )


def _conv(features: int, kernel: int, strides: int, dtype: Any, name: str) -> fnn.Conv:
    return fnn.Conv(
        features,
        (kernel, kernel),
        strides=(strides, strides),
        padding="SAME",
        use_bias=False,
        dtype=dtype,
        kernel_init=fnn.initializers.variance_scaling(2.0, "fan_out", "normal"),
        name=name,
    )


class ResidualFn(fnn.Module):
    """The residual function of a pre-activation unit (no shortcut): F or G of a RevNet.

    Attributes:
      features: output channels.
      strides: stride of the 3x3 convolution (2 where a stage halves the resolution).
      bottleneck: BN-ReLU-conv1x1(features/4), BN-ReLU-conv3x3, BN-ReLU-conv1x1(features)
        instead of BN-ReLU-conv3x3 twice.
      train: batch statistics (and their running-average update) instead of the averages.
      dtype: compute dtype.

    >>> import jax, jax.numpy as jnp
    >>> f = ResidualFn(8, strides=2, train=False)
    >>> y, _ = jax.jit(f.init_with_output)(jax.random.key(0), jnp.ones((2, 8, 8, 4)))
    >>> y.shape
    (2, 4, 4, 8)
    """

    features: int
    strides: int = 1
    bottleneck: bool = False
    train: bool | None = None
    dtype: Any = jnp.float32

    @fnn.compact
    def __call__(self, x: jax.Array, *, train: bool | None = None) -> jax.Array:
        # `train` as an attribute or a call argument: a coupling passes its keywords to F and G.
        train = fnn.merge_param("train", self.train, train)
        if self.bottleneck:
            spec = [(self.features // 4, 1, 1), (self.features // 4, 3, self.strides)]
            spec.append((self.features, 1, 1))
        else:
            spec = [(self.features, 3, self.strides), (self.features, 3, 1)]
        for i, (features, kernel, strides) in enumerate(spec):
            x = jax.nn.relu(_bn(train, self.dtype, f"bn{i}")(x))
            x = _conv(features, kernel, strides, self.dtype, f"conv{i}")(x)
        return x


class Shortcut(fnn.Module):
    """The shortcut of a unit that changes shape.

    Basic units: strided average pooling and zero channels (no parameters, "option A" of
    He et al. 2016a). Bottleneck units: a strided 1x1 convolution (He et al. 2016b).

    Attributes:
      features: output channels.
      strides: spatial stride.
      projection: use the 1x1 convolution.
      dtype: compute dtype.
    """

    features: int
    strides: int = 1
    projection: bool = False
    dtype: Any = jnp.float32

    @fnn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] == self.features and self.strides == 1:
            return x
        if self.projection:
            return _conv(self.features, 1, self.strides, self.dtype, "proj")(x)
        if self.strides > 1:
            s = (self.strides, self.strides)
            x = fnn.avg_pool(x, s, strides=s)  # (B, H/s, W/s, C)
        pad = self.features - x.shape[-1]
        return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad)))  # (B, H', W', features)


class ResidualUnit(fnn.Module):
    """A pre-activation ResNet unit: ``shortcut(x) + ResidualFn(x)``.

    Attributes:
      features: output channels.
      strides: stride.
      bottleneck: bottleneck residual function (and a projection shortcut when shapes change).
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
        short = Shortcut(self.features, self.strides, self.bottleneck, self.dtype, name="shortcut")
        fn = ResidualFn(
            self.features, self.strides, self.bottleneck, self.train, self.dtype, name="fn"
        )
        return short(x) + fn(x)


class _Head(fnn.Module):
    """BN-ReLU, global average pooling, linear classifier (float32 logits)."""

    num_classes: int
    train: bool = False
    dtype: Any = jnp.float32

    @fnn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # The classifier is float32 under any compute dtype (3 small matmuls of the gradient):
        # the pooled features are not rounded to bfloat16 on their way to the logits.
        x = jax.nn.relu(_bn(self.train, self.dtype, "bn")(x)).astype(jnp.float32)
        x = jnp.mean(x, axis=(1, 2))  # (B, C)
        return fnn.Dense(self.num_classes, dtype=jnp.float32, name="fc")(x)


class ResNet(fnn.Module):
    """Pre-activation CIFAR ResNet: ``apply(variables, images (B, H, W, C), train=bool)``.

    Attributes:
      arch: the :class:`Arch` (see :data:`ARCHS`).
      num_classes: classifier outputs.
      dtype: compute dtype (parameters and logits float32).

    >>> import jax, jax.numpy as jnp
    >>> m = ResNet(ARCHS["resnet32"], num_classes=10)
    >>> x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    >>> v = jax.eval_shape(m.init, jax.random.key(0), x)   # shapes only: nothing runs
    >>> sum(p.size for p in jax.tree.leaves(v["params"]))   # RevNet paper, Table 1: 0.46M
    464154
    >>> jax.eval_shape(m.apply, v, x).shape
    (2, 10)
    """

    arch: Arch
    num_classes: int = 10
    dtype: Any = jnp.float32

    @fnn.compact
    def __call__(self, images: jax.Array, *, train: bool = False) -> jax.Array:
        x = _conv(self.arch.stem, 3, 1, self.dtype, "stem")(images.astype(self.dtype))
        for s, (n, width) in enumerate(zip(self.arch.units, self.arch.widths, strict=True)):
            for u in range(n):
                strides = 2 if s > 0 and u == 0 else 1
                unit = ResidualUnit(
                    width, strides, self.arch.bottleneck, train, self.dtype, name=f"stage{s}_{u}"
                )
                x = unit(x)  # (B, H / 2^s, W / 2^s, width)
        return _Head(self.num_classes, train, self.dtype, name="head")(x)


# --- RevNet -----------------------------------------------------------------------------------


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

    >>> import jax, jax.numpy as jnp
    >>> m = RevNet(ARCHS["revnet38"], num_classes=10)
    >>> x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    >>> v = jax.eval_shape(m.init, jax.random.key(0), x)   # shapes only: nothing runs
    >>> sorted(v["params"])
    ['head', 'stage0', 'stage1', 'stage1_down', 'stage2', 'stage2_down', 'stem']
    >>> sum(p.size for p in jax.tree.leaves(v["params"]))   # RevNet paper, Table 1: 0.46M
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

    @fnn.compact
    def __call__(self, images: jax.Array, *, train: bool = False) -> jax.Array:
        x = _conv(self.arch.stem, 3, 1, self.dtype, "stem")(images.astype(self.dtype))
        for s, (n, width) in enumerate(zip(self.arch.units, self.arch.widths, strict=True)):
            strides = 2 if s > 0 else 1
            if strides != 1 or x.shape[-1] != width:
                down = RevDownsample(
                    width, strides, self.arch.bottleneck, train, self.dtype, name=f"stage{s}_down"
                )
                x = down(x)  # (B, H / 2^s, W / 2^s, width), activations stored
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
                name=f"stage{s}",
            )
            x = stack(x, train=train)  # (B, H / 2^s, W / 2^s, width), halves split on channels
        return _Head(self.num_classes, train, self.dtype, name="head")(x)


# --- registry ---------------------------------------------------------------------------------


class _ImageOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    #: The registered name errors call the model by (each registered variant sets its own).
    registered_name: ClassVar[str] = ""
    #: Why the model takes no remat plan, and the fix (the ``remat`` option's error).
    remat_refusal: ClassVar[str] = ""

    width: float = pydantic.Field(1.0, gt=0, description="multiplier of every channel width")
    num_classes: pydantic.PositiveInt = 10
    image_size: pydantic.PositiveInt = pydantic.Field(32, description="H = W of the input")
    in_channels: pydantic.PositiveInt = 3
    dtype: Literal["float32", "bfloat16"] = "float32"
    remat: None = pydantic.Field(None, description="takes no remat plan (only null)")

    @pydantic.field_validator("remat", mode="before")
    @classmethod
    def _no_remat(cls, v: Any) -> None:
        # Explicit, so a plan or preset is refused naming the model, not as an unknown type.
        if v is not None:
            shown = f"<plan {v}>" if isinstance(v, rn.Plan) else repr(v)
            raise ValueError(f"{cls.registered_name}: option remat={shown}: {cls.remat_refusal}")
        return v


class ResNetOptions(_ImageOptions):
    """Options of the ResNet baselines (unknown keys rejected)."""

    registered_name: ClassVar[str] = "resnet"
    remat_refusal: ClassVar[str] = (
        "ResNet takes no remat plan (its activations are not named for one). Fix: drop remat; "
        "for activation memory that does not grow with depth, train a revnet."
    )
    depth: Literal[32, 110, 164] = 32


class RevNetOptions(_ImageOptions):
    """Options of the RevNets (unknown keys rejected)."""

    registered_name: ClassVar[str] = "revnet"
    remat_refusal: ClassVar[str] = (
        "RevNet takes no remat plan: its reversible blocks reconstruct their activations in the "
        "backward pass instead of storing them (reversible=false is the plain-autodiff "
        "reference). Fix: drop remat."
    )
    depth: Literal[38, 110, 164] = 38
    reversible: bool = True
    anchor_every: pydantic.PositiveInt | None = None


def build_resnet(
    *, depth: int = 32, width: float = 1.0, num_classes: int = 10, dtype: str = "float32", **_: Any
) -> ResNet:
    """Builds ResNet-``depth`` (32, 110 or 164); ``image_size`` / ``in_channels`` are read by
    callers that make inputs (the network is fully convolutional).

    >>> build_resnet(depth=164).arch.bottleneck
    True
    """
    arch = ARCHS[f"resnet{depth}"].scaled(width)
    return ResNet(arch, num_classes=num_classes, dtype=jnp.dtype(dtype))


def build_revnet(
    *,
    depth: int = 38,
    width: float = 1.0,
    num_classes: int = 10,
    dtype: str = "float32",
    reversible: bool = True,
    anchor_every: int | None = None,
    **_: Any,
) -> RevNet:
    """Builds RevNet-``depth`` (38, 110 or 164); see :class:`RevNet` for the options.

    >>> build_revnet(depth=110).arch.widths
    (32, 64, 128)
    """
    arch = ARCHS[f"revnet{depth}"].scaled(width)
    return RevNet(
        arch,
        num_classes=num_classes,
        reversible=reversible,
        anchor_every=anchor_every,
        dtype=jnp.dtype(dtype),
    )


def _register() -> None:
    families = {
        "resnet": (ResNetOptions, build_resnet, "pre-activation CIFAR ResNet (He et al. 2016)"),
        "revnet": (RevNetOptions, build_revnet, "reversible CIFAR RevNet (Gomez et al. 2017)"),
    }
    for family, (options, build, doc) in families.items():
        depths = options.model_fields["depth"].annotation.__args__
        doc_family = f"{doc}, option depth in {list(depths)}"
        models.register(family, models.ModelSpec(build, options, "classify", doc_family))
        for depth in depths:
            fixed = pydantic.create_model(
                f"{options.__name__}{depth}",
                __base__=options,
                depth=(Literal[depth], depth),  # type: ignore[valid-type]
            )
            fixed.registered_name = f"{family}{depth}"
            title = {"resnet": "ResNet", "revnet": "RevNet"}[family]
            spec = models.ModelSpec(build, fixed, "classify", f"{title}-{depth}: {doc}")
            models.register(f"{family}{depth}", spec)


_register()
