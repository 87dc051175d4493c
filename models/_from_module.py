"""Your own model as a :class:`ModelSpec`: ``model.module: package.module:build`` in a config.

The contract is in the ``models`` package docstring.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal

import flax.linen as fnn
import pydantic
from flax import nnx

from models._spec import POLICY_NAMES, ModelSpec

__all__ = ["FROM_DATA", "MODULE_REMAT_PRESETS", "ModuleError", "from_module"]


class ModuleError(ValueError):
    """``model.module`` does not name a usable model builder; the message says why and the fix.

    E.g. ``model.module: my_model:build`` when ``my_model.py`` is not on the path, defines no
    ``build``, or its ``build`` returns something other than a ``flax.linen.Module``.
    """

    __module__ = "models"  # its public name, in tracebacks too


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

    nnx_builder = _is_nnx_builder(fn)

    def build_checked(**options: Any) -> fnn.Module:
        # A data-filled parameter the data did not fill: build's own "missing argument" error.
        options = {k: v for k, v in options.items() if not (k in FROM_DATA and v is None)}
        if nnx_builder:  # built by the bridge at init, with the trainer's rngs
            return nnx.bridge.to_linen(fn, **options)
        out = fn(**options)
        if isinstance(out, nnx.Module):
            raise ModuleError(
                f"{where} returned a flax.nnx.Module ({type(out).__name__}) built without the "
                f"trainer's random keys. Fix: give {attr} a parameter `rngs` and build the module "
                f"with it (`def {attr}(..., rngs): return MyModel(..., rngs=rngs)`), or point "
                "model.module at the nnx.Module class itself: the trainer then wraps it with "
                "flax.nnx.bridge.to_linen and initializes it from its seed"
            )
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


#: The ``remat:`` names a ``model.module`` build takes: ``none`` and the policy names and aliases
#: of :func:`remat_nn.policy` that take no arguments (``full``, ``dots``, ...:
#: :data:`models._spec.POLICY_NAMES`, which every registered model takes too), each handed to
#: build as given (``nn.remat`` resolves it).
MODULE_REMAT_PRESETS: Mapping[str, Any] = MappingProxyType(
    {"none": None, **{n: n for n in POLICY_NAMES}}
)


def _is_nnx_builder(fn: Callable[..., Any]) -> bool:
    """An ``nnx.Module`` class, or a function with a parameter ``rngs``: built through
    ``flax.nnx.bridge.to_linen``, which passes it the ``nnx.Rngs`` of the trainer's keys."""
    if isinstance(fn, type):
        return issubclass(fn, nnx.Module)
    try:
        return "rngs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """``fn``'s parameters; an ``nnx.Module`` class's are its ``__init__``'s but ``self`` (NNX's
    metaclass hides them from ``inspect.signature`` of the class)."""
    if isinstance(fn, type) and issubclass(fn, nnx.Module):
        return list(inspect.signature(fn.__init__).parameters.values())[1:]
    return list(inspect.signature(fn).parameters.values())


def _options_schema(fn: Callable[..., Any], ref: str) -> type[pydantic.BaseModel]:
    # build's keyword parameters as a pydantic model: the names are checked (unknown option,
    # missing required one), the values are build's own business (typed Any).
    try:
        params = _parameters(fn)
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
            if p.name == "rngs" and _is_nnx_builder(fn):
                continue  # the bridge passes it
            default = None if p.default is p.empty else p.default
            if p.default is p.empty and p.name not in FROM_DATA:  # those the trainer fills
                default = ...
            fields[p.name] = (Any, default)
    config = pydantic.ConfigDict(extra=extra)  # type: ignore[typeddict-item]
    return pydantic.create_model(f"Options[{ref}]", __config__=config, **fields)
