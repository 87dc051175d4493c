"""Which dtypes the matmuls of a computation read: the check that bf16 compute is bf16.

``train.compute_dtype=bfloat16`` is meant to run every matmul and convolution of the train step
in bfloat16 while the master weights stay float32. A single float32 operand is enough for JAX
to promote the whole product back to float32 (flax promotes a layer's inputs to the dtype of
its parameters unless told otherwise), so the intent is checked on the jaxpr itself:
:func:`matmul_operand_dtypes` counts ``dot_general`` and ``conv_general_dilated`` equations by
their operands' dtypes. The trainer's ``--dry-run`` prints it for the gradient of the train loss.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import jax

import remat_nn as rn
from remat_nn._jax_internals import sub_jaxprs

__all__ = ["MATMUL_PRIMITIVES", "matmul_operand_dtypes"]

#: The primitives counted: every matmul-like product JAX stages (einsum, @, Dense, DenseGeneral
#: and attend lower to dot_general; Conv to conv_general_dilated).
MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})


def _count(jaxpr: Any, counts: Counter[str]) -> None:
    for eqn in jaxpr.eqns:
        if rn.DRIFT_SCOPE in str(eqn.source_info.name_stack):
            continue  # a reversible stack's drift check: float32 projections by design
        if eqn.primitive.name in MATMUL_PRIMITIVES:
            lhs, rhs = (str(v.aval.dtype) for v in eqn.invars[:2])
            counts[lhs if lhs == rhs else " x ".join(sorted((lhs, rhs)))] += 1
        # scan / while / cond / remat / custom_vjp / pjit bodies: each body counted once where
        # it occurs in the program, not once per loop iteration.
        for sub in sub_jaxprs(eqn):
            _count(sub, counts)


def matmul_operand_dtypes(fn: Callable[..., Any], *args: Any) -> dict[str, int]:
    """Counts the matmuls and convolutions of ``fn(*args)``'s jaxpr by their operands' dtypes.

    Walks into every sub-jaxpr (scan, remat, custom_vjp and jit bodies); an equation counts once
    where it appears in the program, whatever the trip count of the loop around it. Nothing is
    compiled or run: ``args`` may be ``jax.ShapeDtypeStruct``s.

    Args:
      fn: the function to trace, e.g. ``jax.grad(loss)``.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).

    Returns:
      ``{dtype: count}`` sorted by key; an equation whose two operands differ is counted under
      ``"<dtype> x <dtype>"`` (names sorted), e.g. ``"bfloat16 x float32"``.

    >>> import jax, jax.numpy as jnp
    >>> w = jnp.ones((3, 3))
    >>> def loss(w, x):
    ...     h = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)   # bf16 x bf16
    ...     return jnp.sum(h.astype(jnp.float32) @ w)              # f32 x f32: the head
    >>> matmul_operand_dtypes(jax.grad(loss), w, jnp.ones((2, 3)))
    {'bfloat16': 2, 'float32': 3}
    >>> matmul_operand_dtypes(lambda a, b: a @ b, w.astype(jnp.bfloat16), w)
    {'bfloat16 x float32': 1}
    """
    counts: Counter[str] = Counter()
    _count(jax.make_jaxpr(fn)(*args).jaxpr, counts)
    return dict(sorted(counts.items()))
