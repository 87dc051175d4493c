"""Which config changes a resumed run may make, read from the schema's :func:`safe_field` marks.

A run resumes only with the config its checkpoints were trained with, except for resume-safe
keys (logging, evaluation and checkpoint cadence, the run's length, multi-process addresses).
Configs are compared in their *effective* form (:func:`resume_view`): what matters of the run's
length is the span of the learning-rate schedule, so extending a finished run (raising
``train.steps`` with ``optim.schedule_steps`` set to the old total) changes nothing unsafe, while
raising ``train.steps`` alone stretches a cosine schedule and shows as
``optim.schedule_steps: <old> -> <new>``.

>>> is_resume_safe("train.log_every"), is_resume_safe("distributed.process_id")
(True, True)
>>> is_resume_safe("optim.lr"), is_resume_safe("model.options.depth"), is_resume_safe("nosuch")
(False, False, False)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pydantic

from train.config._schema import RESUME_SAFE, Config, Optim, Train

__all__ = ["is_resume_safe", "resume_safe_keys", "resume_view"]


def _marked(field: Any) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, Mapping) and bool(extra.get(RESUME_SAFE))


def _section(field: Any) -> type[pydantic.BaseModel] | None:
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel) else None


def is_resume_safe(key: str) -> bool:
    """Whether a resumed run may change the dotted config ``key`` (a leaf, as in a diff).

    A key is safe when its field, or a section holding it, is marked with
    :func:`~train.config.safe_field`; keys the schema does not know (an older run's) are not.
    """
    model: type[pydantic.BaseModel] | None = Config
    for part in key.split("."):
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return False
        if _marked(field):
            return True
        model = _section(field)  # None under a free-form field (model.options, remat)
    return False


def resume_safe_keys() -> list[str]:
    """The resume-safe keys, dotted; a whole section as ``section.*``.

    >>> [k for k in resume_safe_keys() if k.startswith(("train.s", "dist"))]
    ['train.steps', 'distributed.*']
    """
    out: list[str] = []

    def walk(model: type[pydantic.BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sub = _section(field)
            if _marked(field):
                out.append(f"{prefix}{name}.*" if sub is not None else prefix + name)
            elif sub is not None:
                walk(sub, f"{prefix}{name}.")

    walk(Config, "")
    return out


def resume_view(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` (a config as a plain mapping) with the schedule's span made explicit.

    ``optim.schedule_steps`` becomes the steps the learning-rate schedule spans
    (``schedule_steps``, else ``train.steps``), and is dropped when ``optim.schedule`` is
    ``constant`` (the span then changes nothing). Missing keys (an older run's config.yaml) take
    the schema's defaults. ``cfg`` itself is not changed.

    >>> resume_view({"train": {"steps": 8}})["optim"]["schedule_steps"]
    8
    >>> resume_view({"train": {"steps": 12}, "optim": {"schedule_steps": 8}})["optim"]
    {'schedule_steps': 8}
    >>> resume_view({"optim": {"schedule": "constant", "schedule_steps": 8}})["optim"]
    {'schedule': 'constant'}
    """
    out = copy.deepcopy(dict(cfg))
    train, optim = out.get("train", {}), out.setdefault("optim", {})
    if not isinstance(optim, dict) or not isinstance(train, dict):
        return out  # not a config this code wrote; compared as it is
    schedule = optim.get("schedule", Optim.model_fields["schedule"].default)
    span = optim.get("schedule_steps") or train.get("steps", Train.model_fields["steps"].default)
    if schedule == "constant":
        optim.pop("schedule_steps", None)
    else:
        optim["schedule_steps"] = span
    return out
