"""What the CIFAR ResNets (:mod:`models.resnet`) and RevNets (:mod:`models.revnet`) share.

The architecture table, the pre-activation residual function, shortcut and classifier head, the
remat presets and the options of both families. Both take a remat plan (the registry's ``remat``
option, ``remat:`` in a config): on every ResNet unit, on a RevNet's downsampling units, each
such unit a :func:`remat_nn.nn.tied_remat`.

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

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import flax.linen as fnn
import jax
import jax.numpy as jnp
import pydantic

import remat_nn as rn
from models._spec import ModelSpec, at_least_float32, remat_option
from remat_nn import names

__all__ = ["ARCHS", "NAMES", "REMAT_PRESETS", "Arch", "ResidualFn", "Shortcut", "family_specs"]

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

#: The activation names these models produce: what a remat plan of theirs may name.
NAMES = (names.CONV_OUT,)

#: Remat presets of the ResNets and RevNets (their ``remat`` option), each a plan of the units
#: it applies to (every ResNet unit; a RevNet's non-reversible downsampling units, whose
#: reversible units reconstruct instead).
#:
#: - ``none``: no remat; the backward pass reads what the forward stored.
#: - ``full``: recompute each unit in the backward pass; only its input is kept.
#: - ``save_conv_out``: keep each convolution's output (``conv_out``), recompute BatchNorm and
#:   ReLU (the cheap elementwise part; what ``dots_saveable`` is to a transformer).
REMAT_PRESETS: Mapping[str, rn.Plan | None] = MappingProxyType(
    {
        "none": None,
        "full": rn.plan({"default": "recompute"}),
        "save_conv_out": rn.plan({"save": [names.CONV_OUT]}),
    }
)


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
            x = rn.name(x, names.CONV_OUT)
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


class _Head(fnn.Module):
    """BN-ReLU, global average pooling, linear classifier (logits in at least float32)."""

    num_classes: int
    train: bool = False
    dtype: Any = jnp.float32

    @fnn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # The classifier is at least float32 under any compute dtype (3 small matmuls of the
        # gradient): the pooled features are not rounded to bfloat16 on their way to the logits.
        wide = at_least_float32(self.dtype)
        x = jax.nn.relu(_bn(self.train, self.dtype, "bn")(x)).astype(wide)
        x = jnp.mean(x, axis=(1, 2))  # (B, C)
        return fnn.Dense(self.num_classes, dtype=wide, name="fc")(x)


# --- options and registry entries -------------------------------------------------------------


class _ImageOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    #: The registered name errors call the model by (each registered variant sets its own).
    registered_name: ClassVar[str] = ""

    width: float = pydantic.Field(1.0, gt=0, description="multiplier of every channel width")
    num_classes: pydantic.PositiveInt = 10
    image_size: pydantic.PositiveInt = pydantic.Field(32, description="H = W of the input")
    in_channels: pydantic.PositiveInt = 3
    dtype: Literal["float32", "bfloat16"] = "float32"
    remat: str | dict[str, Any] | pydantic.InstanceOf[rn.Plan] | None = pydantic.Field(
        None,
        description=f"a preset of REMAT_PRESETS ({', '.join(REMAT_PRESETS)}), a remat_nn "
        "policy name (dots, ...), a per-name plan mapping or a remat_nn.Plan; null: the "
        "model's default",
    )

    @pydantic.field_validator("remat", mode="before")
    @classmethod
    def _remat(cls, v: Any) -> Any:
        # Resolved here, once (one message, naming the model): the Plan or policy name, or
        # "none" for no remat (None: the model's default, resolved with the other options).
        if v is None:
            return None
        plan = remat_option(v, presets=REMAT_PRESETS, model=cls.registered_name, names=NAMES)
        return "none" if plan is None else plan

    @pydantic.model_validator(mode="after")
    def _default_plan(self) -> _ImageOptions:
        # The default resolved too: the validated options name the plan the model runs.
        if self.remat is None:
            plan = _plan(None, self.default_remat(), self.registered_name)
            self.remat = "none" if plan is None else plan
        return self

    def default_remat(self) -> str:
        """The preset an unset ``remat`` stands for (a family's may depend on other options)."""
        return "none"


def _plan(remat: Any, default: str, model: str) -> rn.Plan | str | None:
    # The options schema hands a Plan, a policy name or "none" (a Plan's names are checked again
    # here, as for a caller of build_resnet / build_revnet); a direct caller may give any form
    # remat_option reads.
    value = default if remat is None else remat
    return remat_option(value, presets=REMAT_PRESETS, model=model, names=NAMES)


def _policy(plan: rn.Plan | str | None) -> rn.Plan | str:
    # A unit's plan as nn.tied_remat takes it: None is no remat.
    return "none" if plan is None else plan


def family_specs(
    family: str,
    title: str,
    options: type[_ImageOptions],
    build: Any,
    doc: str,
    variants: Any = None,
    stage_stacks: Any = None,
) -> dict[str, ModelSpec]:
    """The registry entries of a family: ``family`` (option ``depth``) and one per depth
    (``resnet32``, ...) whose options fix it; ``variants(options, schema=...)`` or None;
    ``stage_stacks`` as :class:`ModelSpec`'s."""
    depths = options.model_fields["depth"].annotation.__args__
    doc_family = f"{doc}, option depth in {list(depths)}"
    extra = {"stage_stacks": stage_stacks}
    out = {
        family: ModelSpec(build, options, "classify", doc_family, REMAT_PRESETS, variants, **extra)
    }
    for depth in depths:
        fixed = pydantic.create_model(
            f"{options.__name__}{depth}",
            __base__=options,
            depth=(Literal[depth], depth),  # type: ignore[valid-type]
        )
        fixed.registered_name = f"{family}{depth}"
        doc_depth = f"{title}-{depth}: {doc}"
        fixed_variants = variants and functools.partial(variants, schema=fixed)
        out[f"{family}{depth}"] = ModelSpec(
            build, fixed, "classify", doc_depth, REMAT_PRESETS, fixed_variants, **extra
        )
    return out
