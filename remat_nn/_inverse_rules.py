"""Inverse rules: how ``rn.invertible`` reconstructs an equation's inputs from its outputs.

One registry maps a JAX primitive to a rule. A rule receives the equation's inputs, with each
input to reconstruct given as a ``jax.ShapeDtypeStruct`` (its shape and dtype, no value), the
equation's outputs and its params, and returns all inputs. The reverse walk of
:func:`remat_nn.invertible` calls it with every other input already known, so ``mul`` and ``div``
are invertible in the operand that is not known, ``add`` in either one, and so on.

Only primitives with an inverse that is exact in real arithmetic are registered; floating point
round-off is the only error (RevNet's own setting). Each rule says why it is exact. Call-like
primitives (``jit``, ``scan``, ``custom_jvp_call``, ...) are handled in ``_invertible.py``, which
recurses into their jaxprs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lax.lax import optimization_barrier_p, split_p
from jax.extend.core import Primitive

__all__ = ["InverseRule", "register_inverse"]

#: ``rule(invals, outvals, **params) -> invals``; the entries of ``invals`` to reconstruct are
#: ``jax.ShapeDtypeStruct`` placeholders, the others are the known values.
InverseRule = Callable[..., Sequence[Any]]
#: ``check(params, in_avals, unknown) -> reason or None``: can ``unknown`` (input positions) be
#: reconstructed at once? ``None`` means yes; a string says why not (shown in the error).
InverseCheck = Callable[[Mapping[str, Any], Sequence[Any], tuple[int, ...]], "str | None"]


@dataclasses.dataclass(frozen=True)
class _Rule:
    inverse: InverseRule
    positions: tuple[int, ...] | None
    check: InverseCheck | None

    def why_not(self, params, in_avals, unknown: tuple[int, ...]) -> str | None:
        if self.check is not None:
            return self.check(params, in_avals, unknown)
        if len(unknown) != 1:
            return f"its rule reconstructs one operand at a time, {len(unknown)} are unknown"
        if self.positions is not None and unknown[0] not in self.positions:
            return f"its rule cannot reconstruct operand {unknown[0]} (only {self.positions})"
        return None

    def linked_positions(self, n_in: int) -> tuple[int, ...]:
        return tuple(range(n_in)) if self.positions is None else self.positions


_RULES: dict[Primitive, _Rule] = {}


def register_inverse(
    primitive: Primitive,
    rule: InverseRule,
    *,
    positions: Sequence[int] | None = None,
    check: InverseCheck | None = None,
) -> None:
    """Registers how to reconstruct the inputs of ``primitive`` from its outputs.

    ``rn.invertible`` calls ``rule`` during its reverse walk with every operand but the ones
    to reconstruct already known; the equation's VJP is then taken with the reconstructed
    values. Registering a primitive twice replaces the earlier rule.

    Args:
      primitive: a JAX primitive (``jax.extend.core.Primitive``), e.g. one of
        ``jax.extend.core.primitives`` or your own.
      rule: ``rule(invals, outvals, **params) -> invals``. ``invals`` lists the equation's
        inputs; each one to reconstruct is a ``jax.ShapeDtypeStruct`` placeholder, the others
        are values. ``outvals`` lists its outputs (always known). Return all inputs.
      positions: input positions ``rule`` can reconstruct, one at a time; ``None`` (default)
        means any single position.
      check: optional ``check(params, in_avals, unknown) -> str | None`` replacing
        ``positions``: ``unknown`` is the tuple of positions to reconstruct at once; return
        ``None`` if the rule can, else the reason (shown in ``NotInvertibleError``).

    Returns:
      None.

    Raises:
      TypeError: ``primitive`` is not a primitive or ``rule`` is not callable.

    >>> import jax.numpy as jnp, remat_nn as rn
    >>> from jax.extend.core import Primitive
    >>> triple_p = Primitive("triple")
    >>> _ = triple_p.def_impl(lambda x: 3 * x)
    >>> _ = triple_p.def_abstract_eval(lambda x: x)
    >>> rn.register_inverse(triple_p, lambda invals, outvals: [outvals[0] / 3])
    >>> rn.inversion_report(lambda x: triple_p.bind(x), jnp.ones(3)).counts
    {'inverted': 1}

    References:
      Gomez et al. 2017, "The Reversible Residual Network" (reconstruct activations in the
      backward pass); JAX's removed ``jax.invertible`` / ``primitive_ivjps`` (jax#8686).
    """
    if not isinstance(primitive, Primitive):
        raise TypeError(
            f"rn.register_inverse: argument `primitive` must be a jax.extend.core.Primitive, got "
            f"{type(primitive).__name__} {primitive!r}. Fix: pass e.g. "
            "jax.extend.core.primitives.exp_p."
        )
    if not callable(rule):
        raise TypeError(
            f"rn.register_inverse({primitive.name}): argument `rule` must be callable "
            f"(invals, outvals, **params) -> invals, got {type(rule).__name__}."
        )
    _RULES[primitive] = _Rule(rule, None if positions is None else tuple(positions), check)


def lookup(primitive: Primitive) -> _Rule | None:
    return _RULES.get(primitive)


# --- helpers ----------------------------------------------------------------------------------


def is_unknown(v: Any) -> bool:
    return isinstance(v, jax.ShapeDtypeStruct)


def fit(v: Any, like: Any) -> Any:
    """``v`` (an output-shaped value) cut down to the shape and dtype of operand ``like``.

    Elementwise primitives accept a rank-0 operand (or size-1 dims) next to a full array; a
    reconstructed value then has every broadcast copy equal, so the first one is exact.
    """
    if v.shape != like.shape:
        if len(like.shape) == 0:
            v = lax.reshape(lax.slice(v, (0,) * v.ndim, (1,) * v.ndim), ())
        else:
            limits = [1 if s == 1 else t for s, t in zip(like.shape, v.shape, strict=True)]
            v = lax.slice(v, (0,) * v.ndim, limits)
    if v.dtype != like.dtype:
        v = lax.convert_element_type(v, like.dtype)
    return v


def _unary(inverse: Callable[[Any], Any]) -> InverseRule:
    def rule(invals, outvals, **params):
        del params
        return [fit(inverse(outvals[0]), invals[0])]

    return rule


def _binary(solve0: Callable, solve1: Callable) -> InverseRule:
    """``solve0(y, b)`` gives ``a`` from ``y = op(a, b)``; ``solve1(y, a)`` gives ``b``."""

    def rule(invals, outvals, **params):
        del params
        a, b = invals
        (y,) = outvals
        if is_unknown(a):
            return [fit(solve0(y, b), a), b]
        return [a, fit(solve1(y, a), b)]

    return rule


def _identity(invals, outvals, **params):
    del params
    return [o if is_unknown(i) else i for i, o in zip(invals, outvals, strict=True)]


def _any_subset(params, in_avals, unknown):
    del params, in_avals, unknown
    return None


# --- arithmetic: y = op(a, b) with one operand known --------------------------------------------

# add/sub/neg are exact up to one rounding; mul/div by a known operand are exact up to one
# rounding unless that operand is 0 (then the forward pass itself destroyed the information).
_RULES[prims.add_p] = _Rule(_binary(lax.sub, lax.sub), None, None)
_RULES[prims.add_jaxvals_p] = _RULES[prims.add_p]
_RULES[prims.sub_p] = _Rule(_binary(lax.add, lambda y, a: lax.sub(a, y)), None, None)
_RULES[prims.mul_p] = _Rule(_binary(lax.div, lax.div), None, None)
_RULES[prims.div_p] = _Rule(_binary(lax.mul, lambda y, a: lax.div(a, y)), None, None)
_RULES[prims.neg_p] = _Rule(_unary(lax.neg), None, None)

# --- elementwise bijections (each is one-to-one on the domain where the forward is finite) -------
_RULES[prims.exp_p] = _Rule(_unary(lax.log), None, None)
_RULES[prims.log_p] = _Rule(_unary(lax.exp), None, None)
_RULES[prims.expm1_p] = _Rule(_unary(lax.log1p), None, None)
_RULES[prims.log1p_p] = _Rule(_unary(lax.expm1), None, None)
_RULES[prims.exp2_p] = _Rule(_unary(jnp.log2), None, None)
# sqrt is one-to-one on x >= 0, the only inputs with a real output.
_RULES[prims.sqrt_p] = _Rule(_unary(lambda y: y * y), None, None)
_RULES[prims.rsqrt_p] = _Rule(_unary(lambda y: lax.div(jnp.ones_like(y), y * y)), None, None)
_RULES[prims.cbrt_p] = _Rule(_unary(lambda y: y * y * y), None, None)
# sinh / asinh are bijections of the real line, well conditioned in both directions.
_RULES[prims.sinh_p] = _Rule(_unary(lax.asinh), None, None)
_RULES[prims.asinh_p] = _Rule(_unary(lax.sinh), None, None)
# Not registered: tanh / logistic / erf (bijections, but the inverse loses all precision where
# the forward saturates), cumsum (differences of partial sums cancel catastrophically), square /
# abs / integer_pow with even powers (two-to-one), reduce_precision (lossy).


# --- identities on values ---------------------------------------------------------------------
for _p in (
    prims.copy_p,
    prims.name_p,
    prims.stop_gradient_p,
    prims.sharding_constraint_p,
):
    _RULES[_p] = _Rule(_identity, None, None)
# device_put / optimization_barrier map n operands to n equal outputs: any subset is known.
_RULES[prims.device_put_p] = _Rule(_identity, None, _any_subset)
_RULES[optimization_barrier_p] = _Rule(_identity, None, _any_subset)


# --- layout: a permutation or reshaping of the same elements -----------------------------------
def _reshape(invals, outvals, *, new_sizes, dimensions, **params):
    del new_sizes, params
    (x,), (y,) = invals, outvals
    if dimensions is None:
        return [lax.reshape(y, x.shape)]
    # reshape(x, new_sizes, dimensions) == reshape(transpose(x, dimensions), new_sizes)
    permuted = tuple(x.shape[d] for d in dimensions)
    return [lax.transpose(lax.reshape(y, permuted), tuple(np.argsort(dimensions)))]


_RULES[prims.reshape_p] = _Rule(_reshape, (0,), None)
_RULES[prims.squeeze_p] = _Rule(
    lambda invals, outvals, **_: [lax.reshape(outvals[0], invals[0].shape)], None, None
)
_RULES[prims.transpose_p] = _Rule(
    lambda invals, outvals, *, permutation: [
        lax.transpose(outvals[0], tuple(np.argsort(permutation)))
    ],
    None,
    None,
)
_RULES[prims.rev_p] = _Rule(
    lambda invals, outvals, *, dimensions: [lax.rev(outvals[0], dimensions)], None, None
)


def _broadcast_in_dim(invals, outvals, *, shape, broadcast_dimensions, sharding):
    # Every broadcast copy equals the operand, so the first one is exact; with only size-1 dims
    # inserted (expand_dims) this is a reshape.
    del sharding
    x, y = invals[0], outvals[0]
    limits = list(shape)
    kept = dict(zip(broadcast_dimensions, x.shape, strict=True))
    for d in range(len(shape)):
        if kept.get(d, 1) != shape[d]:
            limits[d] = 1
    sliced = lax.slice(y, (0,) * len(shape), limits)
    return [lax.reshape(sliced, x.shape), *invals[1:]]


_RULES[prims.broadcast_in_dim_p] = _Rule(_broadcast_in_dim, (0,), None)


def _concatenate(invals, outvals, *, dimension):
    (y,) = outvals
    out, start = [], 0
    for x in invals:
        size = x.shape[dimension]
        out.append(lax.slice_in_dim(y, start, start + size, axis=dimension) if is_unknown(x) else x)
        start += size
    return out


# Operands are disjoint slices of the output: any subset of them is recovered by slicing.
_RULES[prims.concatenate_p] = _Rule(_concatenate, None, _any_subset)


def _split(invals, outvals, *, sizes, axis):
    del invals, sizes
    return [lax.concatenate(list(outvals), axis)]


_RULES[split_p] = _Rule(_split, (0,), None)


def _pad(invals, outvals, *, padding_config):
    (y,) = outvals
    x = invals[0]
    starts = [lo for lo, _, _ in padding_config]
    strides = [interior + 1 for _, _, interior in padding_config]
    limits = [
        lo + (n - 1) * s + 1 if n else lo
        for (lo, _, _), n, s in zip(padding_config, x.shape, strides, strict=True)
    ]
    return [lax.slice(y, starts, limits, strides), invals[1]]


def _pad_check(params, in_avals, unknown):
    del in_avals
    if unknown != (0,):
        return "only the padded operand (not the padding value) can be reconstructed"
    if any(lo < 0 or hi < 0 for lo, hi, _ in params["padding_config"]):
        return "negative padding crops the operand, so part of it is lost"
    return None


# Positive padding keeps every operand element at a known position of the output.
_RULES[prims.pad_p] = _Rule(_pad, (0,), _pad_check)


# --- dtype changes ------------------------------------------------------------------------------
def _exact_cast(src: np.dtype, dst: np.dtype) -> str | None:
    """None if every value of ``src`` is representable in ``dst``, else why not."""
    src, dst = np.dtype(src), np.dtype(dst)
    if src == dst or src == np.bool_:
        return None
    if jnp.issubdtype(src, np.integer) and jnp.issubdtype(dst, np.integer):
        s, d = jnp.iinfo(src), jnp.iinfo(dst)
        ok = d.min <= s.min and d.max >= s.max
    elif jnp.issubdtype(src, np.integer) and jnp.issubdtype(dst, np.floating):
        s, f = jnp.iinfo(src), jnp.finfo(dst)
        ok = int(s.max).bit_length() <= f.nmant + 1
    elif jnp.issubdtype(src, np.floating) and jnp.issubdtype(dst, np.floating):
        s, d = jnp.finfo(src), jnp.finfo(dst)
        ok = d.nmant >= s.nmant and d.maxexp >= s.maxexp and d.minexp <= s.minexp
    else:
        ok = False
    return None if ok else f"converting {src.name} to {dst.name} is not exact (it narrows)"


def _convert_check(params, in_avals, unknown):
    if unknown != (0,):
        return "it has one operand"
    return _exact_cast(in_avals[0].dtype, params["new_dtype"])


# Widening casts are injective, so converting back is exact; narrowing ones round.
_RULES[prims.convert_element_type_p] = _Rule(
    lambda invals, outvals, **params: [lax.convert_element_type(outvals[0], invals[0].dtype)],
    (0,),
    _convert_check,
)


def _bitcast_check(params, in_avals, unknown):
    del unknown
    if np.dtype(params["new_dtype"]).itemsize != np.dtype(in_avals[0].dtype).itemsize:
        return "bitcasts between dtypes of different widths change the shape"
    return None


# A same-width bitcast reinterprets the same bits: bitcasting back is exact.
_RULES[prims.bitcast_convert_type_p] = _Rule(
    lambda invals, outvals, **params: [lax.bitcast_convert_type(outvals[0], invals[0].dtype)],
    (0,),
    _bitcast_check,
)
