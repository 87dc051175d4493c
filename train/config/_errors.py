"""ConfigError, and pydantic's validation errors as ``(dotted path, message)`` pairs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic

from remat_nn.errors import closest

__all__ = ["ConfigError", "pydantic_errors"]


class ConfigError(ValueError):
    """A config that does not validate; ``errors`` holds ``(dotted_path, message)`` pairs.

    Example of the wrong config and the fix::

        optim: {lr: -1, momentun: 0.9}     # 2 errors: optim.lr out of range, optim.momentun unknown
        optim: {lr: 0.1, momentum: 0.9}    # fix
    """

    __module__ = "train.config"  # its public home, as tracebacks and doctests show it

    def __init__(self, source: str, errors: Sequence[tuple[str, str]]):
        self.source = source
        self.errors = list(errors)
        n = len(self.errors)
        lines = [f"{source}: {n} error{'s' if n != 1 else ''}"]
        lines += [f"  {path or '<root>'}: {msg}" for path, msg in self.errors]
        super().__init__("\n".join(lines))


def _dotted(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc)


def _one_level_down(model: type[pydantic.BaseModel], loc: Sequence[Any]) -> list[str]:
    # `steps=10` for `train.steps=10`: the key in a section at this level (exactly, else the
    # closest spelling), so a missing section prefix gets its hint.
    key, parent = str(loc[-1]), [*map(str, loc[:-1])]
    sections = {s: _fields_at(model, [*loc[:-1], s, key]) for s in _fields_at(model, loc)}
    for section, fields in sections.items():
        if key in fields:
            return [*parent, section, key]
    for section, fields in sections.items():
        if close := closest(key, fields):
            return [*parent, section, close]
    return []


def _fields_at(model: type[pydantic.BaseModel], loc: Sequence[Any]) -> list[str]:
    # The field names valid at `loc`'s parent, for did-you-mean hints.
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, pydantic.BaseModel)):
            return []
        cls = ann
    return list(getattr(cls, "model_fields", {}))


def pydantic_errors(
    e: pydantic.ValidationError,
    model: type[pydantic.BaseModel],
    prefix: str = "",
) -> list[tuple[str, str]]:
    """``e``'s errors as ``(dotted path, one-line message)``, with did-you-mean for unknown keys.

    Args:
      e: the validation error of ``model``.
      model: the validated model (its fields make the did-you-mean hints).
      prefix: dotted path of ``model`` in the whole config (``model.options``).
    """
    out = []
    for err in e.errors(include_url=False):
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        path = ".".join(filter(None, [prefix, _dotted(loc)]))
        if err["type"] == "extra_forbidden":
            close = closest(str(loc[-1]), _fields_at(model, loc))
            here = [*map(str, loc[:-1]), close] if close else _one_level_down(model, loc)
            hint = f" did you mean {'.'.join(here)!r}?" if here else ""
            known = ", ".join(_fields_at(model, loc))
            out.append((path, f"unknown key;{hint} known keys: {known}"))
            continue
        msg = err["msg"].removeprefix("Value error, ")
        # Values as YAML gives them are echoed; objects (a remat_nn.Plan) are named by the message.
        got = err.get("input")
        yaml_value = type(got).__module__ in ("builtins", "datetime")
        scalar = yaml_value and not isinstance(got, dict | list)
        if loc and "input" in err and scalar and err["type"] not in ("missing", "model_type"):
            msg += f" (got {err['input']!r})"
        out.append((path, msg))
    return out
