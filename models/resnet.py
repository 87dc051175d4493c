"""Pre-activation ResNets for CIFAR-sized images: the baselines of the RevNets.

ResNet (pre-activation, He et al. 2016b): a 3x3 stem convolution, three stages of residual units
(the first unit of stages 2 and 3 halves the resolution), then BN-ReLU, global average pooling
and a linear classifier. Basic units are BN-ReLU-conv3x3 twice; bottleneck units are
BN-ReLU-conv1x1 (w/4), BN-ReLU-conv3x3 (w/4), BN-ReLU-conv1x1 (w). Shortcuts that change shape
are parameter-free for basic units (strided average pooling + zero channels, "option A") and a
1x1 convolution for bottleneck units, which is what reproduces the paper's parameter counts.

Every unit takes the remat plan (:data:`REMAT_PRESETS`). A ResNet's identical units can run in
one ``nn.scan`` per stage (``scan_units``; :func:`convert_units` converts variables between the
two layouts), or a nested checkpointed scan with the same variables (``scan_levels``). The
architectures are in :data:`ARCHS` (:mod:`models._cifar`).

References:
  He, Zhang, Ren, Sun 2016a, "Deep Residual Learning for Image Recognition" (CIFAR ResNets).
  He, Zhang, Ren, Sun 2016b, "Identity Mappings in Deep Residual Networks" (pre-activation,
    ResNet-164).
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
from models._spec import (
    ModelSpec,
    StageStacks,
    check_scan_levels,
    fused_unit_plan,
    nested_save_every,
    nesting_holds_fewer,
)
from remat_nn import nn as rnn

__all__ = [
    "ARCHS",
    "NAMES",
    "REMAT_PRESETS",
    "Arch",
    "ResNet",
    "ResNetOptions",
    "ResidualUnit",
    "build_resnet",
    "convert_units",
    "resnet_variants",
    "stage_stacks",
]


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
      remat: the plan of every residual unit (see :data:`REMAT_PRESETS`; or a remat_nn policy
        name such as ``"dots"``), or None: no remat, in a nested scan too. The stem and the
        head are not rematerialized: the stem's output is the first unit's stored input, and
        the head's backward runs right after its forward, so neither holds anything across
        other units.
      scan_units: run the identical units of each stage (all but a first unit that changes the
        shape) in one ``nn.scan``, parameters stacked under ``stage{s}``
        (:func:`convert_units` converts variables between the layouts). Compiles each stage
        once; XLA:CPU runs convolutions in a loop much slower than unrolled (jax-ml/jax#12868),
        hence off by default.
      scan_levels: with ``scan_units``, run each stage's scanned units as a nested checkpointed
        scan (:func:`remat_nn.remat_scan`) of that many levels instead of ``nn.scan``: about
        ``levels * n**(1/levels)`` unit inputs of a stage held instead of ``n``, for one more
        forward pass of the stage per level below the outermost. Each unit inside it runs under
        ``remat`` (None: no remat, the unit's residuals kept while its segment is recomputed in
        the backward; with one level that is no remat at all; :func:`build_resnet`'s unset
        ``remat`` is ``full`` here). The variables are those of
        ``scan_units`` (``init`` runs the very ``nn.scan``), so a checkpoint moves between the
        two; BatchNorm statistics are updated once per unit, by the forward pass. ``None``:
        ``nn.scan``.

    >>> import jax, jax.numpy as jnp
    >>> m = ResNet(ARCHS["resnet32"], num_classes=10)
    >>> x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    >>> v = jax.eval_shape(m.init, jax.random.key(0), x)   # shapes only: nothing runs
    >>> from models.summary import count_params
    >>> count_params(v["params"])   # RevNet paper, Table 1: 0.46M
    464154
    >>> jax.eval_shape(m.apply, v, x).shape
    (2, 10)
    """

    arch: Arch
    num_classes: int = 10
    dtype: Any = jnp.float32
    remat: rn.Plan | str | None = None
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
                x = rnn.tied_remat(
                    self, ResidualUnit, x, *args, policy=_policy(self.remat), name=f"stage{s}_{u}"
                )
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

        policy = _policy(self.remat)
        x, stats = rn.remat_scan(step, x, stacked, levels=self.scan_levels, policy=policy)
        if train and self.is_mutable_collection("batch_stats"):
            self.put_variable("batch_stats", name, stats)  # (L, ...) leaves, as nn.scan's
        return x


# --- the stages as stacks, for the optimizer update inside the backward pass ---------------------

_NEEDS_SCAN_UNITS = (
    "resnet: the optimizer update inside the backward pass needs each stage's identical units as "
    "one scan over stacked parameters, but the model has {why}. Fix: "
    "model.options.scan_units=true{fix}, or train.update_in_backward=false."
)


def stage_stacks(module: ResNet) -> StageStacks:
    """The ResNet as stem, stages (first unit, stack of identical units) and head.

    The same computation as ``module.apply(variables, images, train=True,
    mutable=["batch_stats"])``, for :func:`remat_nn.fused_update_stages`: the stacks are the
    ``nn.scan`` of ``scan_units`` (``params["stage1"]``, a leading unit axis); a unit that
    changes the width or resolution (``stage{s}_0``) runs before its stage's stack. Every unit
    is under the model's remat plan; the stacked units' inputs are saved, or with
    ``scan_levels: 2`` those of every k-th unit of a stage (the stage's ``save_every``, k the
    inner length of its nesting: the backward recomputes the others).

    Raises:
      ValueError: ``scan_units`` is off (no stacks), ``scan_levels`` is above 2 (the fused step
        nests two levels), or a stage has no identical units to stack.

    >>> m = ResNet(ARCHS["resnet32"].scaled(0.25), num_classes=3, scan_units=True)
    >>> x = jnp.ones((2, 8, 8, 3))
    >>> v = m.init(jax.random.key(0), x)
    >>> logits, stats = stage_stacks(m).apply(v["params"], v["batch_stats"], x)
    >>> want, new = m.apply(v, x, train=True, mutable=["batch_stats"])
    >>> bool(jnp.allclose(logits, want, atol=1e-5)), jax.tree.structure(stats) == (
    ...     jax.tree.structure(new["batch_stats"]))
    (True, True)
    """
    o, arch = module, module.arch
    if not o.scan_units:
        raise ValueError(_NEEDS_SCAN_UNITS.format(why="scan_units=false", fix=""))
    if o.scan_levels is not None and o.scan_levels > 2:
        why = f"scan_levels={o.scan_levels} (the fused step nests two levels: save_every)"
        fix = " and model.options.scan_levels=null or 2"
        raise ValueError(_NEEDS_SCAN_UNITS.format(why=why, fix=fix))

    def embed(rest: Any, stats: Any, images: jax.Array) -> tuple[jax.Array, Any]:
        stem = _conv(arch.stem, 3, 1, o.dtype, "stem")
        return stem.apply({"params": rest["stem"]}, images.astype(o.dtype)), stats

    def head(rest: Any, stats: Any, h: jax.Array) -> tuple[jax.Array, Any]:
        variables = {"params": rest["head"], "batch_stats": stats["head"]}
        logits, new = _Head(o.num_classes, True, o.dtype).apply(
            variables, h, mutable=["batch_stats"]
        )
        return logits, {**stats, "head": new["batch_stats"]}

    stages = []
    for s, (n, width) in enumerate(zip(arch.units, arch.widths, strict=True)):
        first = _first_scanned(arch, s)
        if n == first:
            why = f"a stage of one unit (stage {s}: nothing to stack)"
            raise ValueError(_NEEDS_SCAN_UNITS.format(why=why, fix=""))
        before = None
        if first:
            unit = ResidualUnit(width, 2 if s > 0 else 1, arch.bottleneck, True, o.dtype)
            before = rn.checkpoint(partial(_unit, unit, f"stage{s}_0"), policy=_policy(o.remat))
        save_every = nested_save_every(n - first, o.scan_levels)
        stage = rn.FusedStage(
            f"stage{s}", _stacked_unit(o, width), before=before, save_every=save_every
        )
        stages.append(stage)
    return StageStacks(embed, tuple(stages), head)


def _unit(unit: fnn.Module, name: str, rest: Any, stats: Any, h: jax.Array) -> tuple[Any, Any]:
    """A stage's first unit on ``h``, its batch statistics updated in ``stats``."""
    variables = {"params": rest[name], "batch_stats": stats[name]}
    y, new = unit.apply(variables, h, mutable=["batch_stats"])
    return y, {**stats, name: new["batch_stats"]}


def _stacked_unit(o: ResNet, width: int) -> Any:
    """One of a stage's identical units, ``(params, batch_stats, h) -> (h, batch_stats)``,
    under the model's remat plan as ``nn.scan`` runs it, plain for a plan that saves nothing
    (the fused step's recomputation: ``fused_unit_plan``)."""
    plan = fused_unit_plan(o.remat)
    cls = ResidualUnit
    if plan is not None:
        cls = rnn.remat(ResidualUnit, policy=plan, prevent_cse=False)
    unit = cls(width, 1, o.arch.bottleneck, True, o.dtype)

    def layer(p: Any, c: Any, h: jax.Array) -> tuple[jax.Array, Any]:
        y, new = unit.apply({"params": p, "batch_stats": c}, h, mutable=["batch_stats"])
        return y, new["batch_stats"]

    return layer


_SCAN_LEVELS_NEEDS_SCAN = (
    "{where}scan_levels={levels!r} nests the scan of scan_units, but scan_units is off. Fix: "
    "set scan_units=True with scan_levels (e.g. scan_units=True, scan_levels=2), or drop "
    "scan_levels."
)


def _check_scan_levels(levels: Any, scan_units: bool, where: str) -> None:
    check_scan_levels(levels, f"{where}: ")
    if levels is not None and not scan_units:
        raise ValueError(_SCAN_LEVELS_NEEDS_SCAN.format(where=f"{where}: ", levels=levels))


# --- registry ---------------------------------------------------------------------------------


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
        where = f"{self.registered_name}: option "
        if self.scan_levels is not None and not self.scan_units:
            raise ValueError(_SCAN_LEVELS_NEEDS_SCAN.format(where=where, levels=self.scan_levels))
        return self

    def default_remat(self) -> str:
        return _default_remat(self.scan_levels)


def _default_remat(scan_levels: int | None) -> str:
    # Unset: no remat (the baseline stores every activation), but `full` in a nested scan,
    # whose units would otherwise keep their residuals while each segment is recomputed.
    return "none" if scan_levels is None else "full"


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
    :data:`REMAT_PRESETS`, a remat_nn policy name, a plan mapping or a Plan, applied to every
    unit; unset: ``none`` (the baseline stores every activation), ``full`` with
    ``scan_levels``.

    >>> build_resnet(depth=164).arch.bottleneck
    True
    >>> str(build_resnet(remat="full", scan_units=True).remat)
    'default=recompute'
    >>> str(build_resnet(scan_units=True, scan_levels=2).remat)
    'default=recompute'
    >>> build_resnet(remat="none", scan_units=True, scan_levels=2).remat is None  # honoured
    True
    """
    arch = ARCHS[f"resnet{depth}"].scaled(width)
    plan = _plan(remat, _default_remat(scan_levels), f"resnet{depth}")
    return ResNet(
        arch,
        num_classes=num_classes,
        dtype=jnp.dtype(dtype),
        remat=plan,
        scan_units=scan_units,
        scan_levels=scan_levels,
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


#: The registry's entries of this file (registered at the first models.get).
SPECS: dict[str, ModelSpec] = family_specs(
    "resnet",
    "ResNet",
    ResNetOptions,
    build_resnet,
    "pre-activation CIFAR ResNet (He et al. 2016)",
    resnet_variants,
    stage_stacks=stage_stacks,
)
