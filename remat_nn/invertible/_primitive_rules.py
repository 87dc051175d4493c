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

from remat_nn._jax_internals import core, optimization_barrier_p, split_p

__all__ = [
    "Bound",
    "Guard",
    "InverseRule",
    "PrimitiveRule",
    "lookup",
    "register_inverse",
    "registered",
]

#: ``inverse(invals, outvals, **params) -> invals``; the entries of ``invals`` to reconstruct
#: are ``jax.ShapeDtypeStruct`` placeholders, the others are the known values.
InverseRule = Callable[..., Sequence[Any]]
#: ``check(params, in_avals, unknown) -> reason or None``: can the operand positions
#: ``unknown`` be reconstructed at once? ``None`` means yes; a string says why not.
InverseCheck = Callable[[Mapping[str, Any], Sequence[Any], tuple[int, ...]], "str | None"]


@dataclasses.dataclass(frozen=True)
class Bound:
    """A run-time error bound of one floating inverse.

    ``error(invals, outvals, new, unknown, **params)`` returns, as float32 per element of the
    rebuilt operand, the largest error it can carry (from the rounding of the output it was
    rebuilt from, underflow or overflow, and the inverse's own rounding). The walk requires
    the largest, divided by the rebuilt tensor's scale ``max|value|`` (:func:`relative`), to be
    at most the tolerance (:func:`tolerance`), else the backward stops naming the primitive
    and ``reason``; and carries the errors into what it computes from the operand.
    """

    reason: str
    error: Callable[..., Any]


#: The default tolerance of a bounded inversion, relative to the rebuilt tensor's scale.
DEFAULT_RTOL = 1e-5


def tolerance(rtol: float, dtype: Any) -> float:
    """The tolerance applied to a rebuilt ``dtype`` tensor: ``rtol``, but never below 8 ulps
    of 1 in ``dtype`` (float16 / bfloat16 cannot be rebuilt to 1e-6)."""
    return max(rtol, 8 * float(jnp.finfo(dtype).eps))


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


def dtype_kind(dtype: Any) -> str:
    """The kind of ``dtype`` a rule's domain is stated in: one of :data:`KINDS`."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return "bool"
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex"
    if jnp.issubdtype(dtype, jnp.floating):
        return "float"
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return "unsigned"
    if jnp.issubdtype(dtype, jnp.signedinteger):
        return "signed"
    return "other"  # typed PRNG keys and other extended dtypes


#: The dtype kinds a rule's domain is stated in (``"other"``: PRNG keys, extended dtypes).
KINDS = ("float", "complex", "signed", "unsigned", "bool", "other")
_FLOAT = frozenset({"float"})
_INEXACT = frozenset({"float", "complex"})
# Wrapping integer add / sub / neg are bijections modulo 2^n; bool add is `or` (not one).
_RING = frozenset({"float", "complex", "signed", "unsigned"})
_ANY = frozenset(KINDS)


@dataclasses.dataclass(frozen=True)
class PrimitiveRule:
    """How to reconstruct the operands of one primitive (see the module docstring).

    ``kinds`` is its domain: the dtype kinds (:data:`KINDS`) of the operands it reconstructs for
    which its inverse is exact; ``domain(constants, unknown) -> str | None`` further conditions
    on the known operands that are constants (an integer factor must be an odd constant). A rule
    is never applied outside its domain.
    """

    inverse: InverseRule
    positions: tuple[int, ...] | None = None  # positions it reconstructs, one at a time
    check: InverseCheck | None = None  # replaces ``positions``: which sets of positions
    guard: Guard | None = None
    kinds: frozenset[str] = _FLOAT
    domain: Callable[[Sequence[Any], tuple[int, ...]], str | None] | None = None
    bound: Bound | None = None  # the run-time error bound of a floating inverse

    def why_not(self, params, in_avals, unknown: tuple[int, ...]) -> str | None:
        """None if ``unknown`` (operand positions) can be reconstructed at once, else why not."""
        if self.check is not None:
            reason = self.check(params, in_avals, unknown)
        elif len(unknown) != 1:
            reason = f"its rule reconstructs one operand at a time, {len(unknown)} are unknown"
        elif self.positions is not None and unknown[0] not in self.positions:
            reason = f"its rule cannot reconstruct operand {unknown[0]} (only {self.positions})"
        else:
            reason = None
        if reason is not None:
            return reason
        for p in unknown:
            kind = dtype_kind(in_avals[p].dtype)
            if kind not in self.kinds:
                return (
                    f"its inverse is exact only for {'/'.join(sorted(self.kinds))} operands, "
                    f"operand {p} is {np.dtype(in_avals[p].dtype).name}"
                )
        return None

    def outside_domain(self, constants: Sequence[Any], unknown: tuple[int, ...]) -> str | None:
        """Why the known constant operands put this inversion outside the rule's domain."""
        return None if self.domain is None else self.domain(constants, unknown)

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
    kinds: Sequence[str] = ("float",),
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
      kinds: the rule's domain: the dtype kinds (``"float"``, ``"complex"``, ``"signed"``,
        ``"unsigned"``, ``"bool"``, ``"other"``) of the operands it rebuilds for which it is
        exact. Default float only: an inverse exact over the reals is rarely exact in
        wrapping integers (``k * 4``) or on complex branches (``exp``). Outside it the rule is
        not used.

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
    bad = [k for k in kinds if k not in KINDS]
    if isinstance(kinds, str) or bad:
        raise ValueError(
            f"rn.register_inverse({primitive.name}): argument `kinds` must be a sequence of "
            f"{KINDS}, got {kinds!r}. Fix: e.g. kinds=('float', 'complex')."
        )
    _RULES[primitive] = PrimitiveRule(
        rule, None if positions is None else tuple(positions), check, guard, frozenset(kinds)
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


def _mag(v: Any) -> Any:
    """``|v|`` in float32 (a float16 scale or error term would overflow)."""
    return jnp.abs(jnp.asarray(v)).astype(jnp.float32)


def relative(err: Any, rebuilt: Any) -> Any:
    """``max(err) / max|rebuilt|`` (0 where there is no error, inf where the rebuilt tensor is
    all 0 beside a nonzero error: its information is gone)."""
    top, scale = jnp.max(err), jnp.max(_mag(rebuilt))
    return jnp.where(top == 0, 0.0, top / scale)


def _unit(x: Any) -> tuple[float, float]:
    """(half an ulp of 1, the least normal) of ``x``'s dtype: one rounding, and the absolute
    error of a result that underflowed (flushed or subnormal)."""
    info = jnp.finfo(x.dtype)
    return float(info.eps) / 2, float(info.tiny)


def _unary_bound(error: Callable[[Any, Any, float, float], Any]) -> Callable[..., Any]:
    """A bound from ``error(y, a, u, tiny) -> per-element error`` of a unary inverse (``y``
    the output and ``a`` the rebuilt operand, in float32)."""

    def bound(invals, outvals, new, unknown, **params):
        del invals, params
        (p,) = unknown
        a = new[p]
        u, tiny = _unit(a)
        y32, a32 = outvals[0].astype(jnp.float32), a.astype(jnp.float32)
        return error(y32, a32, u, tiny) + u * jnp.abs(a32)

    return bound


def _sum_bound(invals, outvals, new, unknown, **params):
    # a = y - b: y was rounded to half an ulp of max|y|, which a inherits in absolute terms;
    # a branch 1e4 times the stream leaves a with 4 fewer digits.
    del invals, params
    (p,) = unknown
    a = new[p]
    u, _ = _unit(a)
    return u * jnp.max(_mag(outvals[0])) + u * _mag(a)


def _mul_bound(invals, outvals, new, unknown, **params):
    # a = y / b: y's rounding (or its underflow, up to the least normal) divided by |b|.
    del params
    (p,) = unknown
    a, u_tiny = new[p], _unit(new[p])
    u, tiny = u_tiny
    return (u * _mag(outvals[0]) + tiny) / _mag(invals[1 - p]) + u * _mag(a)


def _div_bound(invals, outvals, new, unknown, **params):
    del params
    (p,) = unknown
    r = new[p]
    u, tiny = _unit(r)
    y = _mag(outvals[0])
    if p == 0:  # a = y * b
        err = (u * y + tiny) * _mag(invals[1])
    else:  # b = a / y: relative error of y (rounding or underflow) carries over
        err = _mag(r) * (u + tiny / y)
    return err + u * _mag(r)


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
# add/sub/neg are exact up to one rounding in floating point, and exact in wrapping integers.
_SUM_BOUND = Bound(
    "the other operand dwarfs the rebuilt one: the output's rounding is larger than the "
    "tolerance of the rebuilt tensor's scale",
    _sum_bound,
)
_RULES[prims.add_p] = PrimitiveRule(_binary(lax.sub, lax.sub), kinds=_RING, bound=_SUM_BOUND)
_RULES[prims.add_jaxvals_p] = _RULES[prims.add_p]
_RULES[prims.sub_p] = PrimitiveRule(
    _binary(lax.add, lambda y, a: lax.sub(a, y)), kinds=_RING, bound=_SUM_BOUND
)
_RULES[prims.neg_p] = PrimitiveRule(_unary(lax.neg), kinds=_RING)
# xor with a known operand is its own inverse, bit for bit.
_XOR = frozenset({"signed", "unsigned", "bool"})
_RULES[prims.xor_p] = PrimitiveRule(_binary(lax.bitwise_xor, lax.bitwise_xor), kinds=_XOR)
_RULES[prims.not_p] = PrimitiveRule(_unary(lax.bitwise_not), kinds=_XOR)


def _odd_inverse(c: Any, dtype: Any) -> np.ndarray:
    """The multiplicative inverse of the odd constant ``c`` modulo 2^bits, as ``dtype``."""
    bits = 8 * np.dtype(dtype).itemsize
    signed = jnp.issubdtype(dtype, jnp.signedinteger)

    def inverse(v):
        r = pow(int(v) % 2**bits, -1, 2**bits)
        return r - 2**bits if signed and r >= 2 ** (bits - 1) else r

    return np.array([inverse(v) for v in np.ravel(c)], dtype).reshape(np.shape(c))


def _mul_solve(y, b):
    if jnp.issubdtype(y.dtype, jnp.integer):  # the domain made b an odd constant
        return lax.mul(y, jnp.asarray(_odd_inverse(b, y.dtype)))
    return lax.div(y, b)


def _is_constant(v: Any) -> bool:
    return not (is_unknown(v) or isinstance(v, jax.Array))


def _mul_domain(constants, unknown) -> str | None:
    # A wrapping integer product k * c is a bijection modulo 2^n exactly when c is odd; an
    # even or traced factor (k * 4 with k near 2^30) destroys the high bits.
    (p,) = unknown
    if not jnp.issubdtype(constants[p].dtype, jnp.integer):
        return None
    known = constants[1 - p]
    if _is_constant(known) and np.all(np.asarray(known) % 2 == 1):
        return None
    what = f"the constant {np.asarray(known)!r}" if _is_constant(known) else "a traced value"
    return (
        f"a wrapping {np.dtype(constants[p].dtype).name} product is invertible only by an odd "
        f"constant factor, the known factor is {what}"
    )


def _mul_ok(invals, outvals, new, unknown, **params):
    # a = y / b is exact up to one rounding while the known factor b is a normal number; where b
    # is 0 (a mask, a gate, ReZero's scale at init) the forward pass destroyed a.
    del outvals, params
    (p,) = unknown
    b = jnp.asarray(invals[1 - p])
    return jnp.all(jnp.abs(b) >= _tiny(b)) & jnp.all(jnp.isfinite(new[p]))


_RULES[prims.mul_p] = PrimitiveRule(
    _binary(_mul_solve, _mul_solve),
    guard=Guard(
        "the known factor is 0 or subnormal, so the product lost it", _mul_ok, _const_normal
    ),
    kinds=_RING,
    domain=_mul_domain,
    bound=Bound(
        "the product underflowed or was rounded beyond the tolerance of the rebuilt factor's scale",
        _mul_bound,
    ),
)
# y = a / b: a = y * b (b finite and nonzero keeps it exact); b = a / y (y finite and nonzero).
# Integer division rounds: not one-to-one.
_RULES[prims.div_p] = PrimitiveRule(
    _binary(lax.mul, lambda y, a: lax.div(a, y)),
    guard=Guard(
        "a known operand is 0, infinite or subnormal, so the quotient lost the other one",
        _finite_result,
        _div_static,
    ),
    kinds=_INEXACT,
    bound=Bound(
        "the quotient underflowed or was rounded beyond the tolerance of the rebuilt operand's "
        "scale",
        _div_bound,
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


def _bounded(text: str, error: Callable[[Any, Any, float, float], Any]) -> Bound:
    return Bound(text, _unary_bound(error))


_LN2 = float(np.log(2.0))
# exp near 1 (x near 0) leaves log(y) only the absolute precision of y: x = 1e-5 keeps 2 digits.
_EXP_BOUND = _bounded(
    "exp(x) is too close to 1 (or underflowed): log of it cannot rebuild x to the tolerance",
    lambda y, a, u, tiny: u + tiny / jnp.abs(y),
)
_RULES[prims.exp_p] = PrimitiveRule(
    _unary(lax.log),
    guard=Guard("exp underflowed to 0 (or overflowed)", _exp_ok),
    bound=_EXP_BOUND,
)
_RULES[prims.exp2_p] = PrimitiveRule(
    _unary(jnp.log2),
    guard=Guard("exp2 underflowed to 0 (or overflowed)", _exp_ok),
    bound=_bounded(
        "exp2(x) is too close to 1 (or underflowed): log2 of it cannot rebuild x",
        lambda y, a, u, tiny: (u + tiny / jnp.abs(y)) / _LN2,
    ),
)
_RULES[prims.expm1_p] = PrimitiveRule(
    _unary(lax.log1p),
    guard=Guard("expm1 saturated near -1 (or overflowed)", _expm1_ok),
    bound=_bounded(
        "expm1 lost x's precision (saturated near -1 or underflowed)",
        lambda y, a, u, tiny: (u * jnp.abs(y) + tiny) / jnp.abs(1 + y),
    ),
)
# exp(log x): log rounded to half an ulp of |log x|, which is a relative error of x: large for
# huge or tiny x.
_RULES[prims.log_p] = PrimitiveRule(
    _unary(lax.exp),
    bound=_bounded(
        "log(x) is too large in magnitude for exp to rebuild x to the tolerance",
        lambda y, a, u, tiny: jnp.abs(a) * u * (jnp.abs(y) + 1) + tiny,
    ),
)
_RULES[prims.log1p_p] = PrimitiveRule(
    _unary(lax.expm1),
    bound=_bounded(
        "log1p(x) is too large in magnitude for expm1 to rebuild x to the tolerance",
        lambda y, a, u, tiny: jnp.abs(1 + a) * u * jnp.abs(y) + tiny,
    ),
)
# sqrt is one-to-one on x >= 0, the only inputs with a real output; y * y may underflow.
_RULES[prims.sqrt_p] = PrimitiveRule(
    _unary(lambda y: y * y),
    bound=_bounded("sqrt(x)^2 underflowed", lambda y, a, u, tiny: 2 * u * jnp.abs(a) + tiny),
)
# (1 / y)^2, not 1 / y^2: y^2 underflows for rsqrt of a huge finite x (1e38). Rounding only.
_RULES[prims.rsqrt_p] = PrimitiveRule(
    _unary(lambda y: lax.square(lax.div(jnp.ones_like(y), y))),
    guard=Guard("rsqrt of a huge value underflowed", _finite_result),
)
_RULES[prims.cbrt_p] = PrimitiveRule(
    _unary(lambda y: y * y * y),
    bound=_bounded("cbrt(x)^3 underflowed", lambda y, a, u, tiny: 3 * u * jnp.abs(a) + tiny),
)
# sinh / asinh are bijections of the real line. Complex exp / sinh / log are periodic or
# branch-cut: the rules above are registered for real floats only (the default kinds).
_RULES[prims.sinh_p] = PrimitiveRule(
    _unary(lax.asinh),
    bound=_bounded(
        "asinh cannot rebuild x from sinh(x) to the tolerance",
        lambda y, a, u, tiny: u * jnp.abs(y) / jnp.sqrt(1 + y * y) + tiny,
    ),
)
# sinh(asinh x) multiplies asinh's rounding by |asinh x| (relative): x = 1e4 keeps 6 digits.
_RULES[prims.asinh_p] = PrimitiveRule(
    _unary(lax.sinh),
    bound=_bounded(
        "asinh(x) is too large for sinh to rebuild x to the tolerance",
        lambda y, a, u, tiny: u * jnp.abs(y) * jnp.cosh(y),
    ),
)
# Not registered: tanh / logistic / erf (bijections, but the inverse loses all precision where
# the forward saturates), cumsum (differences of partial sums cancel catastrophically), square /
# abs / integer_pow with even powers (two-to-one), reduce_precision (lossy).


# --- identities on values ---------------------------------------------------------------------
# Identities and layout changes move values without arithmetic: exact for every dtype.
for _p in (prims.copy_p, prims.name_p, prims.stop_gradient_p, prims.sharding_constraint_p):
    _RULES[_p] = PrimitiveRule(identity, kinds=_ANY)


def _pvary(invals, outvals, *, axes, **params):
    # pvary makes a value varying over manual mesh `axes` with every copy equal to the operand:
    # the first copy, summed with zeros from the others, is the operand exactly (x + 0 == x),
    # unvarying again; one all-reduce in the backward (there is no varying -> unvarying cast).
    del invals, params
    (y,) = outvals
    first = lax.axis_index(axes) == 0
    return [lax.psum(jnp.where(first, y, jnp.zeros_like(y)), axes)]


_RULES[core.pvary_p] = PrimitiveRule(_pvary, (0,), kinds=_RING)
# device_put / optimization_barrier map n operands to n equal outputs: any subset is known.
_RULES[prims.device_put_p] = PrimitiveRule(identity, check=_any_subset, kinds=_ANY)
_RULES[optimization_barrier_p] = PrimitiveRule(identity, check=_any_subset, kinds=_ANY)


# --- layout: a permutation or reshaping of the same elements -----------------------------------
def _reshape(invals, outvals, *, new_sizes, dimensions, **params):
    del new_sizes, params
    (x,), (y,) = invals, outvals
    if dimensions is None:
        return [lax.reshape(y, x.shape)]
    # reshape(x, new_sizes, dimensions) == reshape(transpose(x, dimensions), new_sizes)
    permuted = tuple(x.shape[d] for d in dimensions)
    return [lax.transpose(lax.reshape(y, permuted), tuple(np.argsort(dimensions)))]


_RULES[prims.reshape_p] = PrimitiveRule(_reshape, (0,), kinds=_ANY)
_RULES[prims.squeeze_p] = PrimitiveRule(
    lambda invals, outvals, **_: [lax.reshape(outvals[0], invals[0].shape)], kinds=_ANY
)
_RULES[prims.transpose_p] = PrimitiveRule(
    lambda invals, outvals, *, permutation: [
        lax.transpose(outvals[0], tuple(np.argsort(permutation)))
    ],
    kinds=_ANY,
)
_RULES[prims.rev_p] = PrimitiveRule(
    lambda invals, outvals, *, dimensions: [lax.rev(outvals[0], dimensions)], kinds=_ANY
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


_RULES[prims.broadcast_in_dim_p] = PrimitiveRule(_broadcast_in_dim, (0,), kinds=_ANY)


def _concatenate(invals, outvals, *, dimension):
    (y,) = outvals
    out, start = [], 0
    for x in invals:
        size = x.shape[dimension]
        out.append(lax.slice_in_dim(y, start, start + size, axis=dimension) if is_unknown(x) else x)
        start += size
    return out


# Operands are disjoint slices of the output: any subset of them is recovered by slicing.
_RULES[prims.concatenate_p] = PrimitiveRule(_concatenate, check=_any_subset, kinds=_ANY)


def _split(invals, outvals, *, sizes, axis):
    del invals, sizes
    return [lax.concatenate(list(outvals), axis)]


_RULES[split_p] = PrimitiveRule(_split, (0,), kinds=_ANY)


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
_RULES[prims.pad_p] = PrimitiveRule(_pad, (0,), _pad_check, kinds=_ANY)


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


def _convert_back(invals, outvals, **params):
    del params
    (y,), dtype = outvals, invals[0].dtype
    if jnp.issubdtype(y.dtype, jnp.inexact) and not jnp.issubdtype(dtype, jnp.inexact):
        # An integer (or bool) widened to float comes back by rounding, not truncation: a
        # rebuilt 52.99999 is 53 (the float inverses' bounds keep the error far below 1/2).
        y = lax.round(y, lax.RoundingMethod.TO_NEAREST_EVEN)
        if dtype == np.bool_:
            return [y != 0]
    return [lax.convert_element_type(y, dtype)]


# Widening casts are injective, so converting back is exact; narrowing ones round.
_RULES[prims.convert_element_type_p] = PrimitiveRule(
    _convert_back, (0,), _convert_check, kinds=_ANY
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
    kinds=_ANY,
)
