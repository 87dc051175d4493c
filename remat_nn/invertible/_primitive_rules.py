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
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive

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
