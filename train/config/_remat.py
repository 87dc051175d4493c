"""The config's remat request, parsed once: :class:`RematRequest`, made by :func:`parse_remat`.

A run names its remat plan at the top level (``remat:``) or, unset there, as the model's own
option (``model.options.remat``; the transformer's ``custom`` with ``custom_plan``): a preset
name, a per-name plan mapping, or ``{policy: auto, budget: ...}`` (:class:`AutoRequest`, checked
by :func:`request_errors`). The request is what the config asks for; :func:`train.remat.resolve`
turns it into what the model gets, against the model's presets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pydantic

import remat_nn as rn
from remat_nn.planner import check_allow
from train.errors import SetupError

__all__ = ["AutoRequest", "RematRequest", "is_auto", "parse_remat", "request_errors"]

_KEYS = (
    "policy",
    "budget",
    "allow",
    "host_bandwidth",
    "flops_per_second",
    "memory_bandwidth",
    "variants",
)
_RATES = ("host_bandwidth", "flops_per_second", "memory_bandwidth")


def is_auto(remat: Any) -> bool:
    """Whether a config's ``remat`` asks for the planner.

    >>> is_auto({"policy": "auto", "budget": "2GiB"}), is_auto({"save": ["query_proj"]})
    (True, False)
    """
    return isinstance(remat, Mapping) and remat.get("policy") == "auto"


def request_errors(remat: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The problems of a ``{policy: auto, ...}`` mapping, as ``(dotted path, message)`` pairs.

    >>> request_errors({"policy": "auto", "budget": "2GiB", "allow": ["save", "offload"]})
    []
    >>> [path for path, _ in request_errors({"policy": "auto", "bugdet": 2})]
    ['remat.bugdet', 'remat.budget']
    """
    errors = [
        (f"remat.{k}", f"unknown key for policy: auto; valid: {sorted(_KEYS)}")
        for k in remat
        if k not in _KEYS
    ]
    if "budget" not in remat:
        errors.append(("remat.budget", "policy: auto needs a budget, e.g. budget: 2GiB or 0.5"))
    else:
        try:
            rn.parse_budget(remat["budget"], reference_bytes=1)
        except (TypeError, ValueError) as e:
            errors.append(("remat.budget", str(e)))
    allow = remat.get("allow", ["save"])
    try:
        check_allow(allow)
    except rn.PlanError:
        hint = ""
        if isinstance(allow, list) and "invert" in allow:
            hint = "; invert is not per name: build a reversible model (model.options.reversible)"
        errors.append(
            ("remat.allow", f"must list 'save' and any of offload, recompute; got {allow!r}{hint}")
        )
    for k in _RATES:
        v = remat.get(k, 1.0)
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            errors.append((f"remat.{k}", f"must be a positive number, got {v!r}"))
    variants = remat.get("variants", {})
    if not isinstance(variants, Mapping):
        errors.append(
            (
                "remat.variants",
                "must map a label to the model options of that form, e.g. {nested: "
                "{scan_levels: 2}}, or be {} (none of the model's forms); "
                f"got {variants!r}",
            )
        )
        return errors
    for label, options in variants.items():
        if not isinstance(label, str) or not (options is None or isinstance(options, Mapping)):
            errors.append(
                (
                    f"remat.variants.{label}",
                    f"must be the model options of that form (e.g. {{scan_levels: 2}}), or null "
                    f"to drop the model's form of that label; got {options!r}",
                )
            )
        elif options is not None and not options:
            errors.append(
                (
                    f"remat.variants.{label}",
                    "is empty: a form with no options is the model as configured. Fix: give its "
                    "options (e.g. {scan_levels: 2}), or null to drop the model's form",
                )
            )
    return errors


@dataclass(frozen=True)
class AutoRequest:
    """``remat: {policy: auto, budget: ...}``: a plan for the budget planner to choose at start.

    Attributes:
      budget: bound on the step's temp memory, as :func:`remat_nn.parse_budget` reads it
        (``"2GiB"``, bytes, or a fraction of the no-remat memory such as ``0.5``).
      allow: the actions the planner may use; None: the planner's default.
      host_bandwidth: bytes per second to host and back, for offload; None: the planner's.
      flops_per_second: recompute speed of the cost model (fixed, not measured: the same
        choice on every process and every rerun).
      memory_bandwidth: bytes per second of a saved value's write and read, likewise fixed.
      variants: the config's ``variants``, as ``(label, ((option, value), ...) or None)``
        pairs: added to (or, by label, replacing; None: dropping) the model's own forms; ``()``
        (``variants: {}``): none at all; None (no ``variants`` key): the model's forms.

    >>> AutoRequest.from_config({"policy": "auto", "budget": 0.5}).planner_kwargs()
    {'flops_per_second': 1000000000000.0, 'memory_bandwidth': 100000000000.0}
    """

    budget: str | int | float
    allow: tuple[str, ...] | None = None
    host_bandwidth: float | None = None
    flops_per_second: float = 1e12
    memory_bandwidth: float = 1e11
    variants: tuple[tuple[str, tuple[tuple[str, Any], ...] | None], ...] | None = None

    @classmethod
    def from_config(cls, remat: Mapping[str, Any]) -> AutoRequest:
        """The request a config's ``{policy: auto, ...}`` mapping makes.

        Raises:
          ValueError: the mapping has problems (:func:`request_errors`), all of them listed.
        """
        problems = request_errors(remat) if is_auto(remat) else [("remat", "not policy: auto")]
        if problems:
            raise ValueError(
                "remat: {policy: auto, ...} is not a valid request: "
                + "; ".join(f"{path}: {msg}" for path, msg in problems)
            )
        return cls._of_checked(remat)

    @classmethod
    def _of_checked(cls, remat: Mapping[str, Any]) -> AutoRequest:
        # The request of a mapping request_errors passed.
        allow = remat.get("allow")
        return cls(
            budget=remat["budget"],
            allow=None if allow is None else tuple(allow),
            host_bandwidth=remat.get("host_bandwidth"),
            flops_per_second=float(remat.get("flops_per_second", 1e12)),
            memory_bandwidth=float(remat.get("memory_bandwidth", 1e11)),
            variants=None
            if "variants" not in remat
            else tuple(
                (label, None if options is None else tuple(options.items()))
                for label, options in remat["variants"].items()
            ),
        )

    def forms(self, model_variants: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """The forms the planner may fall back on: ``model_variants`` (the model's own,
        :attr:`models.ModelSpec.variants`) with the config's ``variants`` added by label.

        Raises:
          SetupError: ``{label: null}`` drops a form the model does not offer.

        >>> own = {"reversible": {"reversible": True}}
        >>> AutoRequest(1, variants=(("nested", (("scan_levels", 2),)),)).forms(own)
        {'reversible': {'reversible': True}, 'nested': {'scan_levels': 2}}
        >>> AutoRequest(1, variants=()).forms(own), AutoRequest(1).forms(own) == own
        ({}, True)
        """
        if self.variants is None:
            return {label: dict(o) for label, o in model_variants.items()}
        if not self.variants:
            return {}
        out = {label: dict(o) for label, o in model_variants.items()}
        for label, options in self.variants:
            if options is not None:
                out[label] = dict(options)
            elif label in out:
                del out[label]
            else:
                raise SetupError(
                    f"remat.variants.{label}: null drops the model's form {label!r}, but the "
                    f"model offers {sorted(model_variants) or 'none'}. Fix: drop that key, or "
                    "give the form's options"
                )
        return out

    def planner_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`remat_nn.plan_for_budget` besides the budget."""
        kwargs: dict[str, Any] = {}
        if self.allow is not None:
            kwargs["allow"] = list(self.allow)
        if self.host_bandwidth is not None:
            kwargs["host_bandwidth"] = self.host_bandwidth
        kwargs["flops_per_second"] = self.flops_per_second
        kwargs["memory_bandwidth"] = self.memory_bandwidth
        return kwargs


class RematRequest(pydantic.BaseModel):
    """The run's remat request: what the config asks for, parsed once (:func:`parse_remat`).

    Not yet resolved against the model: :func:`train.remat.resolve` looks a name up in the
    model's ``remat_presets`` and the library's policy names, and gives what the model is built
    with.

    Attributes:
      kind: ``default`` (no plan named: the model's default stands), ``preset`` (a name: a
        preset of the model or a remat_nn policy name), ``plan`` (a per-name plan) or
        ``auto`` (``{policy: auto, ...}``: the planner chooses).
      preset: ``kind == "preset"``: the name, not checked here (each model has its presets).
      plan: ``kind == "plan"``: the plan mapping (or the transformer's ``custom_plan``), parsed.
      auto: ``kind == "auto"``: the budget planner's request.
      key: where it was written: ``remat`` or ``model.options.remat``; None for ``default``.
      shown: the value as written (``custom`` for the transformer's custom spelling), or
        ``(the model default)``: what the ``remat plan:`` line says the config asked for.

    >>> request, _ = parse_remat({"save": ["query_proj"]}, {})
    >>> request.kind, str(request.plan), request.key
    ('plan', 'save=query_proj;default=recompute', 'remat')
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    kind: Literal["default", "preset", "plan", "auto"] = "default"
    preset: str | None = None
    plan: pydantic.InstanceOf[rn.Plan] | None = None
    auto: pydantic.InstanceOf[AutoRequest] | None = None
    key: Literal["remat", "model.options.remat"] | None = None
    shown: str = "(the model default)"

    @pydantic.model_validator(mode="after")
    def _one_form(self) -> RematRequest:
        given = {f for f in ("preset", "plan", "auto") if getattr(self, f) is not None}
        if given != {self.kind} - {"default"} or (self.key is None) != (self.kind == "default"):
            raise ValueError(f"RematRequest(kind={self.kind!r}) with {sorted(given)} set")
        return self


def parse_remat(
    remat: Any, options: Mapping[str, Any]
) -> tuple[RematRequest | None, list[tuple[str, str]]]:
    """The request a config makes, and the problems of its top-level ``remat``.

    Args:
      remat: the config's ``remat`` (a preset name, a plan mapping, ``{policy: auto, ...}``);
        None: the model's own ``remat`` option in ``options`` is the request.
      options: the config's ``model.options``.

    Returns:
      The request (None when it has problems) and the problems as ``(dotted path, message)``
      pairs. Those of ``model.options`` (a bad ``custom_plan``) are the model schema's to list:
      none here.

    >>> parse_remat(None, {})[0].shown
    '(the model default)'
    >>> parse_remat(None, {"remat": "custom", "custom_plan": {"save": ["context"]}})[0].plan.save
    ('context',)
    >>> [path for path, _ in parse_remat({"policy": "auto"}, {})[1]]
    ['remat.budget']
    """
    if remat is None:
        return _own_option(options), []
    shown = f"{remat}"
    if is_auto(remat):
        errors = request_errors(remat)
        if errors:
            return None, errors
        auto = AutoRequest._of_checked(remat)
        return RematRequest(kind="auto", auto=auto, key="remat", shown=shown), []
    if isinstance(remat, Mapping):
        try:
            plan = rn.plan(remat)
        except rn.PlanError as e:
            return None, [("remat", str(e))]
        return RematRequest(kind="plan", plan=plan, key="remat", shown=shown), []
    return RematRequest(kind="preset", preset=remat, key="remat", shown=shown), []


def _own_option(options: Mapping[str, Any]) -> RematRequest | None:
    # The model's own `remat` option as the request (None: its plan does not parse).
    remat = options.get("remat")
    if remat is None:
        return RematRequest()
    key, shown = "model.options.remat", f"{remat}"
    if remat == "custom" and options.get("custom_plan") is not None:
        remat = options["custom_plan"]  # the transformer's own spelling of a per-name plan
    if isinstance(remat, str):
        return RematRequest(kind="preset", preset=remat, key=key, shown=shown)
    try:
        plan = remat if isinstance(remat, rn.Plan) else rn.plan(remat)
    except (rn.PlanError, TypeError):
        return None
    return RematRequest(kind="plan", plan=plan, key=key, shown=shown)
