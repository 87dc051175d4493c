"""remat_nn: decide, per activation, whether reverse-mode autodiff saves, offloads, recomputes or
reconstructs it by inversion, and measure what each choice costs.

This file is the table of contents: the whole public API, re-exported explicitly. The core
(everything here) is pure JAX and imports no flax; ``remat_nn.nn`` holds the flax.linen modules.

>>> import remat_nn as rn
>>> from remat_nn import nn as rnn
"""

#: The release; pyproject.toml reads it from here.
__version__ = "0.1.0"

# --- names: tag activations -------------------------------------------------------------------
from remat_nn import names
from remat_nn.names import name

# --- errors ---------------------------------------------------------------------------------------
from remat_nn.errors import NotInvertibleError, PlanError, PolicyError, RematNNError

# --- policies and plans ---------------------------------------------------------------------------
from remat_nn._plan import Plan, plan
from remat_nn._policies import ALIASES, POLICIES, policy
from remat_nn._checkpoint import checkpoint
from remat_nn._remat_scan import remat_scan, remat_scan_lengths

# --- memory inspection ----------------------------------------------------------------------------
from remat_nn._memory import (
    CompiledMemory,
    MemoryReport,
    PolicyComparison,
    compare_policies,
    compiled_memory,
    format_bytes,
    memory_report,
)
from remat_nn._peak import Buffer, PeakReport, explain_peak

# --- planning under a memory budget --------------------------------------------------------------
from remat_nn._flops import count_flops, matmul_flops
from remat_nn.planner import PlanReport, parse_budget, plan_for_budget

# --- invertible: memory-free VJPs by reconstruction ---------------------------------------------
from remat_nn.invertible import (
    Guard,
    InversionEntry,
    InversionReport,
    Invertible,
    custom_ivjp,
    inversion_report,
    invertible,
    register_inverse,
)

# --- the optimizer update inside the backward pass ----------------------------------------------
from remat_nn._fused_stages import FusedStage, fused_update_stages
from remat_nn._fused_state import FusedUpdateError
from remat_nn._fused_update import fused_update_step

# --- comparing gradients -------------------------------------------------------------------------
from remat_nn._compare import RelativeError, relative_error

# --- reversible: couplings and drift checks -------------------------------------------------------
from remat_nn._drift import SCOPE as DRIFT_SCOPE
from remat_nn._drift import REPORT_FIELDS as DRIFT_REPORT_FIELDS
from remat_nn._drift import drift_recomputes, report_drift_to
from remat_nn._coupling import (
    ReversibleBlock,
    additive_combine,
    additive_uncombine,
    affine_combine,
    affine_uncombine,
    check_invertible,
    coupling_block,
)
from remat_nn._reversible import inverse_scan, plain_scan, reversible_scan

__all__ = [
    "__version__",
    "FusedStage",
    "FusedUpdateError",
    "fused_update_stages",
    "fused_update_step",
    "ALIASES",
    "POLICIES",
    "CompiledMemory",
    "MemoryReport",
    "Plan",
    "PolicyComparison",
    "checkpoint",
    "compare_policies",
    "compiled_memory",
    "format_bytes",
    "memory_report",
    "Buffer",
    "PeakReport",
    "explain_peak",
    "plan",
    "policy",
    "remat_scan",
    "remat_scan_lengths",
    "PlanReport",
    "count_flops",
    "matmul_flops",
    "parse_budget",
    "plan_for_budget",
    "NotInvertibleError",
    "PlanError",
    "PolicyError",
    "RematNNError",
    "name",
    "names",
    # invertible
    "Guard",
    "InversionEntry",
    "InversionReport",
    "Invertible",
    "custom_ivjp",
    "inversion_report",
    "invertible",
    "register_inverse",
    # comparing gradients
    "RelativeError",
    "relative_error",
    # reversible
    "ReversibleBlock",
    "additive_combine",
    "additive_uncombine",
    "affine_combine",
    "affine_uncombine",
    "check_invertible",
    "coupling_block",
    "DRIFT_REPORT_FIELDS",
    "DRIFT_SCOPE",
    "drift_recomputes",
    "report_drift_to",
    "inverse_scan",
    "plain_scan",
    "reversible_scan",
]
