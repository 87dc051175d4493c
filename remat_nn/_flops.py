"""FLOPs counted from a jaxpr: the cost model the planner and the benchmarks share.

XLA's ``cost_analysis()`` counts a ``lax.scan`` body once; this counter multiplies by the trip
count and walks every sub-jaxpr (jit, remat, custom_vjp, cond takes its most expensive branch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from remat_nn._jax_internals import sub_jaxprs

__all__ = ["count_flops", "jaxpr_flops", "matmul_flops"]

# Data movement and bookkeeping: no arithmetic.
_FREE = frozenset(
    """name reshape broadcast_in_dim transpose squeeze expand_dims convert_element_type slice
    dynamic_slice dynamic_update_slice concatenate pad copy copy_p device_put reduce_precision
    select_n iota gather scatter-add scatter stop_gradient pjit jit closed_call remat checkpoint
    custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr scan while cond random_bits random_wrap
    random_unwrap random_seed threefry2x32 optimization_barrier sharding_constraint split""".split()
)


def _dot_flops(eqn: Any) -> int:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    contract = math.prod(lhs[d] for d in lhs_contract)
    return 2 * math.prod(eqn.outvars[0].aval.shape) * contract


def _conv_flops(eqn: Any) -> int:
    rhs = eqn.invars[1].aval.shape
    dn = eqn.params["dimension_numbers"]
    out_features_dim = dn.rhs_spec[0]
    macs_per_output = math.prod(rhs) // rhs[out_features_dim]
    return 2 * math.prod(eqn.outvars[0].aval.shape) * macs_per_output


def jaxpr_flops(jaxpr: Any, *, matmul_only: bool = False) -> int:
    """FLOPs of a jaxpr: 2*MACs for dot_general / conv, one per output element for other
    arithmetic (unless ``matmul_only``), scan bodies times their length."""
    total = 0
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim == "dot_general":
            total += _dot_flops(eqn)
        elif prim == "conv_general_dilated":
            total += _conv_flops(eqn)
        elif prim == "cond":
            total += max(
                jaxpr_flops(b.jaxpr, matmul_only=matmul_only) for b in eqn.params["branches"]
            )
        elif prim not in _FREE and not matmul_only:
            total += sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        if prim == "cond":
            continue
        reps = eqn.params["length"] if prim == "scan" else 1
        for sub in sub_jaxprs(eqn):  # jit, checkpoint, custom_vjp, scan bodies (remat3's too)
            total += reps * jaxpr_flops(sub, matmul_only=matmul_only)
    return total


def count_flops(
    fn: Callable[..., Any], *args: Any, matmul_only: bool = False, **kwargs: Any
) -> int:
    """FLOPs of ``fn(*args, **kwargs)`` counted from its jaxpr (nothing is compiled or run).

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> rn.count_flops(lambda a, b: a @ b, jnp.ones((4, 8)), jnp.ones((8, 16)))
    1024
    """
    return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr, matmul_only=matmul_only)


def matmul_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Only the dot_general / convolution FLOPs of ``fn(*args, **kwargs)``."""
    return count_flops(fn, *args, matmul_only=True, **kwargs)
