"""Primitive rules that invert arithmetic: ``y = op(a, b)`` with one operand known (add, sub,
neg, xor, mul and div, with their bounds and guards), and the elementwise bijections (exp, log,
sqrt, sinh, ...), one-to-one where the forward is finite. Each carries what floating point can
break (a :class:`~remat_nn.invertible._primitive_rules.Guard` or a ``Bound``). Registered in
:mod:`remat_nn.invertible._primitive_rules`'s registry when the package is imported; the
registry, its types and the shared helpers are there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np
from jax import lax

from remat_nn.invertible._primitive_rules import (
    _INEXACT,
    _RING,
    _RULES,
    Bound,
    Guard,
    PrimitiveRule,
    _binary,
    _const_normal,
    _div_bound,
    _div_static,
    _finite_result,
    _mul_bound,
    _sum_bound,
    _tiny,
    _unary,
    _unary_bound,
    is_unknown,
)

__all__: list[str] = []

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
