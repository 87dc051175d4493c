"""``remat: {policy: auto, budget: 2GiB}``: the run's remat plan chosen by the budget planner.

The planner (:func:`remat_nn.plan_for_budget`) measures the model's named activations on one
device's batch and picks save / offload / recompute per name so that XLA's temp bytes of the
gradient fit the budget. ``variants: {label: {option: value}}`` lists other forms of the model
(e.g. ``{nested: {scan_levels: 2}}``: the transformer's nested scan) for the planner to fall back
on when no plan of the configured model fits (:func:`remat_nn.plan_for_budget`'s ``variants``);
a variant must keep the model's parameters (the state is built before planning). The chosen plan
is written to ``RUN_DIR/remat_plan.yaml`` before the first step, with the variant's options when
one is chosen (``{plan: {...}, variant: label, model_options: {...}}``; a bare plan mapping
otherwise, as before variants); a resumed run reads it back instead of planning again, so it
keeps the same plan (and the same compiled step) whatever the planner would choose today.
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
    if not isinstance(variants, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Mapping) and v for k, v in variants.items()
    ):
        errors.append(
            (
                "remat.variants",
                "must map a label to the model options of that form, e.g. "
                f"{{nested: {{scan_levels: 2}}}}; got {variants!r}",
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
      variants: ``(label, ((option, value), ...))`` per other form of the model to fall back on.

    >>> AutoRequest.from_config({"policy": "auto", "budget": 0.5}).planner_kwargs()
    {'flops_per_second': 1000000000000.0, 'memory_bandwidth': 100000000000.0}
    """

    budget: str | int | float
    allow: tuple[str, ...] | None = None
    host_bandwidth: float | None = None
    flops_per_second: float = 1e12
    memory_bandwidth: float = 1e11
    variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

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
            variants=tuple(
                (label, tuple(options.items()))
                for label, options in remat.get("variants", {}).items()
            ),
        )

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
      plan: the remat plan (the model's ``remat`` option).
      model_options: options to set on the model (a variant's); empty for the model as configured.
      variant: the variant's label, or None.
    """

    plan: rn.Plan
    model_options: Mapping[str, Any]
    variant: str | None = None

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
    abstract_state: Any,
    batch: dict[str, jax.ShapeDtypeStruct],
    compute_dtype: Any,
    has_batch_stats: bool,
    say: Callable[[str], None],
    write: bool = True,
) -> AutoChoice:
    """The run's plan (and variant): read from ``run_dir`` if saved there, else planned and saved.

    Args:
      remat: the request (:func:`train.remat.resolve` gives it), or the config's
        ``{policy: auto, budget: ...}`` mapping it is made from.
      run_dir: the run directory.
      build: ``build(policy) -> module`` for a plan or ``"none"`` (no remat), and
        ``build(policy, options) -> module`` for a variant (``options`` set on the model's);
        e.g. ``models.build(name, **train.remat.model_options_with_plan(options, policy))``.
      abstract_state: the train state's shapes (nothing is run).
      batch: one device's batch, as shapes.
      compute_dtype: as in the train step.
      has_batch_stats: the model has BatchNorm statistics.
      say: where the report goes.
      write: save the chosen plan (False for a dry run).

    Raises:
      SetupError: a variant's options do not build, or change the model's parameters.
    """
    request = remat if isinstance(remat, AutoRequest) else AutoRequest.from_config(remat)
    path = run_dir / PLAN_FILE
    if path.exists():
        choice = read_choice(path)
        shown = "" if choice.variant is None else f" (variant {choice.variant})"
        say(f"remat plan (auto, from {path}): {choice.plan}{shown}")
        return choice

    def loss_of(make: Callable[[Any], Any]) -> Callable[..., Any]:
        def loss(params, batch_stats, batch, key, *, policy):
            fn = state_lib.make_loss_fn(
                make(policy), compute_dtype=compute_dtype, has_batch_stats=has_batch_stats
            )
            return fn(params, batch_stats, batch, key)[0]

        return loss

    args = (abstract_state.params, abstract_state.batch_stats, batch, jax.random.key(0))
    variants = {}
    for label, options in request.variants:
        loss = loss_of(lambda p, o=dict(options): build(p, o))
        try:  # traced on shapes: a variant with other parameters fails here, not mid-plan
            jax.eval_shape(functools.partial(loss, policy=rn.Plan()), *args)
        except Exception as e:  # flax's errors for missing / reshaped parameters vary
            raise SetupError(
                f"remat.variants.{label}: the model with options {dict(options)} does not build, "
                f"or does not run on the configured model's parameters ({type(e).__name__}: "
                f"{str(e)[:300]}). The "
                "planner plans on the state built before it, so a variant must keep the "
                "parameters (a nested scan does; the reversible transformer does not). Fix: drop "
                f"the variant, or set {dict(options)} under model.options yourself."
            ) from e
        variants[label] = (loss, args)

    # Fixed speeds (not measured ones) keep the choice identical on every process and every
    # rerun; override with remat.flops_per_second / memory_bandwidth. Nothing is timed: the state
    # is abstract here, so the choice is the cost model's.
    report = rn.plan_for_budget(
        loss_of(build),
        *args,
        budget=request.budget,
        measure=False,
        log=say,
        variants=variants or None,
        **request.planner_kwargs(),
    )
    say(f"remat plan (auto, budget {request.budget}):\n{report}")
    options = dict(request.variants).get(report.variant, ()) if report.variant else ()
    choice = AutoChoice(report.plan, dict(options), report.variant)
    if write and jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        header = "".join(f"# {line}\n" for line in str(report).splitlines())
        tmp = path.with_suffix(".tmp")
        tmp.write_text(header + choice.to_yaml())
        tmp.replace(path)
    return choice
