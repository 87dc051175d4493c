"""``remat: {policy: auto, budget: ...}``: the request's checks and its typed form.

:func:`request_errors` lists the problems of the config's mapping (run by :func:`load_config`);
:class:`AutoRequest` is the checked request the planner (:mod:`train.autoplan`) receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import remat_nn as rn
from train.errors import SetupError

__all__ = ["AutoRequest", "is_auto", "request_errors"]

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
    if (
        not isinstance(allow, list)
        or "save" not in allow
        or not set(allow) <= set(("save", "offload", "recompute"))
    ):
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
