"""``describe_options()``: every config option with its type, default and meaning (``--help``)."""

from __future__ import annotations

import textwrap
import types
import typing
from typing import Any

import pydantic

from train.config._resume import is_resume_safe
from train.config._schema import Config

__all__ = ["describe_options"]

_SAFE = "[resume-safe]"


def _type_name(ann: Any) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " | ".join(map(str, args))
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return "null" if ann is type(None) else getattr(ann, "__name__", str(ann))


def _optional_section(ann: Any) -> type[pydantic.BaseModel] | None:
    # `Section | None` -> Section
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1:
        if isinstance(args[0], type) and issubclass(args[0], pydantic.BaseModel):
            return args[0]
    return None


def describe_options() -> str:
    """Every config option with its type, default and meaning, and whether a resume may change it.

    >>> text = describe_options()
    >>> [line for line in text.splitlines() if line.startswith("  train.s")]
    ['  train.steps: int (default 1000) [resume-safe]', '  train.seed: int (default 0)']
    """
    lines = [
        f"  Options marked {_SAFE} may change when a run resumes from its checkpoints; a change",
        "  to any other is refused (unless --allow-config-change, or --restart).",
    ]

    def walk(model: type[pydantic.BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            shown = "required" if field.is_required() else f"default {default!r}"
            safe = f" {_SAFE}" if is_resume_safe(prefix + name) else ""
            lines.append(f"  {prefix}{name}: {_type_name(ann)} ({shown}){safe}")
            if field.description:
                lines.extend(
                    textwrap.wrap(
                        field.description, 96, initial_indent=" " * 6, subsequent_indent=" " * 6
                    )
                )
            nested = _optional_section(ann)
            if nested is not None:  # an optional section (init_from): its keys too
                walk(nested, f"{prefix}{name}.")

    walk(Config, "")
    return "\n".join(lines)
