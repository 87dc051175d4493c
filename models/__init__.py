"""Reference models, by name.

The registry is the contract between ``models`` and ``train``: a name maps to a
:class:`ModelSpec` holding a constructor, the pydantic schema of its options and its task.

Calling conventions (every registered module follows one):
  - ``task="classify"``: ``module.apply(variables, images, train=bool, rngs=...)`` with images
    (B, H, W, C) float32 in [0, 1]-ish, returns logits (B, num_classes). When ``train=True`` and
    the model has BatchNorm, pass ``mutable=["batch_stats"]``.
  - ``task="lm"``: ``module.apply(variables, tokens, train=bool, rngs=...)`` with int32 tokens
    (B, T), returns logits (B, T, vocab_size).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import flax.linen as fnn
import pydantic

__all__ = ["REGISTRY", "ModelSpec", "build", "get", "register", "remat_option"]


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
    """

    build: Callable[..., fnn.Module]
    options: type[pydantic.BaseModel]
    task: Literal["classify", "lm"]
    doc: str = ""
    remat_presets: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


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


def build(name: str, **options: Any) -> fnn.Module:
    """Validates ``options`` against the model's schema and builds the module."""
    spec = get(name)
    opts = spec.options.model_validate(options)
    # The validated values as they are: model_dump would turn a remat_nn.Plan (a dataclass) into
    # a dict.
    return spec.build(**dict(opts))


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


def _load_builtin() -> None:
    # Importing the model files registers them; done lazily so `import models` stays cheap and
    # a model file may import `models` itself.
    import importlib

    for mod in _BUILTIN_MODULES:
        importlib.import_module(mod)


# Model files that register themselves on import (each appends its own name here).
_BUILTIN_MODULES: list[str] = ["models.revnet", "models.transformer"]
