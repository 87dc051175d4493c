"""Memory-budget planner: pick save / offload / recompute per named activation under a budget.

The cost model comes from the function itself, measured by compiling it:
  - bytes a name keeps when saved: its residuals under a plan that saves every name
    (:func:`remat_nn.memory_report`; a scan's stack counts every layer);
  - what saving it does to XLA's temp bytes: one compile per name that saves only that name.
    Saved stacks add up, but saving a name also shrinks the working set of the backward pass's
    recomputation, and those shrinkages overlap (the peak is a max, not a sum). So a set ``S`` of
    kept names is predicted at ``floor + sum(stack[n] for n in S) - max(reduction[n] for n in S)``,
    where ``floor`` is the temp with every name recomputed and ``reduction[n]`` comes from the
    single-name compile. (On the transformer benchmark, saving only ``mlp_in`` compiles 31 MiB
    *below* recomputing everything: a model that is affine in saved bytes cannot see that.)
  - time: recomputing a name costs its extra FLOPs (gradient FLOPs with every name but this one
    saved, minus with every name saved; from the jaxpr) at ``flops_per_second``; saving it costs
    writing and reading its bytes at ``memory_bandwidth``; offloading costs ``2 * bytes /
    host_bandwidth``.
The budget bounds device bytes (XLA's ``temp_size_in_bytes``); XLA counts an offloaded value's
host bytes apart (``host_temp_size_in_bytes``, in ``PlanReport.compiled_host_temp_bytes``). A CPU
backend has one memory: no host bytes, and offload is left out.
For each candidate largest reduction the rest is a knapsack over names (device bytes against
time), solved exactly by a Pareto sweep for small problems and greedily beyond: its Pareto front
is the set of candidates. Saving names together interacts in ways no single-name compile shows,
so the additive prediction is corrected by its error at the nearest compiled plan (fewest bytes
of names acting differently, then most kept names shared): a compiled plan measures the
interactions of its names. The fastest candidate whose corrected prediction fits is compiled,
again until one fits, and the next fastest predicted to fit are compiled too; each compile
records the prediction made before it (``Tried.predicted_bytes``, ``PlanReport.
prediction_error``). Every compiled plan that fits stays a candidate. With concrete arguments,
the fastest-modeled few are then raced (shuffled rounds, clearly slower ones dropping out) and
the fastest measured wins: on XLA:CPU, saving cheap-to-recompute activations can cost more time
than recomputing them, which no FLOP count shows, and the candidates differ by less than one
step's timing noise.

References:
  Chen et al. 2016, Training Deep Nets with Sublinear Memory Cost.
  Jain et al. 2020, Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization.
  PyTorch ``torch._functorch.config.activation_memory_budget`` (a knapsack over recomputation).
"""

from remat_nn.planner._budget import parse_budget
from remat_nn.planner._solver import Candidate, NameCost, solve
from remat_nn.planner._report import PlanReport, Tried
from remat_nn.planner._plan_for_budget import plan_for_budget

__all__ = [
    "Candidate",
    "NameCost",
    "PlanReport",
    "Tried",
    "parse_budget",
    "plan_for_budget",
    "solve",
]
