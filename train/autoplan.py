"""``remat: {policy: auto, budget: 2GiB}``: the run's remat plan chosen by the budget planner.

The planner (:func:`remat_nn.plan_for_budget`) measures the model's named activations on one
device's batch and picks save / offload / recompute per name so that XLA's temp bytes of the
gradient fit the budget. When no per-name plan of the configured model fits, it falls back on
the model's other forms (its ``variants``: :attr:`models.ModelSpec.variants`, e.g. the
transformer's ``reversible`` and ``nested``, the deep ResNets' ``nested``), each planned on its
own abstract state (a form may change the parameters); the config's ``variants: {label:
{option: value}}`` adds forms or replaces the model's by label, ``{label: null}`` drops one and
``variants: {}`` drops them all. The chosen plan is written to ``RUN_DIR/remat_plan.yaml``
before the first step, with the variant's options when one is chosen (``{plan: {...}, variant:
label, model_options: {...}}``; a bare plan mapping otherwise); the trainer builds the state
(parameters, shardings, optimizer) from the model so chosen, and a resumed run reads the file
back instead of planning again, so it rebuilds the same model and compiles the same step
whatever the planner would choose today.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import yaml

import remat_nn as rn
from train import losses as losses_lib
from train import state as state_lib
from train.errors import SetupError

__all__ = [
    "PLAN_FILE",
    "AutoChoice",
    "AutoRequest",
    "is_auto",
    "load_or_plan",
    "read_choice",
    "request_errors",
]

PLAN_FILE = "remat_plan.yaml"

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


@dataclass(frozen=True)
class AutoChoice:
    """What the planner chose for the run: the plan, and the options of the variant chosen.

    Attributes:
      plan: the remat plan (the model's ``remat`` option, unless the variant sets its own).
      model_options: options to set on the model (a variant's); empty for the model as configured.
      variant: the variant's label, or None.
    """

    plan: rn.Plan
    model_options: Mapping[str, Any]
    variant: str | None = None

    @property
    def policy(self) -> rn.Plan | None:
        """The plan to hand the model: None when the variant sets its own ``remat`` (e.g. the
        reversible transformer's ``none``), which the plan then does not override."""
        return None if "remat" in self.model_options else self.plan

    def to_yaml(self) -> str:
        """The plan file's text: a bare plan mapping, or ``{plan, variant, model_options}``."""
        if self.variant is None:
            return yaml.safe_dump(self.plan.to_dict(), sort_keys=False)
        return yaml.safe_dump(
            {
                "plan": self.plan.to_dict(),
                "variant": self.variant,
                "model_options": dict(self.model_options),
            },
            sort_keys=False,
        )


def read_choice(path: Path) -> AutoChoice:
    """The choice saved in ``path``: either form :meth:`AutoChoice.to_yaml` writes (a bare plan
    mapping is a plan file from before variants: the model as configured)."""
    data = yaml.safe_load(path.read_text())
    if isinstance(data, Mapping) and "model_options" in data:
        return AutoChoice(rn.plan(data["plan"]), dict(data["model_options"]), data.get("variant"))
    return AutoChoice(rn.plan(path), {})


def load_or_plan(
    remat: AutoRequest | Mapping[str, Any],
    *,
    run_dir: Path,
    build: Callable[..., Any],
    abstract_state: Callable[[Mapping[str, Any]], Any],
    batch: dict[str, jax.ShapeDtypeStruct],
    compute_dtype: Any,
    say: Callable[[str], None],
    model_variants: Mapping[str, Mapping[str, Any]] | None = None,
    write: bool = True,
    loss: losses_lib.LossFn = losses_lib.cross_entropy,
) -> AutoChoice:
    """The run's plan (and variant): read from ``run_dir`` if saved there, else planned and saved.

    Args:
      remat: the request (:func:`train.remat.resolve` gives it), or the config's
        ``{policy: auto, budget: ...}`` mapping it is made from.
      run_dir: the run directory.
      build: ``build(policy, overrides) -> module``: the model under a plan, ``"none"`` (no
        remat) or None (its options' own ``remat``), with ``overrides`` (a variant's options,
        ``{}`` for the model as configured) set on its options; e.g.
        ``models.build(name, **train.remat.model_options_with_plan({**options, **o}, policy))``.
        A variant whose options set ``remat`` is built with None (the plan does not apply).
      abstract_state: ``abstract_state(overrides)``: the train state's shapes (``jax.eval_shape``
        of its init: nothing is run) of the model with ``overrides``; a variant is planned on its
        own, so it may change the parameters.
      batch: one device's batch, as shapes.
      compute_dtype: as in the train step.
      say: where the report goes.
      model_variants: the model's own forms (:attr:`models.ModelSpec.variants` of its options);
        the request's ``variants`` add to or replace them (:meth:`AutoRequest.forms`).
      write: save the chosen plan (False for a dry run).
      loss: the :mod:`train.losses` function the run trains with.

    Raises:
      SetupError: a variant's options do not build or do not run, or drop a form the model
        does not offer; or the planner refuses the request (e.g. a budget below every plan and
        form compiled: the message gives the least).
    """
    request = remat if isinstance(remat, AutoRequest) else AutoRequest.from_config(remat)
    path = run_dir / PLAN_FILE
    if path.exists():
        choice = read_choice(path)
        shown = "" if choice.variant is None else f" (variant {choice.variant})"
        say(f"remat plan (auto, from {path}): {choice.plan}{shown}")
        return choice

    loss_of_outputs = loss  # `loss` below is the planned function of the parameters

    def planned(overrides: Mapping[str, Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # The loss of the model with `overrides` under `policy=`, and its abstract arguments.
        fixed = "remat" in overrides  # the form's own plan: the planner's does not apply

        def loss(params, batch_stats, batch, key, *, policy):
            fn = state_lib.make_loss_fn(
                build(None if fixed else policy, overrides),
                compute_dtype=compute_dtype,
                has_batch_stats=has_bn,
                loss=loss_of_outputs,
            )
            return fn(params, batch_stats, batch, key)[0]

        state = abstract_state(overrides)
        has_bn = bool(jax.tree.leaves(state.batch_stats))
        return loss, (state.params, state.batch_stats, batch, jax.random.key(0))

    forms = request.forms(model_variants or {})
    variants = {}
    for label, options in forms.items():
        try:  # traced on shapes: a variant that does not build fails here, not mid-plan
            loss, args = planned(options)
            jax.eval_shape(functools.partial(loss, policy=rn.Plan()), *args)
        except Exception as e:  # pydantic's, flax's and the model's own errors vary
            given = dict(request.variants or ()).get(label) is not None
            fix = (
                f"fix or drop remat.variants.{label} (a form that takes no per-name plan sets "
                "its own remat, e.g. {reversible: true, remat: none})"
                if given
                else f"drop it with remat.variants: {{{label}: null}} (and report it: the model "
                "offers it)"
            )
            raise SetupError(
                f"remat.variants.{label}: the model with options {options} does not build or "
                f"does not run ({type(e).__name__}: {str(e)[:300]}). Fix: {fix}."
            ) from e
        variants[label] = (loss, args)
    if variants:
        say(f"remat auto: forms to fall back on: {', '.join(variants)}")

    # Fixed speeds (not measured ones) keep the choice identical on every process and every
    # rerun; override with remat.flops_per_second / memory_bandwidth. Nothing is timed: the state
    # is abstract here, so the choice is the cost model's.
    loss, args = planned({})
    try:
        report = rn.plan_for_budget(
            loss,
            *args,
            budget=request.budget,
            measure=False,
            log=say,
            variants=variants or None,
            **request.planner_kwargs(),
        )
    except rn.PlanError as e:  # e.g. a budget below every plan and form: a config problem
        raise SetupError(f"remat.budget={request.budget!r}: {e}") from None
    say(f"remat plan (auto, budget {request.budget}):\n{report}")
    options = forms[report.variant] if report.variant else {}
    choice = AutoChoice(report.plan, dict(options), report.variant)
    if choice.policy is None:
        say(f"remat auto: variant {choice.variant} sets remat={options['remat']!r} itself")
    if write and jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        header = "".join(f"# {line}\n" for line in str(report).splitlines())
        tmp = path.with_suffix(".tmp")
        tmp.write_text(header + choice.to_yaml())
        tmp.replace(path)
    return choice
