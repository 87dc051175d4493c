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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import flax.linen as fnn
import pydantic

__all__ = ["REGISTRY", "ModelSpec", "build", "get", "register"]


@dataclass(frozen=True)
class ModelSpec:
    """How to build one registered model.

    Attributes:
      build: ``build(**options) -> flax.linen.Module``; options validated by ``options`` first.
      options: pydantic model of the constructor's options (unknown keys rejected).
      task: ``"classify"`` or ``"lm"`` (see the module docstring for the calling convention).
      doc: one line shown by ``python -m models.summary --list``.
      remat_presets: the preset names the model's ``remat`` option takes, each mapped to its
        :class:`remat_nn.Plan` (None: no remat). A model with a ``remat`` option also takes a
        ``Plan`` there directly, or refuses one with an error naming the model and the option.
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


def _load_builtin() -> None:
    # Importing the model files registers them; done lazily so `import models` stays cheap and
    # a model file may import `models` itself.
    import importlib

    for mod in _BUILTIN_MODULES:
        importlib.import_module(mod)


# Model files that register themselves on import (each appends its own name here).
_BUILTIN_MODULES: list[str] = ["models.revnet", "models.transformer"]
