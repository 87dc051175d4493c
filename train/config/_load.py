"""``load_config``: a YAML file plus overrides, validated by the schema and the cross-checks."""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from train.config._checks import cross_section_errors, registry_errors, registry_inputs
from train.config._errors import ConfigError, pydantic_errors
from train.config._schema import Config
from train.config._yaml import apply_overrides, read_text, read_yaml

__all__ = ["dump_config", "load_config"]


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Reads ``path`` (YAML; None for the defaults), applies overrides and validates.

    Args:
      path: the YAML file.
      overrides: ``key.sub=value`` strings, applied in order.

    Returns:
      The validated :class:`Config`; ``name`` defaults to the file's stem.

    Raises:
      ConfigError: every problem found, each with its dotted path.
    """
    source = str(path) if path is not None else "<defaults>"
    tree: Any = {}
    errors: list[tuple[str, str]] = []
    if path is not None:
        p = Path(path)
        tree, errors = read_yaml(read_text(p, source), source, wants_string=wants_string)
        if tree is None:
            empty = (
                "the file holds no settings (it is empty or only comments). Fix: write the "
                "sections to change (model:, data:, optim:, ...), or omit --config to run with "
                "the defaults"
            )
            raise ConfigError(source, [("", empty)])
        if not isinstance(tree, dict):
            not_sections = (
                "the top level must be a mapping of sections (model:, data:, optim:, ...), got "
                f"a {type(tree).__name__}"
            )
            raise ConfigError(source, [("", not_sections)])
        tree.setdefault("name", p.stem)
    errors += apply_overrides(tree, overrides, wants_string=wants_string)
    # A value already reported (a duplicate key, `yes`, `010`) is not reported again by the schema.
    reported = {p for p, _ in errors}
    cfg = None
    try:
        cfg = Config.model_validate(tree)
    except pydantic.ValidationError as e:
        found = pydantic_errors(e, Config)
        errors += [err for err in found if err[0] not in reported]
    errors += registry_errors(*registry_inputs(tree, cfg))
    if cfg is not None:
        errors += cross_section_errors(cfg)
    if errors or cfg is None:
        raise ConfigError(source, errors or [("", "invalid config")])
    return cfg


def wants_string(path: str) -> bool:
    """Whether the schema's setting at ``path`` (dotted) takes a string and not a boolean: where
    ``on`` / ``off`` / ``yes`` / ``no`` can only mean the string (``train.progress: on``).

    >>> wants_string("train.progress"), wants_string("train.plot"), wants_string("model.options.x")
    (True, False, False)
    """
    model: Any = Config
    annotation: Any = None
    for part in path.split("."):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False  # free-form (model.options, a plan) or unknown: no reading is assumed
        annotation = fields[part].annotation
        model = annotation
    leaves = _leaf_types(annotation)
    return bool(leaves) and bool not in leaves and all(t is str for t in leaves)


def _leaf_types(annotation: Any) -> list[Any]:
    # The types a field's value may have: Literal["a", "b"] -> [str, str], str | None -> [str].
    if annotation is None or annotation is type(None):
        return []
    if typing.get_origin(annotation) is typing.Literal:
        return [type(v) for v in typing.get_args(annotation)]
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [t for a in args for t in _leaf_types(a)]
    return [annotation]


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (what ``config.yaml`` in the run directory holds)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
