"""Memory-budget planner: pick save / offload / recompute per named activation under a budget.

:func:`plan_for_budget` builds its cost model from the function itself (compiles with every
name recomputed and with each name saved alone, FLOPs from the jaxpr), solves a knapsack over
names for the Pareto front of device bytes against modeled time (:func:`solve`, no JAX), compiles
candidates until one fits and, with concrete arguments, races the fastest few. The design (the
memory model and its correction, the search, the race) and how well it does: docs/planner.md.

References:
  Chen et al. 2016, Training Deep Nets with Sublinear Memory Cost.
  Jain et al. 2020, Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization.
  PyTorch ``torch._functorch.config.activation_memory_budget`` (a knapsack over recomputation).
"""

from remat_nn.planner._budget import parse_budget
from remat_nn.planner._solver import Candidate, NameCost, solve
from remat_nn.planner._report import PlanReport, Tried
from remat_nn.planner._plan_for_budget import check_allow, plan_for_budget

__all__ = [
    "check_allow",
    "Candidate",
    "NameCost",
    "PlanReport",
    "Tried",
    "parse_budget",
    "plan_for_budget",
    "solve",
]
