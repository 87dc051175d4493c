"""The run's remat plan: the config's request resolved against the model, once.

A config names the plan at the top level (``remat:``) or, for the transformer, as the model's own
option (``model.options.remat``, with ``custom_plan`` for ``custom``), in one of three forms, which
the config parses once into a :class:`train.config.RematRequest` (``cfg.remat_request``):

- a preset name of the model (``full``, ``minimal``, ...; ``none`` is no remat), looked up in the
  model's ``remat_presets`` (the registry, :class:`models.ModelSpec`), or a remat_nn policy name
  or alias (``dots``, ...), which every model takes (:func:`models.remat_name` reads both);
- a per-name plan ``{save: [...], offload: [...], recompute: [...], default: recompute}``;
- ``{policy: auto, budget: 2GiB, ...}``: a plan chosen by the budget planner at the start of the
  run (:class:`train.config.AutoRequest`, :func:`train.autoplan.load_or_plan`).

:func:`resolve` gives a ``Plan``, :data:`NO_REMAT`, an ``AutoRequest`` or None (the config names
no plan: the model's default stands); :func:`model_options_with_plan` hands the plan to the model
as its ``remat`` option (every model takes a ``Plan`` there, or refuses one naming itself);
:func:`check_offload` warns (or refuses) when a plan offloads on a CPU backend; :func:`plan_line`
is the ``remat plan:`` line the run log and the dry run print: the plan the model runs.

>>> from train.config import load_config
>>> cfg = load_config(None, ["model.name=transformer", "data.source=corpus",
...                          "remat={save: [query_proj], offload: [mlp_hidden]}"])
>>> plan = resolve(cfg.remat_request, cfg.model.spec())
>>> str(plan)
'save=query_proj;offload=mlp_hidden;default=recompute'
>>> model_options_with_plan({"d_model": 64}, plan) == {"d_model": 64, "remat": plan}
True
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import jax

import models
import remat_nn as rn
from train.config import AutoRequest, RematRequest
from train.errors import SetupError

if TYPE_CHECKING:
    from train.autoplan import AutoChoice

__all__ = ["NO_REMAT", "check_offload", "model_options_with_plan", "plan_line", "resolve"]

#: No remat at all (plain autodiff): the preset ``none``, and what the budget planner passes for
#: its no-remat candidate.
NO_REMAT: Literal["none"] = "none"


def resolve(
    request: RematRequest, spec: models.ModelSpec, *, model: str | None = None
) -> rn.Plan | Literal["none"] | str | AutoRequest | None:
    """What the model is built with under ``request``: the one preset lookup of the trainer.

    Args:
      request: the config's request (``cfg.remat_request``; a plan in it is parsed already).
      spec: the model's registry entry (``cfg.model.spec()``), whose ``remat_presets`` name the
        presets.
      model: how errors call the model (``cfg.model.label``).

    Returns:
      The :class:`remat_nn.Plan`; :data:`NO_REMAT` for the preset ``none``; a policy name
      (``str``, e.g. ``dots``: the model hands it to ``nn.remat``, which resolves it); the
      :class:`~train.config.AutoRequest` for ``{policy: auto, ...}`` (plan it with
      :func:`train.autoplan.load_or_plan`); None when the config names no plan (the model's
      default plan stands).

    Raises:
      ValueError: neither a preset of the model nor a policy name (a config not loaded by
        ``load_config``, which checks it against the model).

    >>> from train.config import load_config
    >>> cfg = load_config(None, ["model.name=transformer", "data.source=corpus",
    ...                          "remat=save_qkv_proj"])
    >>> resolve(cfg.remat_request, cfg.model.spec()).save
    ('query_proj', 'key_proj', 'value_proj')
    >>> cfg = load_config(None, ["model.name=transformer", "data.source=corpus", "remat=dots"])
    >>> resolve(cfg.remat_request, cfg.model.spec())
    'dots'
    >>> cfg = load_config(None, ["remat=null"])
    >>> resolve(cfg.remat_request, cfg.model.spec()) is None
    True
    """
    if request.kind != "preset":
        return {"default": None, "plan": request.plan, "auto": request.auto}[request.kind]
    assert request.preset is not None  # a preset request names one
    named = "the model" if model is None else f"model {model!r}"
    plan = models.remat_name(request.preset, presets=spec.remat_presets, model=named)
    return NO_REMAT if plan is None else plan


def model_options_with_plan(
    options: Mapping[str, Any], plan: rn.Plan | str | AutoRequest | None
) -> dict[str, Any]:
    """``options`` with ``plan`` as the model's ``remat`` option (``custom_plan`` dropped).

    Args:
      options: the model's options.
      plan: what :func:`resolve` or the planner gives: a ``Plan``, :data:`NO_REMAT` or a
        ``model.module``'s policy name replace the model's ``remat``; None or an ``AutoRequest``
        leave the options as they are (the planner plans on the model so built: its parameters
        do not depend on the plan).

    >>> model_options_with_plan({"remat": "custom", "custom_plan": {"save": ["x"]}}, "none")
    {'remat': 'none'}
    """
    opts = dict(options)
    if plan is None or isinstance(plan, AutoRequest):
        return opts
    opts.pop("custom_plan", None)
    opts["remat"] = plan
    return opts


def check_offload(plan: Any, mode: str, say: Callable[[str], None]) -> None:
    """Warns once (or refuses) when ``plan`` offloads to host memory on a CPU backend.

    Host offload lowers and runs on CPU but moves nothing there (XLA:CPU has one memory), so the
    run would show no memory saving.

    Args:
      plan: the run's plan (anything but a ``Plan`` with ``offload`` names passes).
      mode: ``train.offload_on_cpu``: ``warn`` (a RuntimeWarning and a log line) or ``error``.
      say: where the log line goes.

    Raises:
      SetupError: ``mode == "error"`` and the plan offloads on CPU.
    """
    if not isinstance(plan, rn.Plan) or not plan.offload or jax.default_backend() != "cpu":
        return
    msg = (
        f"remat plan offloads {list(plan.offload)} to {plan.offload_dst}, but the cpu backend "
        "has a single memory: the program runs with the same gradients and nothing moves, so "
        "expect no memory saving here (set train.offload_on_cpu=error to refuse)"
    )
    if mode == "error":
        raise SetupError(f"{msg.split(' (set')[0]}. Fix: run on GPU/TPU, or save those names.")
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    say(f"warning: {msg}")


def plan_line(
    request: RematRequest, runs: Any, presets: Mapping[str, Any], choice: AutoChoice | None = None
) -> str:
    """The ``remat plan:`` line of the run log and the dry run: the plan the model runs.

    Args:
      request: the config's request (``cfg.remat_request``).
      runs: the model's ``remat`` option as its build received it (:func:`models.resolve_options`:
        a registered model's default resolved too): a ``Plan``, :data:`NO_REMAT`, a policy name;
        None for a ``model.module`` that takes none or leaves it to its own default.
      presets: the model's ``remat_presets``: a plan equal to one is called by its name.
      choice: ``{policy: auto}``: the planner's choice, whose model form (if not the model as
        configured) is said after the plan.

    >>> from train.config import RematRequest
    >>> presets = {"none": None, "full": rn.plan({"default": "recompute"})}
    >>> plan_line(RematRequest(), presets["full"], presets)
    'remat plan: full (the model default)'
    >>> plan_line(RematRequest(kind="preset", preset="none", key="remat", shown="none"), "none", {})
    'remat plan: none'
    >>> plan_line(RematRequest(), None, {})  # a model.module given no remat: its own
    "remat plan: the module's own (remat: not set)"
    """
    if request.kind == "auto":  # the planner's plan, as its plan file holds it
        form = ""
        if choice is not None and choice.variant:
            form = f" (form {choice.variant}: {dict(choice.model_options)})"
        return f"remat plan: {request.shown} -> {runs}{form}"
    named = next((k for k, v in presets.items() if v is not None and v == runs), None)
    name = "(the model default)" if runs is None else named or str(runs)
    if request.kind == "default":
        if runs is None:  # nothing to name: the module remats as its own code says
            return "remat plan: the module's own (remat: not set)"
        return f"remat plan: {name} (the model default)"
    return f"remat plan: {request.shown}" + ("" if name == request.shown else f" -> {name}")
