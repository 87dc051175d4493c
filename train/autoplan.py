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
from train import multihost
from train import state as state_lib
from train.config import AutoRequest
from train.durable import write_text
from train.errors import SetupError

__all__ = ["PLAN_FILE", "AutoChoice", "load_or_plan", "read_choice"]

PLAN_FILE = "remat_plan.yaml"


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
    mapping, written when no variant is chosen: the model as configured)."""
    data = yaml.safe_load(path.read_text())
    if isinstance(data, Mapping) and "model_options" in data:
        return AutoChoice(rn.plan(data["plan"]), dict(data["model_options"]), data.get("variant"))
    return AutoChoice(rn.plan(path), {})


def load_or_plan(
    request: AutoRequest,
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
      request: the config's ``{policy: auto, budget: ...}`` request (:func:`train.remat.resolve`
        gives it).
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
    path = run_dir / PLAN_FILE
    if path.exists():
        choice = read_choice(path)
        shown = "" if choice.variant is None else f" (variant {choice.variant})"
        say(f"remat plan (auto, from {path}): {choice.plan}{shown}")
        return choice
    planned = functools.partial(
        _form_loss,
        build=build,
        abstract_state=abstract_state,
        batch=batch,
        compute_dtype=compute_dtype,
        loss=loss,
    )
    forms = request.forms(model_variants or {})
    variants = {
        label: _checked_form(label, options, request, planned) for label, options in forms.items()
    }
    if variants:
        say(f"remat auto: forms to fall back on: {', '.join(variants)}")
    # Fixed speeds (not measured ones) keep the choice identical on every process and every
    # rerun; override with remat.flops_per_second / memory_bandwidth. Nothing is timed: the state
    # is abstract here, so the choice is the cost model's.
    fn, args = planned({})
    try:
        report = rn.plan_for_budget(
            fn,
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
    if write and multihost.is_main():
        _write_plan(path, report, choice)
    return choice


def _form_loss(
    overrides: Mapping[str, Any],
    *,
    build: Callable[..., Any],
    abstract_state: Callable[[Mapping[str, Any]], Any],
    batch: dict[str, jax.ShapeDtypeStruct],
    compute_dtype: Any,
    loss: losses_lib.LossFn,
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    # The loss of the model with `overrides` under `policy=`, and its abstract arguments.
    fixed = "remat" in overrides  # the form's own plan: the planner's does not apply
    state = abstract_state(overrides)
    has_bn = bool(jax.tree.leaves(state.batch_stats))

    def planned(params, batch_stats, batch, key, *, policy):
        fn = state_lib.make_loss_fn(
            build(None if fixed else policy, overrides),
            compute_dtype=compute_dtype,
            has_batch_stats=has_bn,
            loss=loss,
        )
        return fn(params, batch_stats, batch, key)[0]

    return planned, (state.params, state.batch_stats, batch, jax.random.key(0))


def _checked_form(
    label: str,
    options: Mapping[str, Any],
    request: AutoRequest,
    planned: Callable[[Mapping[str, Any]], tuple[Callable[..., Any], tuple[Any, ...]]],
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    # A form to fall back on, traced on shapes: one that does not build fails here, not mid-plan.
    try:
        fn, args = planned(options)
        jax.eval_shape(functools.partial(fn, policy=rn.Plan()), *args)
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
    return fn, args


def _write_plan(path: Path, report: Any, choice: AutoChoice) -> None:
    # The planner's report as a comment above the choice, written durably (temp, fsync, rename).
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "".join(f"# {line}\n" for line in str(report).splitlines())
    write_text(path, header + choice.to_yaml())
