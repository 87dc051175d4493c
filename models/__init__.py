"""Reference models, by name.

The registry is the contract between ``models`` and ``train``: a name maps to a
:class:`ModelSpec` holding a constructor, the pydantic schema of its options and its task.

Calling conventions (every registered module follows one):
  - ``task="classify"``: ``module.apply(variables, images, train=bool, rngs=...)`` with images
    (B, H, W, C) float32 in [0, 1]-ish, returns logits (B, num_classes). When ``train=True`` and
    the model has BatchNorm, pass ``mutable=["batch_stats"]``.
  - ``task="lm"``: ``module.apply(variables, tokens, train=bool, rngs=...)`` with int32 tokens
    (B, T), returns logits (B, T, vocab_size).
  - ``task="regress"``: ``module.apply(variables, features, train=bool, rngs=...)`` with float32
    features (B, F), returns predictions (B, num_outputs) (tabular data; ``model.module`` only).

Your own model, without editing this package (``model.module`` in a config, see README "Train
your model"): ``model.module: my_package.my_model:build`` names a callable in a module importable
from the working directory or ``PYTHONPATH`` — a function or a ``flax.linen.Module`` class — and
``model.task`` (default ``classify``) its task. The contract, all of it:

  - ``build(**model.options)`` returns a ``flax.linen.Module`` following the calling convention
    of its task above (it may ignore ``train`` and ``rngs``, but must accept ``train``);
  - its keyword parameters are its options: an unknown option is an error, a parameter without
    a default is required, ``**kwargs`` takes anything;
  - parameters named ``num_classes``, ``vocab_size``, ``image_size``, ``in_channels``,
    ``num_outputs`` are filled
    from the data when the config leaves them out, ``dtype`` from ``train.compute_dtype``;
  - a parameter named ``remat`` receives the config's ``remat:``, resolved: ``"none"`` (no
    remat), a policy name or alias (``"full"``, ``"dots"``, ...: :data:`MODULE_REMAT_PRESETS`)
    or a :class:`remat_nn.Plan` (a plan mapping, or the plan ``{policy: auto}`` chose). Hand it
    to ``remat_nn.nn.remat(Block, policy=remat)`` (or ``remat_nn.nnx.remat``), which takes all
    of them (``"none"`` returns ``Block`` itself) and keeps the parameter tree the same whatever
    the value. Without a ``remat`` parameter, ``remat:`` must stay unset.

:func:`from_module` turns the reference into a :class:`ModelSpec`; what cannot be used (no colon,
a module that does not import, a missing attribute, something not callable, a non-Module result)
raises :class:`ModuleError` naming ``model.module``, the value and the fix.

>>> spec = from_module("flax.linen:Dense", task="classify")
>>> sorted(spec.options.model_fields)[:3], type(build(spec, features=3)).__name__
(['bias_init', 'dot_general', 'dot_general_cls'], 'Dense')
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import flax.linen as fnn
import pydantic

__all__ = [
    "REGISTRY",
    "LayerStack",
    "ModelSpec",
    "MODULE_REMAT_PRESETS",
    "ModuleError",
    "build",
    "from_module",
    "get",
    "register",
    "remat_option",
]


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
    """

    key: str
    embed: Callable[[Any, Any], Any]
    layer: Callable[[Any, Any], Any]
    head: Callable[[Any, Any], Any]


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
        names or a ``Plan`` (or a plan mapping; :func:`remat_option` reads it for the CNN models,
        the transformer adds ``custom``); the trainer hands the config's ``remat:`` to every
        model through that option.
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
    """

    build: Callable[..., fnn.Module]
    options: type[pydantic.BaseModel]
    task: Literal["classify", "lm", "regress"]
    doc: str = ""
    remat_presets: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    variants: Callable[[Mapping[str, Any]], Mapping[str, Mapping[str, Any]]] | None = None
    layer_stack: Callable[[fnn.Module], LayerStack] | None = None


REGISTRY: dict[str, ModelSpec] = {}


def register(name: str, spec: ModelSpec) -> None:
    """Adds ``spec`` under ``name``; a name registers once."""
    if name in REGISTRY:
        raise ValueError(f"models.register: model {name!r} is already registered.")
    REGISTRY[name] = spec


def get(name: str) -> ModelSpec:
    """Returns the spec registered under ``name``, or a ValueError with the closest names."""
    _load_builtin()
    try:
        return REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, REGISTRY, n=3)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"models.get: unknown model name {name!r}.{hint} Registered: {sorted(REGISTRY)}."
        ) from None


def build(name: str | ModelSpec, **options: Any) -> fnn.Module:
    """Validates ``options`` against the model's schema and builds the module.

    Args:
      name: a registered name, or a :class:`ModelSpec` (e.g. :func:`from_module`'s).
      **options: the model's options.
    """
    spec = name if isinstance(name, ModelSpec) else get(name)
    opts = spec.options.model_validate(options)
    # The validated values as they are: model_dump would turn a remat_nn.Plan (a dataclass) into
    # a dict.
    return spec.build(**dict(opts))


class ModuleError(ValueError):
    """``model.module`` does not name a usable model builder; the message says why and the fix.

    E.g. ``model.module: my_model:build`` when ``my_model.py`` is not on the path, defines no
    ``build``, or its ``build`` returns something other than a ``flax.linen.Module``.
    """


#: Options the trainer fills from the data (and ``dtype`` from ``train.compute_dtype``) when the
#: config leaves them out: a ``model.module`` build may require them without the config naming
#: them.
FROM_DATA = frozenset(
    {"num_classes", "vocab_size", "image_size", "in_channels", "num_outputs", "dtype"}
)

_MODULE_FORM = (
    "'package.module:build', a module importable from the working directory or PYTHONPATH and "
    "the name of a function (or flax.linen.Module class) in it returning a flax.linen.Module"
)


def from_module(ref: str, *, task: Literal["classify", "lm", "regress"] = "classify") -> ModelSpec:
    """The :class:`ModelSpec` of your own model, ``"package.module:build"`` (``model.module``).

    The module is imported (once; Python caches it) and ``build``'s keyword parameters become the
    options schema (see the module docstring for the whole contract).

    Args:
      ref: ``"package.module:build"``.
      task: ``"classify"``, ``"lm"`` or ``"regress"`` (``model.task``).

    Raises:
      ModuleError: ``ref`` is not of that form, the module does not import, it has no such
        attribute, or the attribute is not callable. A ``build`` that returns something other
        than a ``flax.linen.Module`` raises it when the spec builds.

    >>> from_module("flax.linen:relu", task="classify").build(x=1)
    Traceback (most recent call last):
    ...
    models.ModuleError: model.module='flax.linen:relu' returned a ... not a flax.linen.Module...
    """
    where = f"model.module={ref!r}"
    mod_name, colon, attr = ref.partition(":")
    if not colon or not mod_name or not attr.isidentifier():
        raise ModuleError(
            f"{where} is not of the form {_MODULE_FORM}. Fix: e.g. "
            f"model.module=my_package.my_model:build"
        )
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is None or not mod_name.startswith(e.name):
            raise  # the user's module imports something missing: its own traceback says what
        raise ModuleError(
            f"{where}: cannot import {mod_name!r} ({e}). Fix: run from the directory that "
            f"holds {mod_name.split('.')[0]!r} (a .py file or a package directory), or add that "
            "directory to PYTHONPATH"
        ) from None
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and n[0] != "_")
        raise ModuleError(
            f"{where}: module {mod_name!r} ({getattr(module, '__file__', '?')}) has no attribute "
            f"{attr!r}; its callables: {public}. Fix: name one of them after the colon, or "
            f"define {attr}(**options) returning a flax.linen.Module"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise ModuleError(
            f"{where}: {mod_name}.{attr} is a {type(fn).__name__}, not callable. Fix: point at a "
            "function (or flax.linen.Module class) that returns a flax.linen.Module"
        )

    def build_checked(**options: Any) -> fnn.Module:
        # A data-filled parameter the data did not fill: build's own "missing argument" error.
        options = {k: v for k, v in options.items() if not (k in FROM_DATA and v is None)}
        out = fn(**options)
        if not isinstance(out, fnn.Module):
            raise ModuleError(
                f"{where} returned a {type(out).__name__}, not a flax.linen.Module. Fix: make "
                f"{attr} return the module, e.g. `return MyModel(**options)`"
            )
        return out

    return ModelSpec(
        build=build_checked,
        options=_options_schema(fn, ref),
        task=task,
        doc=f"your own model {ref}",
        remat_presets=MODULE_REMAT_PRESETS,
    )


def _module_remat_presets() -> Mapping[str, Any]:
    # Every policy name and alias that takes no arguments, handed to build as given (nn.remat
    # resolves it); "none" (no remat) as the registered models have it.
    import remat_nn as rn

    names = [n for n, e in rn.POLICIES.items() if not e.factory] + list(rn.ALIASES)
    return MappingProxyType({"none": None, **{n: n for n in sorted(names)}})


#: The ``remat:`` names a ``model.module`` build takes: ``none`` and the policy names and aliases
#: of :func:`remat_nn.policy` that take no arguments (``full``, ``dots``, ...).
MODULE_REMAT_PRESETS: Mapping[str, Any] = _module_remat_presets()


def _options_schema(fn: Callable[..., Any], ref: str) -> type[pydantic.BaseModel]:
    # build's keyword parameters as a pydantic model: the names are checked (unknown option,
    # missing required one), the values are build's own business (typed Any).
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: take anything
        params = [inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD)]
    is_module_class = isinstance(fn, type) and issubclass(fn, fnn.Module)
    fields: dict[str, Any] = {}
    extra = "forbid"
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            extra = "allow"
        elif p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise ModuleError(
                f"model.module={ref!r}: parameter {p.name!r} is positional-only, but options are "
                f"passed by keyword. Fix: make it a keyword parameter (drop the / before it)"
            )
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            if is_module_class and p.name in ("parent", "name"):
                continue  # flax's own dataclass fields, not options
            default = None if p.default is p.empty else p.default
            if p.default is p.empty and p.name not in FROM_DATA:  # those the trainer fills
                default = ...
            fields[p.name] = (Any, default)
    config = pydantic.ConfigDict(extra=extra)  # type: ignore[typeddict-item]
    return pydantic.create_model(f"Options[{ref}]", __config__=config, **fields)


def remat_option(
    remat: Any, *, presets: Mapping[str, Any], model: str, names: Collection[str]
) -> Any:
    """The :class:`remat_nn.Plan` (or None: no remat) a model's ``remat`` option stands for.

    The one reading of the option every registered model shares: a preset name of the model's
    ``remat_presets`` (``none`` is no remat), a ``Plan``, or a plan mapping ``{save: [...],
    offload: [...], recompute: [...], default: ...}``. A plan naming an activation the model
    never produces is refused here, before anything is traced: it would silently do nothing.

    Args:
      remat: the option's value (not None: the model decides its own default).
      presets: the model's ``remat_presets``.
      model: the registered name errors call the model by.
      names: the activation names the model produces (what a plan may name).

    Raises:
      ValueError: an unknown preset (with the closest names), a bad plan mapping, a plan naming
        an activation the model does not produce, or a value of another type.

    >>> import remat_nn as rn
    >>> presets = {"none": None, "full": rn.plan({"default": "recompute"})}
    >>> str(remat_option("full", presets=presets, model="m", names=["conv_out"]))
    'default=recompute'
    >>> remat_option({"save": ["conv"]}, presets=presets, model="m", names=["conv_out"])
    Traceback (most recent call last):
    ...
    ValueError: m: option remat=<plan save=conv;default=recompute> names ['conv'], which m ...
    """
    import remat_nn as rn

    if isinstance(remat, str):
        if remat not in presets:
            close = difflib.get_close_matches(remat, list(presets), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{model}: unknown remat preset {remat!r}.{hint} Presets: {list(presets)}; or "
                "a per-name plan {save: [...], offload: [...], default: recompute}."
            )
        return presets[remat]
    if isinstance(remat, Mapping):
        try:
            remat = rn.plan(remat)
        except rn.PlanError as e:
            raise ValueError(f"{model}: option remat: {e}") from None
    if not isinstance(remat, rn.Plan):
        raise ValueError(
            f"{model}: option remat must be a preset name ({', '.join(presets)}), a plan mapping "
            f"or a remat_nn.Plan; got {type(remat).__name__} {remat!r}. Fix: e.g. remat='full'."
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


def nesting_holds_fewer(n: int, levels: int = 2) -> bool:
    """Whether a nested scan of ``n`` steps at ``levels`` holds fewer step inputs than one scan
    (``sum`` of :func:`remat_nn.remat_scan_lengths` below ``n``): where a model's nested form
    can beat its plain scan on memory, so it is worth offering to the budget planner.

    >>> nesting_holds_fewer(4), nesting_holds_fewer(17)
    (False, True)
    """
    import remat_nn as rn

    return sum(rn.remat_scan_lengths(n, levels)) < n


def _load_builtin() -> None:
    # Importing the model files registers them; done lazily so `import models` stays cheap and
    # a model file may import `models` itself.
    import importlib

    for mod in _BUILTIN_MODULES:
        importlib.import_module(mod)


# Model files that register themselves on import (each appends its own name here).
_BUILTIN_MODULES: list[str] = ["models.revnet", "models.transformer", "models.nnx_revnet"]
