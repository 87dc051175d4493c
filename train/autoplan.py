"""``remat: {policy: auto, budget: 2GiB}``: the run's remat plan chosen by the budget planner.

The planner (:func:`remat_nn.plan_for_budget`) measures the model's named activations on one
device's batch and picks save / offload / recompute per name so that XLA's temp bytes of the
gradient fit the budget. The chosen plan is written to ``RUN_DIR/remat_plan.yaml`` before the
first step; a resumed run reads it back instead of planning again, so it keeps the same plan
(and the same compiled step) whatever the planner would choose today.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import yaml

import remat_nn as rn
from train import state as state_lib

__all__ = ["PLAN_FILE", "is_auto", "load_or_plan"]

PLAN_FILE = "remat_plan.yaml"


def is_auto(remat: Any) -> bool:
    """Whether a config's ``remat`` asks for the planner."""
    return isinstance(remat, dict) and remat.get("policy") == "auto"


def load_or_plan(
    remat: dict[str, Any],
    *,
    run_dir: Path,
    build: Callable[[Any], Any],
    abstract_state: Any,
    batch: dict[str, jax.ShapeDtypeStruct],
    compute_dtype: Any,
    has_batch_stats: bool,
    say: Callable[[str], None],
    write: bool = True,
) -> rn.Plan:
    """The run's plan: read from ``run_dir`` if saved there, else planned and saved.

    Args:
      remat: the config's ``{policy: auto, budget: ...}`` mapping (budget as in
        :func:`remat_nn.parse_budget`, e.g. ``2GiB`` or ``0.5`` of the no-remat memory;
        optional ``allow``, ``host_bandwidth``, ``flops_per_second`` and ``memory_bandwidth``).
      run_dir: the run directory.
      build: ``build(policy) -> module`` for a plan or ``"none"`` (no remat).
      abstract_state: the train state's shapes (nothing is run).
      batch: one device's batch, as shapes.
      compute_dtype: as in the train step.
      has_batch_stats: the model has BatchNorm statistics.
      say: where the report goes.
      write: save the chosen plan (False for a dry run).
    """
    path = run_dir / PLAN_FILE
    if path.exists():
        the_plan = rn.plan(path)
        say(f"remat plan (auto, from {path}): {the_plan}")
        return the_plan

    def loss(params, batch_stats, batch, key, *, policy):
        fn = state_lib.make_loss_fn(
            build(policy), compute_dtype=compute_dtype, has_batch_stats=has_batch_stats
        )
        return fn(params, batch_stats, batch, key)[0]

    # Fixed speeds (not measured ones) keep the choice identical on every process and every
    # rerun; override with remat.flops_per_second / memory_bandwidth. Nothing is timed: the state
    # is abstract here, so the choice is the cost model's.
    kwargs = {k: remat[k] for k in ("allow", "host_bandwidth") if k in remat}
    kwargs["flops_per_second"] = float(remat.get("flops_per_second", 1e12))
    kwargs["memory_bandwidth"] = float(remat.get("memory_bandwidth", 1e11))
    report = rn.plan_for_budget(
        loss,
        abstract_state.params,
        abstract_state.batch_stats,
        batch,
        jax.random.key(0),
        budget=remat["budget"],
        measure=False,
        log=say,
        **kwargs,
    )
    say(f"remat plan (auto, budget {remat['budget']}):\n{report}")
    if write and jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        header = "".join(f"# {line}\n" for line in str(report).splitlines())
        tmp = path.with_suffix(".tmp")
        tmp.write_text(header + yaml.safe_dump(report.plan.to_dict(), sort_keys=False))
        tmp.replace(path)
    return report.plan
