"""Cross-checks of a config against the model registry, run after (and beside) the schema.

The model name must be registered and its options pass the model's own schema; the top-level
``remat`` must be something the model takes (a preset it has, a valid per-name plan, or the
``policy: auto`` form with valid keys, as :func:`train.config.parse_remat` read it); the data
source must fit the model's task and ``data.seq_len`` its ``max_len``.
"""

from __future__ import annotations

from typing import Any

import pydantic

from remat_nn.errors import did_you_mean
from train.config._errors import pydantic_errors
from train.config._remat import RematRequest, parse_remat
from train.config._schema import Config, Model
from train.config._sources import sources_fitting

__all__ = ["cross_section_errors", "registry_errors", "registry_inputs"]


def _remat_errors(
    model: Model, fields: Any, request: RematRequest | None, problems: list[tuple[str, str]]
) -> tuple[Any, list[tuple[str, str]]]:
    # What the model's `remat` option receives from the top-level `remat` (None: nothing), and
    # the errors of the top-level value itself (its own problems: `problems`).
    import remat_nn as rn

    if not problems and (request is None or request.key != "remat"):
        return None, []  # no top-level remat: the model's own option is its schema's to check
    errors: list[tuple[str, str]] = []
    if "remat" not in fields:
        fix = (
            ". Fix: give build a `remat` parameter and pass it to remat_nn.nn.remat(Block, "
            "policy=remat) (README: Train your model), or leave remat unset"
            if model.module
            else ""
        )
        errors.append(("remat", f"model {model.label!r} takes no remat plan option{fix}"))
    elif "remat" in model.options:
        errors.append(("remat", "set either remat or model.options.remat, not both"))
    errors += problems
    if errors or request is None:
        return None, errors
    if request.kind == "auto":
        return rn.plan(), errors  # stands in for the plan the planner will hand the model
    # A preset name: the model's schema resolves it (did-you-mean included).
    return (request.plan if request.kind == "plan" else request.preset), errors


def registry_errors(
    model: Model,
    remat: tuple[RematRequest | None, list[tuple[str, str]]],
    source: str | None,
    seq_len: int | None,
) -> list[tuple[str, str]]:
    """The errors of the model section, the top-level remat and the data against the registry."""
    if not model.label:
        return []  # the model section itself failed; its errors are already listed
    try:
        spec = model.spec()
    except ValueError as e:  # an unknown name, or a model.module that cannot be used
        return [("model.module" if model.module else "model.name", str(e))]
    fields = spec.options.model_fields
    request, problems = remat
    given, errors = _remat_errors(model, fields, request, problems)
    if model.module and isinstance(given, str) and given not in spec.remat_presets:
        hint = did_you_mean(given, spec.remat_presets)
        errors.append(
            (
                "remat",
                f"{given!r} is not a remat_nn policy name.{hint} A model.module takes none, a "
                f"policy name or alias ({', '.join(n for n in spec.remat_presets if n != 'none')})"
                ", a per-name plan {save: [...], offload: [...], default: recompute}, or "
                "{policy: auto, budget: ...}",
            )
        )
    opts = dict(model.options)
    if given is not None:
        opts["remat"] = given
    try:
        spec.options.model_validate(opts)
    except pydantic.ValidationError as e:
        for path, msg in pydantic_errors(e, spec.options, "model.options"):
            whole = path == "model.options" and "remat" in msg  # a check across options
            if given is not None and (path == "model.options.remat" or whole):
                path = "remat"
                if request is not None and request.kind == "auto":
                    msg = f"policy: auto hands the model a remat plan, which it refuses: {msg}"
            errors.append((path, msg))
    allowed = sources_fitting(spec.task)
    if source is not None and source not in allowed:
        errors.append(
            (
                "data.source",
                f"{source!r} does not fit model {model.label!r} (task {spec.task!r}); "
                f"use one of {sorted(allowed)}",
            )
        )
    max_len = opts.get("max_len", getattr(fields.get("max_len"), "default", None))
    if spec.task == "lm" and isinstance(max_len, int) and seq_len and seq_len > max_len:
        errors.append(("data.seq_len", f"{seq_len} exceeds the model's max_len={max_len}"))
    return errors


def registry_inputs(tree: dict[str, Any], cfg: Config | None) -> tuple[Any, ...]:
    """``registry_errors``' arguments, from the validated config or, if it failed, the raw tree.

    The registry checks run even when other sections fail, so all errors show at once.
    """
    if cfg is not None:
        return cfg.model, cfg.remat_parsed, cfg.data.source, cfg.data.seq_len
    try:
        model = Model.model_validate(tree.get("model") or {})
    except pydantic.ValidationError:
        return Model.model_construct(name="", module=None, options={}), (None, []), None, None
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    source = data.get("source", "digits") if isinstance(data.get("source", ""), str) else None
    seq_len = data.get("seq_len", 128) if isinstance(data.get("seq_len", 0), int) else None
    remat = tree.get("remat") if isinstance(tree.get("remat"), str | dict) else None
    return model, parse_remat(remat, model.options), source, seq_len


def cross_section_errors(cfg: Config) -> list[tuple[str, str]]:
    """Values that are valid alone but not together."""
    errors = []
    keep_best = cfg.checkpoint.keep_best
    if keep_best and not cfg.train.eval_every:
        errors.append(
            (
                "checkpoint.keep_best",
                f"{keep_best} needs evaluations to rank checkpoints, but train.eval_every=0 "
                "evaluates only the last step. Fix: set train.eval_every (a multiple of "
                "checkpoint.every), or checkpoint.keep_best=0",
            )
        )
    return errors
