"""Primitive rules: how ``rn.invertible`` reconstructs one primitive's operands from its outputs.

One registry maps a JAX primitive to a :class:`PrimitiveRule`. Its ``inverse`` receives the
equation's operands, each one to reconstruct given as a ``jax.ShapeDtypeStruct`` (shape and
dtype, no value), the equation's outputs and its params, and returns all operands. The walk
calls it with every other operand known, so ``mul`` and ``div`` are invertible in the operand
that is not known, ``add`` in either one, and so on.

Only primitives with an inverse that is exact in real arithmetic are registered. Where floating
point can still destroy the information (a known factor that is 0, ``exp`` that underflowed to
0, ``expm1`` saturated at -1) the rule carries a :class:`Guard`: the walk checks it on the values
at hand and stops the program with an error naming the primitive and line instead of returning a
non-finite gradient (``fallback="recompute"`` avoids guarded inversions altogether). The
thresholds come from the operand's dtype (``finfo(dtype).tiny``), so bfloat16 / float16 are
checked on their own ranges.
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
from jax.extend.core import Primitive

from remat_nn._jax_internals import optimization_barrier_p, split_p

__all__ = ["Guard", "InverseRule", "PrimitiveRule", "lookup", "register_inverse", "registered"]

#: ``inverse(invals, outvals, **params) -> invals``; the entries of ``invals`` to reconstruct
#: are ``jax.ShapeDtypeStruct`` placeholders, the others are the known values.
InverseRule = Callable[..., Sequence[Any]]
#: ``check(params, in_avals, unknown) -> reason or None``: can the operand positions
#: ``unknown`` be reconstructed at once? ``None`` means yes; a string says why not.
InverseCheck = Callable[[Mapping[str, Any], Sequence[Any], tuple[int, ...]], "str | None"]


@dataclasses.dataclass(frozen=True)
class Guard:
    """A run-time exactness check of one rule.

    Attributes:
      reason: what can destroy the information, shown in the error ("the known factor is 0").
      ok: ``ok(invals, outvals, new_invals, unknown, **params) -> bool`` array: True where the
        reconstruction is exact. ``invals`` has placeholders where ``new_invals`` has values.
      static_ok: optional ``static_ok(invals, unknown) -> bool | None`` on the known operands
        (Python / NumPy constants, else placeholders): True if they prove the inverse exact (no
        check runs), False if they prove it lossy (a constant 0 factor: the rule is not used),
        None if only the values at run time can tell.
    """

    reason: str
    ok: Callable[..., Any]
    static_ok: Callable[[Sequence[Any], tuple[int, ...]], bool | None] | None = None


@dataclasses.dataclass(frozen=True)
class PrimitiveRule:
    """How to reconstruct the operands of one primitive (see the module docstring)."""

    inverse: InverseRule
    positions: tuple[int, ...] | None = None  # positions it reconstructs, one at a time
    check: InverseCheck | None = None  # replaces ``positions``: which sets of positions
    guard: Guard | None = None

    def why_not(self, params, in_avals, unknown: tuple[int, ...]) -> str | None:
        """None if ``unknown`` (operand positions) can be reconstructed at once, else why not."""
        if self.check is not None:
            return self.check(params, in_avals, unknown)
        if len(unknown) != 1:
            return f"its rule reconstructs one operand at a time, {len(unknown)} are unknown"
        if self.positions is not None and unknown[0] not in self.positions:
            return f"its rule cannot reconstruct operand {unknown[0]} (only {self.positions})"
        return None

    def reconstructs(self, position: int) -> bool:
        """Whether the rule can ever reconstruct operand ``position``."""
        return self.positions is None or position in self.positions

    def exactness(self, constants: Sequence[Any], unknown: tuple[int, ...]) -> tuple[str, str]:
        """``("exact", "")``, ``("checked", why)`` (exact unless the values at run time say
        otherwise) or ``("lost", why)`` (the constants prove the information gone)."""
        if self.guard is None:
            return "exact", ""
        known = None if self.guard.static_ok is None else self.guard.static_ok(constants, unknown)
        if known is None:
            return "checked", self.guard.reason
        return ("exact", "") if known else ("lost", self.guard.reason)


_RULES: dict[Primitive, PrimitiveRule] = {}


def register_inverse(
    primitive: Primitive,
    rule: InverseRule,
    *,
    positions: Sequence[int] | None = None,
    check: InverseCheck | None = None,
    guard: Guard | None = None,
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
        ``None`` if the rule can, else the reason.
      guard: optional :class:`Guard`, a run-time check for inverses that floating point can
        break (division by a value that may be 0); without one the rule is taken as exact.

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
    if guard is not None and not isinstance(guard, Guard):
        raise TypeError(
            f"rn.register_inverse({primitive.name}): argument `guard` must be a "
            f"remat_nn.invertible.Guard, got {type(guard).__name__}."
        )
    _RULES[primitive] = PrimitiveRule(
        rule, None if positions is None else tuple(positions), check, guard
    )


def lookup(primitive: Primitive) -> PrimitiveRule | None:
    return _RULES.get(primitive)


def registered() -> dict[Primitive, PrimitiveRule]:
    """A copy of the registry (primitive -> rule)."""
    return dict(_RULES)


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


def _tiny(x: Any) -> float:
    """The least normal magnitude of ``x``'s dtype (1 for integers: only 0 is lost)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return 1.0
    return float(jnp.finfo(x.dtype).tiny)


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


def identity(invals, outvals, **params):
    del params
    return [o if is_unknown(i) else i for i, o in zip(invals, outvals, strict=True)]


def _any_subset(params, in_avals, unknown):
    del params, in_avals, unknown
    return None


def _finite_result(invals, outvals, new, unknown, **params):
    del invals, outvals, params
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(new[p])) for p in unknown]))


def _const_normal(invals, unknown) -> bool | None:
    """Whether the other operand, a constant, is finite and not tiny everywhere (None: it is
    not a constant, only the run-time values can tell)."""
    (p,) = unknown
    known = invals[1 - p]
    if is_unknown(known) or isinstance(known, jax.Array):
        return None
    arr = np.asarray(known)
    if not np.issubdtype(arr.dtype, np.floating):
        return bool(np.all(arr != 0))
    return bool(np.all(np.isfinite(arr)) and np.all(np.abs(arr) >= np.finfo(arr.dtype).tiny))


def _div_static(invals, unknown) -> bool | None:
    # a = y * b is exact for a normal constant b; b = a / y needs y's values even then.
    normal = _const_normal(invals, unknown)
    return normal if normal is False or unknown == (0,) else None


# --- arithmetic: y = op(a, b) with one operand known --------------------------------------------
# add/sub/neg are exact up to one rounding.
_RULES[prims.add_p] = PrimitiveRule(_binary(lax.sub, lax.sub))
_RULES[prims.add_jaxvals_p] = _RULES[prims.add_p]
_RULES[prims.sub_p] = PrimitiveRule(_binary(lax.add, lambda y, a: lax.sub(a, y)))
_RULES[prims.neg_p] = PrimitiveRule(_unary(lax.neg))


def _mul_ok(invals, outvals, new, unknown, **params):
    # a = y / b is exact up to one rounding while the known factor b is a normal number; where b
    # is 0 (a mask, a gate, ReZero's scale at init) the forward pass destroyed a.
    del outvals, params
    (p,) = unknown
    b = jnp.asarray(invals[1 - p])
    return jnp.all(jnp.abs(b) >= _tiny(b)) & jnp.all(jnp.isfinite(new[p]))


_RULES[prims.mul_p] = PrimitiveRule(
    _binary(lax.div, lax.div),
    guard=Guard(
        "the known factor is 0 or subnormal, so the product lost it", _mul_ok, _const_normal
    ),
)
# y = a / b: a = y * b (b finite and nonzero keeps it exact); b = a / y (y finite and nonzero).
_RULES[prims.div_p] = PrimitiveRule(
    _binary(lax.mul, lambda y, a: lax.div(a, y)),
    guard=Guard(
        "a known operand is 0, infinite or subnormal, so the quotient lost the other one",
        _finite_result,
        _div_static,
    ),
)


# --- elementwise bijections (one-to-one where the forward is finite) ------------------------------
def _exp_ok(invals, outvals, new, unknown, **params):
    # exp underflows to 0 (float32: below about -87; float16: -9.7): log(0) = -inf.
    del invals, new, unknown, params
    (y,) = outvals
    return jnp.all(jnp.isfinite(y) & (y >= _tiny(y)))


def _expm1_ok(invals, outvals, new, unknown, **params):
    # expm1(x) saturates at -1: log1p(y) loses -log2(1 + y) bits. Below x = -2.08 (1 + y < 1/8)
    # more than 3 bits are gone, and at float32 x < -17 it is -1 exactly (log1p(-1) = -inf).
    del invals, new, unknown, params
    (y,) = outvals
    return jnp.all(jnp.isfinite(y) & (y + 1 >= 0.125))


_RULES[prims.exp_p] = PrimitiveRule(
    _unary(lax.log), guard=Guard("exp underflowed to 0 (or overflowed)", _exp_ok)
)
_RULES[prims.exp2_p] = PrimitiveRule(
    _unary(jnp.log2), guard=Guard("exp2 underflowed to 0 (or overflowed)", _exp_ok)
)
_RULES[prims.expm1_p] = PrimitiveRule(
    _unary(lax.log1p), guard=Guard("expm1 saturated near -1 (or overflowed)", _expm1_ok)
)
_RULES[prims.log_p] = PrimitiveRule(_unary(lax.exp))
_RULES[prims.log1p_p] = PrimitiveRule(_unary(lax.expm1))
# sqrt is one-to-one on x >= 0, the only inputs with a real output.
_RULES[prims.sqrt_p] = PrimitiveRule(_unary(lambda y: y * y))
_RULES[prims.rsqrt_p] = PrimitiveRule(
    _unary(lambda y: lax.div(jnp.ones_like(y), y * y)),
    guard=Guard("rsqrt of a huge value underflowed", _finite_result),
)
_RULES[prims.cbrt_p] = PrimitiveRule(_unary(lambda y: y * y * y))
# sinh / asinh are bijections of the real line, well conditioned in both directions.
_RULES[prims.sinh_p] = PrimitiveRule(_unary(lax.asinh))
_RULES[prims.asinh_p] = PrimitiveRule(_unary(lax.sinh))
# Not registered: tanh / logistic / erf (bijections, but the inverse loses all precision where
# the forward saturates), cumsum (differences of partial sums cancel catastrophically), square /
# abs / integer_pow with even powers (two-to-one), reduce_precision (lossy).


# --- identities on values ---------------------------------------------------------------------
for _p in (prims.copy_p, prims.name_p, prims.stop_gradient_p, prims.sharding_constraint_p):
    _RULES[_p] = PrimitiveRule(identity)
# device_put / optimization_barrier map n operands to n equal outputs: any subset is known.
_RULES[prims.device_put_p] = PrimitiveRule(identity, check=_any_subset)
_RULES[optimization_barrier_p] = PrimitiveRule(identity, check=_any_subset)


# --- layout: a permutation or reshaping of the same elements -----------------------------------
def _reshape(invals, outvals, *, new_sizes, dimensions, **params):
    del new_sizes, params
    (x,), (y,) = invals, outvals
    if dimensions is None:
        return [lax.reshape(y, x.shape)]
    # reshape(x, new_sizes, dimensions) == reshape(transpose(x, dimensions), new_sizes)
    permuted = tuple(x.shape[d] for d in dimensions)
    return [lax.transpose(lax.reshape(y, permuted), tuple(np.argsort(dimensions)))]


_RULES[prims.reshape_p] = PrimitiveRule(_reshape, (0,))
_RULES[prims.squeeze_p] = PrimitiveRule(
    lambda invals, outvals, **_: [lax.reshape(outvals[0], invals[0].shape)]
)
_RULES[prims.transpose_p] = PrimitiveRule(
    lambda invals, outvals, *, permutation: [
        lax.transpose(outvals[0], tuple(np.argsort(permutation)))
    ]
)
_RULES[prims.rev_p] = PrimitiveRule(
    lambda invals, outvals, *, dimensions: [lax.rev(outvals[0], dimensions)]
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


_RULES[prims.broadcast_in_dim_p] = PrimitiveRule(_broadcast_in_dim, (0,))


def _concatenate(invals, outvals, *, dimension):
    (y,) = outvals
    out, start = [], 0
    for x in invals:
        size = x.shape[dimension]
        out.append(lax.slice_in_dim(y, start, start + size, axis=dimension) if is_unknown(x) else x)
        start += size
    return out


# Operands are disjoint slices of the output: any subset of them is recovered by slicing.
_RULES[prims.concatenate_p] = PrimitiveRule(_concatenate, check=_any_subset)


def _split(invals, outvals, *, sizes, axis):
    del invals, sizes
    return [lax.concatenate(list(outvals), axis)]


_RULES[split_p] = PrimitiveRule(_split, (0,))


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
_RULES[prims.pad_p] = PrimitiveRule(_pad, (0,), _pad_check)


# --- dtype changes ------------------------------------------------------------------------------
def _exact_cast(src: Any, dst: Any) -> str | None:
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
_RULES[prims.convert_element_type_p] = PrimitiveRule(
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
_RULES[prims.bitcast_convert_type_p] = PrimitiveRule(
    lambda invals, outvals, **params: [lax.bitcast_convert_type(outvals[0], invals[0].dtype)],
    (0,),
    _bitcast_check,
)
