"""What a registered model is (:class:`ModelSpec`) and the option readers every model shares."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import flax.linen as fnn
import jax
import jax.numpy as jnp
import pydantic

import remat_nn as rn
from remat_nn.errors import did_you_mean

__all__ = [
    "POLICY_NAMES",
    "LayerStack",
    "ModelSpec",
    "StageStacks",
    "at_least_float32",
    "check_scan_levels",
    "coupling_stage",
    "fused_unit_plan",
    "nested_save_every",
    "nesting_holds_fewer",
    "remat_name",
    "remat_option",
]

#: The remat_nn policy names every model's ``remat`` option takes besides the model's presets:
#: each name and alias :func:`remat_nn.policy` resolves without arguments (``dots``,
#: ``dots_no_batch``, ``nothing_saveable``, ...). A model hands such a name to ``nn.remat`` /
#: ``rn.checkpoint`` as it is: the library resolves it.
POLICY_NAMES: tuple[str, ...] = tuple(
    sorted([n for n, e in rn.POLICIES.items() if not e.factory] + list(rn.ALIASES))
)


@dataclass(frozen=True)
class LayerStack:
    """A built model as ``head(rest, scan(layer, embed(rest, x), params[key]))``.

    What the trainer's ``train.update_in_backward`` needs (:func:`remat_nn.fused_update_step`):
    the same computation as ``module.apply`` in three parts, each taking float32 parameters.

    Attributes:
      key: the parameters' key of the stacked layers (leading layer axis on every leaf).
      embed: ``(rest, x) -> h``, the first layer's input; ``rest`` is the parameters but ``key``.
      layer: ``(layer_params, h) -> h``, one layer under the model's remat plan.
      head: ``(rest, h) -> outputs``, what ``module.apply`` returns.
      backward: for a reversible stack, ``(layer_params, y, dy) -> (h, d_layer_params, dh)``:
        the layer's inverse fused with its VJP (the backward rebuilds each layer's input from
        its output instead of saving it); None: inputs are saved.
      save_every: save the input of every k-th layer only and recompute a segment's inputs in
        the backward (:func:`remat_nn.fused_update_step`'s ``save_every``); None: every input.
      fallback: with ``backward``, what a layer whose rebuilt input drifted gets
        (:func:`remat_nn.fused_update_step`'s ``fallback``: the model's ``drift_fallback``).
    """

    key: str
    embed: Callable[[Any, Any], Any]
    layer: Callable[[Any, Any], Any]
    head: Callable[[Any, Any], Any]
    backward: Callable[[Any, Any, Any], tuple[Any, Any, Any]] | None = None
    save_every: int | None = None
    fallback: str = "error"


@dataclass(frozen=True)
class StageStacks:
    """A built model as an embedding, stages of layer stacks, and a head, with BatchNorm state.

    What ``train.update_in_backward`` needs (:func:`remat_nn.fused_update_stages`) for a model
    whose stacks differ in shape (a RevNet's stages): the same computation as
    ``module.apply(variables, x, train=True, mutable=["batch_stats"])``, outputs and new
    ``batch_stats``. ``rest`` is the parameters but the stacks, ``stats`` the batch statistics
    but the stacks'; every part takes float32 parameters.

    Attributes:
      embed: ``(rest, stats, x) -> (h, stats)``, the first stage's input.
      stages: the :class:`remat_nn.FusedStage` s: the non-stacked unit before each stack (e.g.
        a downsampling unit), the stack's key, one layer ``(layer_params, layer_stats, h) ->
        (h, layer_stats)`` and, for a reversible stack, its fused inverse and VJP (or, for a
        nested one, its ``save_every``).
      head: ``(rest, stats, h) -> (outputs, stats)``, outputs as ``module.apply`` returns them.
    """

    embed: Callable[[Any, Any, Any], tuple[Any, Any]]
    stages: tuple[rn.FusedStage, ...]
    head: Callable[[Any, Any, Any], tuple[Any, Any]]

    def apply(self, params: Any, stats: Any, x: Any) -> tuple[Any, Any]:
        """The parts composed, as the forward pass runs them: ``(outputs, new batch_stats)``,
        what ``module.apply({"params": params, "batch_stats": stats}, x, train=True,
        mutable=["batch_stats"])`` gives (its ``batch_stats`` unwrapped)."""
        keys = {s.key for s in self.stages}
        rest = {k: p for k, p in params.items() if k not in keys}
        h, new = self.embed(rest, stats, x)
        for s in self.stages:
            if s.before is not None:
                h, new = s.before(rest, new, h)
            layers = (params[s.key], stats.get(s.key, {}))
            h, new_layers = jax.lax.scan(lambda h, pc, s=s: s.layer(*pc, h), h, layers)
            new = {**new, s.key: new_layers} if s.key in stats else new
        outputs, new = self.head(rest, new, h)
        return outputs, new


@dataclass(frozen=True)
class ModelSpec:
    """How to build one registered model.

    Attributes:
      build: ``build(**options) -> flax.linen.Module``; options validated by ``options`` first.
      options: pydantic model of the constructor's options (unknown keys rejected).
      task: ``"classify"`` or ``"lm"`` (see the module docstring for the calling convention).
      doc: one line shown by ``python -m models.summary --list``.
      remat_presets: the preset names the model's ``remat`` option takes, each mapped to its
        :class:`remat_nn.Plan` (None: no remat). A model's ``remat`` option takes one of these
        names, a policy name of :data:`POLICY_NAMES` (:func:`remat_name` reads both) or a
        ``Plan`` (or a plan mapping; :func:`remat_option` reads it for the CNN models, the
        transformer adds ``custom``); the trainer hands the config's ``remat:`` to every model
        through that option.
      variants: ``variants(options) -> {label: option overrides}``: the other forms of the
        model that ``remat: {policy: auto, budget: ...}`` may choose when no per-name plan of
        the model as configured fits the budget (a nested scan, the reversible form, ...), only
        those valid with ``options`` (the model's options as configured, unvalidated: defaults
        are the schema's). A form may change the parameters: each is planned on its own state.
        An override that sets ``remat`` fixes the form's plan (the planner's plan does not
        apply to it, e.g. reversible blocks keep nothing per layer). None: no other forms.
      layer_stack: ``layer_stack(module) -> LayerStack`` for a built module, or a ValueError
        saying why that module is not a plain stack of layers (e.g. unscanned blocks); None:
        the model has no layer stack.
      stage_stacks: for a model of several stacks (and BatchNorm), ``stage_stacks(module) ->
        StageStacks``, or a ValueError saying why not; None: none (``layer_stack`` is used).
    """

    build: Callable[..., fnn.Module]
    options: type[pydantic.BaseModel]
    task: Literal["classify", "lm", "regress"]
    doc: str = ""
    remat_presets: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    variants: Callable[[Mapping[str, Any]], Mapping[str, Mapping[str, Any]]] | None = None
    layer_stack: Callable[[fnn.Module], LayerStack] | None = None
    stage_stacks: Callable[[fnn.Module], StageStacks] | None = None


def coupling_stage(
    key: str,
    block: Any,
    *,
    reversible: bool,
    before: Any = None,
    collection: str | None = None,
    fallback: str = "error",
) -> rn.FusedStage:
    """A stage whose stack is a reversible sequence's couplings, as the models store them: each
    layer's parameters at ``params[key]["layers"]``, its state at ``stats[key]["layers"]``.

    Args:
      key: the stage's key in the parameters and the state.
      block: one layer, as ``rnn.coupling_layer`` / ``rnnx.coupling_layer`` give it.
      reversible: each layer's input rebuilt from its output by the block's fused backward;
        else saved.
      before: the stage's non-stacked unit (``rn.FusedStage.before``).
      collection: the collection the block reads its state under (linen's ``"batch_stats"``);
        None: the block takes the state as it is (NNX's pure dicts).
      fallback: what a layer whose rebuilt input drifted gets (``rn.FusedStage.fallback``: the
        model's ``drift_fallback``, as its reversible sequence runs it).
    """
    wrap = (lambda c: c) if collection is None else (lambda c: {collection: c})
    unwrap = (lambda new: new) if collection is None else (lambda new: new[collection])

    def layer(p: Any, c: Any, h: Any) -> tuple[Any, Any]:
        y, new = block.forward(p["layers"], wrap(c["layers"]), h)
        return y, {"layers": unwrap(new)}

    def backward(p: Any, c: Any, y: Any, dy: Any) -> tuple[Any, Any, Any]:
        h, dp, dh = block.backward(p["layers"], wrap(c["layers"]), y, dy)
        return h, {"layers": dp}, dh

    return rn.FusedStage(
        key, layer, before=before, backward=backward if reversible else None, fallback=fallback
    )


def remat_name(
    remat: str, *, presets: Mapping[str, Any], model: str, also: Collection[str] = ()
) -> Any:
    """What a remat name stands for on a model: the plan of one of its ``presets`` (None: no
    remat), else a policy name of :data:`POLICY_NAMES`, returned as it is (the library resolves
    it where the model remats). The one reading of a remat name every model shares.

    Args:
      remat: the name.
      presets: the model's presets (``ModelSpec.remat_presets``); a preset wins over a policy
        name of the same spelling (``full``: the model's plan).
      model: how errors call the model.
      also: names the caller reads itself, listed in the error (the transformer's ``custom``).

    Raises:
      ValueError: neither a preset nor a policy name (with the closest names).

    >>> presets = {"none": None, "full": rn.plan({"default": "recompute"})}
    >>> remat_name("full", presets=presets, model="m")
    Plan(...)
    >>> remat_name("dots", presets=presets, model="m")  # handed to nn.remat as it is
    'dots'
    >>> remat_name("dot", presets=presets, model="m")
    Traceback (most recent call last):
    ...
    ValueError: m: unknown remat preset 'dot'. Did you mean 'dots'? Presets: ['none', 'full']; ...
    """
    if remat in presets:
        return presets[remat]
    if remat in POLICY_NAMES:
        return remat
    known = [*presets, *also]
    hint = did_you_mean(remat, [*known, *POLICY_NAMES])
    raise ValueError(
        f"{model}: unknown remat preset {remat!r}.{hint} Presets: {known}; or a remat_nn "
        f"policy name or alias: {list(POLICY_NAMES)}; or a per-name plan {{save: [...], "
        "offload: [...], default: recompute}."
    )


def remat_option(
    remat: Any, *, presets: Mapping[str, Any], model: str, names: Collection[str]
) -> Any:
    """The :class:`remat_nn.Plan`, policy name or None (no remat) a model's ``remat`` option
    stands for.

    The one reading of the option every registered model shares: a name (:func:`remat_name`:
    a preset of the model's ``remat_presets``, ``none`` being no remat, or a policy name such
    as ``dots``), a ``Plan``, or a plan mapping ``{save: [...], offload: [...], recompute:
    [...], default: ...}``. A plan naming an activation the model never produces is refused
    here, before anything is traced: it would silently do nothing.

    Args:
      remat: the option's value (not None: the model decides its own default).
      presets: the model's ``remat_presets``.
      model: the registered name errors call the model by.
      names: the activation names the model produces (what a plan may name).

    Raises:
      ValueError: an unknown name (with the closest names), a bad plan mapping, a plan naming
        an activation the model does not produce, or a value of another type.

    >>> import remat_nn as rn
    >>> presets = {"none": None, "full": rn.plan({"default": "recompute"})}
    >>> str(remat_option("full", presets=presets, model="m", names=["conv_out"]))
    'default=recompute'
    >>> remat_option("dots_no_batch", presets=presets, model="m", names=["conv_out"])
    'dots_no_batch'
    >>> remat_option({"save": ["conv"]}, presets=presets, model="m", names=["conv_out"])
    Traceback (most recent call last):
    ...
    ValueError: m: option remat=<plan save=conv;default=recompute> names ['conv'], which m ...
    """
    if isinstance(remat, str):
        return remat_name(remat, presets=presets, model=model)
    if isinstance(remat, Mapping):
        try:
            remat = rn.plan(remat)
        except rn.PlanError as e:
            raise ValueError(f"{model}: option remat: {e}") from None
    if not isinstance(remat, rn.Plan):
        raise ValueError(
            f"{model}: option remat must be a preset name ({', '.join(presets)}), a remat_nn "
            f"policy name, a plan mapping or a remat_nn.Plan; got {type(remat).__name__} "
            f"{remat!r}. Fix: e.g. remat='full'."
        )
    unknown = [n for n in remat.names if n not in names]
    if unknown:
        raise ValueError(
            f"{model}: option remat=<plan {remat}> names {unknown}, which {model} never produces, "
            f"so the plan would silently do nothing for them. Its named activations: "
            f"{sorted(names)}. Fix: name those, or use a preset ({', '.join(presets)})."
        )
    return remat


def check_scan_levels(levels: Any, where: str) -> None:
    """Refuses a ``scan_levels`` option that is not None or an int >= 1; ``where`` prefixes the
    message (e.g. ``"ResNet: "``)."""
    if levels is not None and (
        isinstance(levels, bool) or not isinstance(levels, int) or levels < 1
    ):
        raise ValueError(
            f"{where}scan_levels must be an int >= 1 (1: one checkpointed scan; 2: sqrt(depth) "
            f"nesting) or None, got {type(levels).__name__} {levels!r}. Fix: scan_levels=2."
        )


def at_least_float32(dtype: Any) -> Any:
    """The dtype of a model's heads and softmaxes: bfloat16 and float16 widened to float32,
    float32 and float64 as they are (a float64 model stays float64 to its logits).

    >>> at_least_float32(jnp.bfloat16), at_least_float32(jnp.float64)
    (dtype('float32'), dtype('float64'))
    """
    return jnp.promote_types(dtype, jnp.float32)


def nested_save_every(n: int, scan_levels: int | None) -> int | None:
    """The fused step's ``save_every`` for a stack of ``n`` units nested as the model nests them:
    with ``scan_levels: 2`` the inputs of every k-th unit (k the nesting's inner length); else
    None, every unit's input (one checkpointed scan, ``scan_levels`` None or 1, saves them all).

    >>> nested_save_every(16, 2), nested_save_every(16, 1), nested_save_every(16, None)
    (4, None, None)
    """
    return rn.remat_scan_lengths(n, 2)[1] if scan_levels == 2 else None


def fused_unit_plan(plan: Any) -> Any:
    """The plan a stacked unit runs under in the fused step's backward: none for a plan (or
    policy name) that saves nothing. The fused step recomputes each unit from its saved input
    and finishes that recomputation before the unit's backward starts; the plain unit's VJP is
    exactly that recomputation, while under remat its forward would run inside the backward,
    unsequenced.

    >>> full = rn.plan({"default": "recompute"})
    >>> fused_unit_plan(full), fused_unit_plan(None), fused_unit_plan(rn.plan({"save": ["q"]}))
    (None, None, Plan(...))
    >>> fused_unit_plan("nothing_saveable"), fused_unit_plan("dots")
    (None, 'dots')
    """
    if isinstance(plan, str):  # "none", or a policy name resolved by the library
        saves_nothing = plan == "none" or rn.policy(plan) is rn.policy("nothing_saveable")
        return None if saves_nothing else plan
    return None if isinstance(plan, rn.Plan) and plan.saves_nothing else plan


def nesting_holds_fewer(n: int, levels: int = 2) -> bool:
    """Whether a nested scan of ``n`` steps at ``levels`` holds fewer step inputs than one scan
    (``sum`` of :func:`remat_nn.remat_scan_lengths` below ``n``): where a model's nested form
    can beat its plain scan on memory, so it is worth offering to the budget planner.

    >>> nesting_holds_fewer(4), nesting_holds_fewer(17)
    (False, True)
    """
    return sum(rn.remat_scan_lengths(n, levels)) < n
