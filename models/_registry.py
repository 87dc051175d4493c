"""The registry of models by name: :func:`register`, :func:`get`, :func:`build` (and the options
it builds with, :func:`resolve_options`).

The built-in models (:data:`_BUILTIN_MODULES`) are registered at the first :func:`get`, so that
``import models`` stays cheap: each of their files lists its specs in ``SPECS``.
"""

from __future__ import annotations

import importlib
from typing import Any

import flax.linen as fnn

from models._spec import ModelSpec
from remat_nn.errors import did_you_mean

__all__ = ["REGISTRY", "build", "get", "load_builtin", "register", "resolve_options"]


REGISTRY: dict[str, ModelSpec] = {}


def register(name: str, spec: ModelSpec) -> None:
    """Adds ``spec`` under ``name``; a name registers once."""
    if name in REGISTRY:
        raise ValueError(f"models.register: model {name!r} is already registered.")
    REGISTRY[name] = spec


def get(name: str) -> ModelSpec:
    """Returns the spec registered under ``name``, or a ValueError with the closest names."""
    load_builtin()
    try:
        return REGISTRY[name]
    except KeyError:
        hint = did_you_mean(name, REGISTRY, n=3)
        raise ValueError(
            f"models.get: unknown model name {name!r}.{hint} Registered: {sorted(REGISTRY)}."
        ) from None


def resolve_options(name: str | ModelSpec, **options: Any) -> dict[str, Any]:
    """``options`` as the model's build receives them: validated against the model's schema,
    which resolves them too. A registered model's ``remat`` becomes the plan its layers run: a
    preset's ``Plan``, a policy name as it is, ``"none"`` for no remat, and unset, the plan
    of the model's default.

    Args:
      name: a registered name, or a :class:`ModelSpec` (e.g. :func:`from_module`'s).
      **options: the model's options.

    >>> str(resolve_options("resnet32", scan_units=True, scan_levels=2)["remat"])
    'default=recompute'
    >>> resolve_options("resnet32", remat="none", scan_units=True, scan_levels=2)["remat"]
    'none'
    """
    spec = name if isinstance(name, ModelSpec) else get(name)
    # The validated values as they are: model_dump would turn a remat_nn.Plan (a dataclass) into
    # a dict.
    return dict(spec.options.model_validate(options))


def build(name: str | ModelSpec, **options: Any) -> fnn.Module:
    """Validates ``options`` against the model's schema and builds the module
    (:func:`resolve_options`, then the spec's ``build``).

    Args:
      name: a registered name, or a :class:`ModelSpec` (e.g. :func:`from_module`'s).
      **options: the model's options.
    """
    spec = name if isinstance(name, ModelSpec) else get(name)
    return spec.build(**resolve_options(spec, **options))


# The model files whose ``SPECS`` (name -> ModelSpec) are registered at the first get().
_BUILTIN_MODULES = ("models.resnet", "models.revnet", "models.transformer", "models.nnx_revnet")
_loaded: set[str] = set()


def load_builtin() -> None:
    """Registers the built-in models (once): what :func:`get` does before looking a name up."""
    for mod in _BUILTIN_MODULES:
        if mod in _loaded:
            continue
        specs = importlib.import_module(mod).SPECS
        _loaded.add(mod)
        for name, spec in specs.items():
            register(name, spec)
