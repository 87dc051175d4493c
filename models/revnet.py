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
invertible and store their activations in the paper (Section 3.2); here they are recomputed in
the backward pass by default (``remat``, :data:`REMAT_PRESETS`), which at RevNet-164's size
halves the step's memory.

Both families take a remat plan (the registry's ``remat`` option, ``remat:`` in a config): on
every ResNet unit, on a RevNet's downsampling units. A ResNet's identical units can run in one
``nn.scan`` per stage (``scan_units``; :func:`convert_units` converts variables between the two
layouts), or a nested checkpointed scan with the same variables (``scan_levels``).

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
from models._spec import ModelSpec, check_scan_levels, nesting_holds_fewer, remat_option
from remat_nn import names
from remat_nn import nn as rnn
from remat_nn._tie import tie_to_cotangent

__all__ = [
    "ARCHS",
    "NAMES",
    "REMAT_PRESETS",
    "Arch",
    "ResNet",
    "ResNetOptions",
    "ResidualFn",
    "RevNet",
    "RevNetOptions",
    "build_resnet",
    "build_revnet",
    "convert_units",
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


# --- remat of units ---------------------------------------------------------------------------


def _call(unit: fnn.Module, x: jax.Array) -> jax.Array:
    return unit(x)


def _call_fwd(unit: fnn.Module, x: jax.Array) -> tuple[jax.Array, Any]:
    # The VJP of the rematerialized unit keeps what its policy saves (its input, for "full").
    return fnn.vjp(_call, unit, x, vjp_variables=True)


def _call_bwd(vjp_fn: Any, dy: jax.Array) -> Any:
    return tie_to_cotangent(vjp_fn, dy)(dy)


def _unit(
    parent: fnn.Module,
    cls: type[fnn.Module],
    plan: rn.Plan | None,
    x: jax.Array,
    *args: Any,
    name: str,
) -> jax.Array:
    """``cls(*args, name=name)(x)``, its activations recomputed in the backward under ``plan``.

    The unit is a ``nn.remat`` of ``cls`` (the plan checked against its body) whose VJP is taken
    in the forward pass and called in the backward pass with its residuals tied to the incoming
    cotangent, so that the recomputation runs in the backward pass on every backend (see
    ``remat_nn._tie``). Same variables as ``cls`` (BatchNorm statistics updated once, by the
    forward pass); the gradient equals plain autodiff's.
    """
    # Initialisation has no backward pass; flax's custom_vjp would close over the init key,
    # which jax_custom_vjp3 refuses.
    if plan is None or parent.is_initializing():
        return cls(*args, name=name)(x)
    # The custom_vjp may close over no tracer (jax_custom_vjp3 refuses one): every collection is
    # its input (BatchNorm reads its running statistics in training), and the units draw no
    # random numbers, so the remat lifts no PRNG key (the trainer passes a dropout key).
    unit = rnn.remat(cls, policy=plan, prevent_cse=False, rngs=False)(*args, name=name)
    vjp = fnn.custom_vjp(_call, forward_fn=_call_fwd, backward_fn=_call_bwd, grad_vars=True)
    return vjp(unit, x)


def _first_scanned(arch: Arch, stage: int) -> int:
    """Index of the first unit of ``stage`` that keeps its input's shape (1 where the first
    unit halves the resolution or changes the width, else 0): from it on, the units of the stage
    are identical and ``scan_units`` runs them in one ``nn.scan``."""
    width_in = arch.stem if stage == 0 else arch.widths[stage - 1]
    return 1 if stage > 0 or width_in != arch.widths[stage] else 0


def convert_units(tree: Mapping[str, Any], arch: Arch, *, scanned: bool) -> dict[str, Any]:
    """Converts a ResNet's variables between ``scan_units=False`` and ``scan_units=True``.

    Unscanned, unit ``u`` of stage ``s`` is the top-level entry ``stage{s}_{u}``; scanned, the
    identical units of a stage (from :func:`_first_scanned` on: all but a first unit that
    changes the shape) are one entry ``stage{s}`` whose every leaf is stacked on a new leading
    axis, unit ``u`` at index ``u - first``. Everything else (stem, head, the first units) is
    the same in both. The conversion is exact (stack / index), so a checkpoint of one layout
    restores into the other: apply it to each collection (``params``, ``batch_stats``) and to
    every optimizer state tree shaped like the parameters (momenta), then restore.

    Args:
      tree: one collection of a ResNet's variables (top-level keys are module names).
      arch: the ResNet's :class:`Arch`.
      scanned: convert to the scanned layout (True) or back to the unscanned one (False).

    Returns:
      The converted collection (a new dict; leaves are not copied where unchanged).

    Raises:
      ValueError: ``tree`` is not in the other layout (a unit's entry is missing).

    >>> import jax, jax.numpy as jnp
    >>> arch = ARCHS["resnet32"]
    >>> x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    >>> plain = jax.eval_shape(ResNet(arch).init, jax.random.key(0), x)["params"]
    >>> scan = jax.eval_shape(ResNet(arch, scan_units=True).init, jax.random.key(0), x)["params"]
    >>> sorted(scan)
    ['head', 'stage0', 'stage1', 'stage1_0', 'stage2', 'stage2_0', 'stem']
    >>> scan["stage1"]["fn"]["conv0"]["kernel"].shape   # units 1..4 of stage 1, stacked
    (4, 3, 3, 32, 32)
    >>> to_scan = jax.eval_shape(lambda t: convert_units(t, arch, scanned=True), plain)
    >>> back = jax.eval_shape(lambda t: convert_units(t, arch, scanned=False), scan)
    >>> to_scan == scan and back == plain   # the same shapes, both ways
    True
    """
    out = dict(tree)
    for s, n in enumerate(arch.units):
        first = _first_scanned(arch, s)
        units = [f"stage{s}_{u}" for u in range(first, n)]
        if not units:
            continue
        have = [k for k in (units if scanned else [f"stage{s}"]) if k not in out]
        if have:
            layout = "unscanned" if scanned else "scanned"
            raise ValueError(
                f"convert_units(scanned={scanned}): the tree has no {have[0]!r}, so it is not in "
                f"the {layout} layout of this arch (top-level keys: {sorted(out)}). Fix: pass "
                f"scanned={not scanned} to convert the other way, or the arch the tree is from."
            )
        if scanned:
            parts = [out.pop(k) for k in units]
            out[f"stage{s}"] = jax.tree.map(lambda *xs: jnp.stack(xs), *parts)  # (L, ...)
        else:
            stacked = out.pop(f"stage{s}")
            for i, k in enumerate(units):
                out[k] = jax.tree.map(lambda a, i=i: a[i], stacked)
    return out


def _scan_body(unit: fnn.Module, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
    return unit(x), None


class ResNet(fnn.Module):
    """Pre-activation CIFAR ResNet: ``apply(variables, images (B, H, W, C), train=bool)``.

    Attributes:
      arch: the :class:`Arch` (see :data:`ARCHS`).
      num_classes: classifier outputs.
      dtype: compute dtype (parameters and logits float32).
      remat: the plan of every residual unit (see :data:`REMAT_PRESETS`), or None: no remat.
        The stem and the head are not rematerialized: the stem's output is the first unit's
        stored input, and the head's backward runs right after its forward, so neither holds
        anything across other units.
      scan_units: run the identical units of each stage (all but a first unit that changes the
        shape) in one ``nn.scan``, parameters stacked under ``stage{s}``
        (:func:`convert_units` converts variables between the layouts). Compiles each stage
        once; XLA:CPU runs convolutions in a loop much slower than unrolled (jax-ml/jax#12868),
        hence off by default.
      scan_levels: with ``scan_units``, run each stage's scanned units as a nested checkpointed
        scan (:func:`remat_nn.remat_scan`) of that many levels instead of ``nn.scan``: about
        ``levels * n**(1/levels)`` unit inputs of a stage held instead of ``n``, for one more
        forward pass of the stage per level below the outermost. Each unit inside it runs under
        ``remat`` (unset: recomputed whole, as ``full``). The variables are those of
        ``scan_units`` (``init`` runs the very ``nn.scan``), so a checkpoint moves between the
        two; BatchNorm statistics are updated once per unit, by the forward pass. ``None``:
        ``nn.scan``.

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
    remat: rn.Plan | None = None
    scan_units: bool = False
    scan_levels: int | None = None

    @fnn.compact
    def __call__(self, images: jax.Array, *, train: bool = False) -> jax.Array:
        _check_scan_levels(self.scan_levels, self.scan_units, "ResNet")
        x = _conv(self.arch.stem, 3, 1, self.dtype, "stem")(images.astype(self.dtype))
        bottleneck = self.arch.bottleneck
        for s, (n, width) in enumerate(zip(self.arch.units, self.arch.widths, strict=True)):
            first = _first_scanned(self.arch, s)
            for u in range(first if self.scan_units else n):
                strides = 2 if s > 0 and u == 0 else 1
                args = (width, strides, bottleneck, train, self.dtype)
                x = _unit(self, ResidualUnit, self.remat, x, *args, name=f"stage{s}_{u}")
                # x: (B, H / 2^s, W / 2^s, width)
            if self.scan_units and n > first and self.scan_levels and not self.is_initializing():
                x = self._nested_units(s, width, train, x)  # (B, H / 2^s, W / 2^s, width)
            elif self.scan_units and n > first:
                cls = ResidualUnit
                if self.remat is not None:
                    # Inside scan the recomputation runs in the loop of the backward pass on
                    # every backend (XLA:CPU included); nothing to tie, no CSE to prevent.
                    cls = rnn.remat(ResidualUnit, policy=self.remat, prevent_cse=False)
                scan = fnn.scan(
                    _scan_body,
                    variable_axes={"params": 0, "batch_stats": 0},
                    split_rngs={"params": True},
                    length=n - first,
                )
                unit = cls(width, 1, bottleneck, train, self.dtype, name=f"stage{s}")
                x, _ = scan(unit, x, None)  # (B, H / 2^s, W / 2^s, width)
        return _Head(self.num_classes, train, self.dtype, name="head")(x)

    def _nested_units(self, s: int, width: int, train: bool, x: jax.Array) -> jax.Array:
        """Stage ``s``'s scanned units under :func:`remat_nn.remat_scan`, reading and writing
        the variables ``nn.scan`` stacked under ``stage{s}`` (one slice per unit)."""
        name = f"stage{s}"
        stacked = {col: tree[name] for col, tree in self.variables.items() if name in tree}
        unit = ResidualUnit(width, 1, self.arch.bottleneck, train, self.dtype, parent=None)

        def step(h: jax.Array, variables: Any) -> tuple[jax.Array, Any]:
            if not train:
                return unit.apply(variables, h), None
            h, updates = unit.apply(variables, h, mutable=["batch_stats"])
            return h, updates["batch_stats"]  # this unit's new running averages

        # remat unset: each unit recomputed whole (policy=None would keep more: measured).
        plan = self.remat if self.remat is not None else REMAT_PRESETS["full"]
        x, stats = rn.remat_scan(step, x, stacked, levels=self.scan_levels, policy=plan)
        if train and self.is_mutable_collection("batch_stats"):
            self.put_variable("batch_stats", name, stats)  # (L, ...) leaves, as nn.scan's
        return x


_SCAN_LEVELS_NEEDS_SCAN = (
    "{where}scan_levels={levels!r} nests the scan of scan_units, but scan_units is off. Fix: "
    "set scan_units=True with scan_levels (e.g. scan_units=True, scan_levels=2), or drop "
    "scan_levels."
)


def _check_scan_levels(levels: Any, scan_units: bool, where: str) -> None:
    check_scan_levels(levels, f"{where}: ")
    if levels is not None and not scan_units:
        raise ValueError(_SCAN_LEVELS_NEEDS_SCAN.format(where=f"{where}: ", levels=levels))


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
      remat: the plan of the non-reversible downsampling units (see :data:`REMAT_PRESETS`), or
        None: they store their activations, as in the paper. At RevNet-164's size they hold most
        of the step's memory, and ``full`` recomputes them in the backward pass from their
        inputs (the registry's default for ``reversible=True``; see :func:`build_revnet`).
        Reversible units reconstruct instead, and stem and head hold nothing across units
        (see :class:`ResNet`), so the plan applies to the downsampling units only.
      unroll: ``unroll`` of the reversible stages' scans (``nn.ReversibleSequence``); ``None``:
        its default for convolutional blocks (unrolled on CPU, a loop on GPU/TPU). Speed only.

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
    remat: rn.Plan | None = None
    unroll: int | bool | None = None

    @fnn.compact
    def __call__(self, images: jax.Array, *, train: bool = False) -> jax.Array:
        x = _conv(self.arch.stem, 3, 1, self.dtype, "stem")(images.astype(self.dtype))
        for s, (n, width) in enumerate(zip(self.arch.units, self.arch.widths, strict=True)):
            strides = 2 if s > 0 else 1
            if strides != 1 or x.shape[-1] != width:
                args = (width, strides, self.arch.bottleneck, train, self.dtype)
                # (B, H / 2^s, W / 2^s, width); activations stored, or recomputed under remat
                x = _unit(self, RevDownsample, self.remat, x, *args, name=f"stage{s}_down")
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
                name=f"stage{s}",
            )
            x = stack(x, train=train)  # (B, H / 2^s, W / 2^s, width), halves split on channels
        return _Head(self.num_classes, train, self.dtype, name="head")(x)


# --- registry ---------------------------------------------------------------------------------


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
        description=f"a preset of REMAT_PRESETS ({', '.join(REMAT_PRESETS)}), a per-name "
        "plan mapping or a remat_nn.Plan; null: the model's default",
    )

    @pydantic.field_validator("remat", mode="before")
    @classmethod
    def _remat(cls, v: Any) -> Any:
        # Checked as models.remat_option reads it (one message, naming the model); kept as given.
        if v is not None:
            remat_option(v, presets=REMAT_PRESETS, model=cls.registered_name, names=NAMES)
        return v


class ResNetOptions(_ImageOptions):
    """Options of the ResNet baselines (unknown keys rejected)."""

    registered_name: ClassVar[str] = "resnet"
    depth: Literal[32, 110, 164] = 32
    scan_units: bool = pydantic.Field(
        False, description="identical units of a stage in one nn.scan (parameters stacked)"
    )
    scan_levels: pydantic.PositiveInt | None = pydantic.Field(
        None,
        description="with scan_units: each stage's scan as a nested checkpointed scan "
        "(rn.remat_scan) of this many levels, same variables; null: nn.scan",
    )

    @pydantic.model_validator(mode="after")
    def _scan_levels(self) -> ResNetOptions:
        if self.scan_levels is not None and not self.scan_units:
            where = f"{self.registered_name}: option "
            raise ValueError(_SCAN_LEVELS_NEEDS_SCAN.format(where=where, levels=self.scan_levels))
        return self


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


def _plan(remat: Any, default: str, model: str) -> rn.Plan | None:
    value = default if remat is None else remat
    return remat_option(value, presets=REMAT_PRESETS, model=model, names=NAMES)


def build_resnet(
    *,
    depth: int = 32,
    width: float = 1.0,
    num_classes: int = 10,
    dtype: str = "float32",
    remat: str | Mapping[str, Any] | rn.Plan | None = None,
    scan_units: bool = False,
    scan_levels: int | None = None,
    **_: Any,
) -> ResNet:
    """Builds ResNet-``depth`` (32, 110 or 164); ``image_size`` / ``in_channels`` are read by
    callers that make inputs (the network is fully convolutional). ``remat``: a preset of
    :data:`REMAT_PRESETS`, a plan mapping or a Plan, applied to every unit; unset: ``none`` (the
    baseline stores every activation).

    >>> build_resnet(depth=164).arch.bottleneck
    True
    >>> str(build_resnet(remat="full", scan_units=True).remat)
    'default=recompute'
    """
    arch = ARCHS[f"resnet{depth}"].scaled(width)
    plan = _plan(remat, "none", f"resnet{depth}")
    return ResNet(
        arch,
        num_classes=num_classes,
        dtype=jnp.dtype(dtype),
        remat=plan,
        scan_units=scan_units,
        scan_levels=scan_levels,
    )


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
    **_: Any,
) -> RevNet:
    """Builds RevNet-``depth`` (38, 110 or 164); see :class:`RevNet` for the options.

    ``remat`` (the downsampling units' plan) unset: ``full`` with ``reversible=True`` (a RevNet
    is trained for its memory, and the three stored downsampling units would hold most of it:
    86% at RevNet-164's size, and recomputing them costs one more forward pass of those 2 or 3
    units per step), ``none`` with ``reversible=False`` (the plain-autodiff reference keeps
    everything). ``remat=none`` is the paper's RevNet, downsampling activations stored.

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
        remat=_plan(remat, "full" if reversible else "none", f"revnet{depth}"),
        unroll=unroll,
    )


def resnet_variants(
    options: Mapping[str, Any], schema: type[ResNetOptions] = ResNetOptions
) -> dict[str, dict[str, Any]]:
    """The ResNets' other forms for the budget planner: ``nested`` (``scan_units: true,
    scan_levels: 2``: each stage's identical units as a nested checkpointed scan), when some
    stage has enough of them for nesting to hold fewer unit inputs than one scan (ResNet-110 and
    -164: 17 scanned units per stage; not ResNet-32: 4) and the model is not nested already.
    With ``scan_units`` off it changes the parameters' layout (stacked per stage). ``schema``:
    the registered model's options (``resnet110`` fixes the depth).

    >>> resnet_variants({"depth": 110}), resnet_variants({"depth": 32})
    ({'nested': {'scan_units': True, 'scan_levels': 2}}, {})
    """
    o = schema.model_validate({k: v for k, v in options.items() if k != "remat"})
    arch = ARCHS[f"resnet{o.depth}"]
    scanned = [n - _first_scanned(arch, s) for s, n in enumerate(arch.units)]
    if o.scan_levels is not None or not any(map(nesting_holds_fewer, scanned)):
        return {}
    return {"nested": {"scan_units": True, "scan_levels": 2}}


def _specs() -> dict[str, ModelSpec]:
    out: dict[str, ModelSpec] = {}
    families = {
        "resnet": (ResNetOptions, build_resnet, "pre-activation CIFAR ResNet (He et al. 2016)"),
        "revnet": (RevNetOptions, build_revnet, "reversible CIFAR RevNet (Gomez et al. 2017)"),
    }
    for family, (options, build, doc) in families.items():
        depths = options.model_fields["depth"].annotation.__args__
        doc_family = f"{doc}, option depth in {list(depths)}"
        # RevNets offer no other form: their reversible stages keep nothing per unit already
        # (reversible=false and anchor_every keep more), and their downsampling units are 2-3.
        variants = resnet_variants if family == "resnet" else None
        out[family] = ModelSpec(build, options, "classify", doc_family, REMAT_PRESETS, variants)
        for depth in depths:
            fixed = pydantic.create_model(
                f"{options.__name__}{depth}",
                __base__=options,
                depth=(Literal[depth], depth),  # type: ignore[valid-type]
            )
            fixed.registered_name = f"{family}{depth}"
            title = {"resnet": "ResNet", "revnet": "RevNet"}[family]
            doc_depth = f"{title}-{depth}: {doc}"
            fixed_variants = variants and functools.partial(resnet_variants, schema=fixed)
            out[f"{family}{depth}"] = ModelSpec(
                build, fixed, "classify", doc_depth, REMAT_PRESETS, fixed_variants
            )
    return out


#: The registry's entries of this file (registered at the first models.get).
SPECS: dict[str, ModelSpec] = _specs()
