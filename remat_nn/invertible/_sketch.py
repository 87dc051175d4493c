"""Measured drift: a few random projections of a value, taken by the forward pass and taken
again of the value the backward walk rebuilds, whose difference measures how far it drifted.

The errors ``_errors`` propagates are first-order estimates carried from step to step; over a
stack of layers they compound much faster than the real error. The forward pass of
``rn.invertible`` keeps, for each value the walk will derive from a rebuilt one, its scale
``max|x|`` and :data:`K` projections (int32); the walk projects its own value the same way and
estimates ``||rebuilt - true||_2`` from the difference (:func:`drift`). That norm bounds every
element's error, so the carried error is capped by it (:func:`capped`): where the propagated
estimate was pessimistic, the checks see the real drift.

The projections are exact. ``x`` is scaled by a power of two that puts ``max|x|`` just below
``2**30`` and rounded to int32 (exact, up to the sub-quantum digits below ``2**-30 max|x|``); the
signs are products of two hashed sign matrices of ``O(K sqrt(n))`` numbers (:func:`_project`), the
same for every value of a shape (``seed`` 0): constants numpy makes once per shape (hashed in the
program, they were a fifth of the walk's operations at depth 8, and its compile took 12 s against
6.7 s now). With distinct signs per value, XLA held them from the forward pass to the backward (two
matrices per value live at the peak: temp growing with depth), and one hashed sign per element made
XLA:CPU materialize a ``(K, n)`` signed copy of each value (the walk's temp above plain autodiff's).
Integer sums wrap, and wrapping is a ring homomorphism, so the difference of two projections is
exactly the projection of the difference of the quantized values. The estimator's own floor is the
quantization: at most one quantum per differing element, ``2**-30 sqrt(n)`` of ``max|x|`` (1e-6 of
it only at n = 1e6), far below any tolerance. From the norm it takes the largest element's drift
under a spread-out drift (rounding): :data:`SAFETY` ``* sqrt(2 ln 2n / n) * ||d||_2``, below it with
probability about 1e-3 (chi-square, 8 degrees of freedom), never above ``||d||_2`` (which bounds
every element); a drift in a few elements of a large tensor can read smaller.
Design: remat_nn/invertible/README.md.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from remat_nn.invertible import _errors

#: Projections per value (int32 each, besides one float scale).
K = 8
#: The margin of the largest element's drift over its spread-out expectation (see above).
SAFETY = 3.5
_BITS = 30  # |quantized| <= 2**30: a difference of two stays within int32

#: A value's sketch: (``max|x|``, ``K`` int32 projections).
Sketch = tuple[Any, Any]


def sketchable(aval: Any) -> bool:
    """Real floating values of at least one element (complex and integer values: not)."""
    dtype = getattr(aval, "dtype", None)
    return (
        dtype is not None
        and jnp.issubdtype(dtype, jnp.floating)
        and all(d > 0 for d in getattr(aval, "shape", ()))
    )


def _wide(x: Any) -> Any:
    x = jnp.asarray(x)
    return x.astype(jnp.float32) if jnp.finfo(x.dtype).bits < 32 else x


def _power(top: Any) -> Any:
    """The power of two that scales the float32 scalar ``top`` to just below ``2**_BITS``:
    ``2**clip(_BITS - e, -125, 126)`` with ``e`` the exponent ``frexp`` gives ``top``
    (``top < 2**e``; 0 for 0, inf and NaN), a normal float32, exact.

    Read from the bits, not by ``frexp``/``ldexp`` (93 operations for XLA to compile per
    sketch, against 25): a normal float32 with exponent field ``E`` is below ``2**(E - 126)``.
    A subnormal reads as ``E - 126 = -126``, above ``frexp``'s exponent, and both clip to 126.
    Tested on the bits alone, so a CPU that flushes subnormals to zero reads them the same."""
    bits = lax.bitcast_convert_type(top.astype(jnp.float32), jnp.int32)
    field = (bits >> 23) & 0xFF
    exponent = jnp.where((field == 0xFF) | ((bits & 0x7FFFFFFF) == 0), 0, field - 126)
    shift = jnp.clip(_BITS - exponent, -125, 126)
    return lax.bitcast_convert_type((shift + 127) << 23, jnp.float32)


def _hash(j: np.ndarray) -> np.ndarray:
    """A uint32 mix of ``j`` (murmur3's finalizer): its top bit is the sign."""
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        j = (j ^ (j >> np.uint32(shift))) * np.uint32(mul)
    return j ^ (j >> np.uint32(16))


def _grid(n: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols >= n``: ``cols`` the divisor of ``n`` nearest below
    ``sqrt(n)`` if it is at least a quarter of it (the reshape is free), else
    ``ceil(sqrt(n))`` and zeros pad the rest (a copy of the value: a padded grid made the
    projection of a (64, 512) value 1.6x slower, 52 against 32 us)."""
    root = math.isqrt(n)
    cols = max(1, root)
    while n % cols:
        cols -= 1
    if 4 * cols < root:
        cols = max(1, math.isqrt(n - 1) + 1) if n > 1 else 1
    return -(-n // cols), cols


@functools.cache
def _sign_matrix(shape: tuple[int, int], salt: int) -> np.ndarray:
    j = np.arange(shape[0] * shape[1], dtype=np.uint32).reshape(shape)
    j = j + np.uint32((salt * 0x9E3779B9) % 2**32)
    with np.errstate(over="ignore"):  # uint32 products wrap, as the hash means them to
        negative = _hash(j * _GOLDEN) >> _TOP  # 0 or 1
        return np.uint32(1) - np.uint32(2) * negative


def _signs(shape: tuple[int, int], salt: int) -> Any:
    """``shape`` uint32 signs (1 or ``2**32 - 1``, i.e. -1 modulo ``2**32``), a hash of the
    element's flat index and ``salt``: made by numpy once per shape and salt, a constant of the
    program (hashed in the program, they were ~20 operations per use for XLA to compile)."""
    return jnp.asarray(_sign_matrix(shape, salt))


def _quantized(x: Any, power: Any) -> Any:
    limit = float(2**_BITS)
    q = jnp.clip(jnp.round(x * power), -limit, limit)
    return jnp.where(jnp.isnan(q), 0, q).astype(jnp.int32).reshape(-1)  # (n,)


def _project(x: Any, power: Any, seed: int) -> Any:
    """The ``K`` projections (int32, wrapping) of ``x`` quantized at ``power``.

    ``x`` quantized is viewed as a ``(rows, cols)`` matrix ``Q`` (zero-padded) and projection
    ``k`` is ``sum_r R[r, k] (Q @ C)[r, k]`` with ``C`` ``(cols, K)`` and ``R`` ``(rows, K)``
    hashed signs: every element times the sign ``R[r, k] C[c, k]``, pairwise independent, so
    ``E[projection^2] = |Q|^2`` as with one sign per element, while only ``O(K sqrt(n))``
    signs are made (one sign per element and projection was a ``(K, n)`` array that XLA:CPU
    materialized). In uint32, where products and sums wrap by definition. ``seed`` picks the
    sign matrices (the walk uses 0 for every value; distinct seeds draw independent ones)."""
    q = _quantized(x, power)
    rows, cols = _grid(q.size)
    q = jnp.pad(q, (0, rows * cols - q.size)).reshape(rows, cols)
    q = lax.bitcast_convert_type(q, jnp.uint32)
    partial = jnp.matmul(q, _signs((cols, K), 2 * seed), preferred_element_type=jnp.uint32)
    projection = jnp.sum(partial * _signs((rows, K), 2 * seed + 1), axis=0, dtype=jnp.uint32)
    return lax.bitcast_convert_type(projection, jnp.int32)  # (K,)


_GOLDEN, _TOP = np.uint32(0x9E3779B1), np.uint32(31)


def sketch(x: Any, seed: int = 0) -> Sketch:
    """The forward pass's record of ``x``: ``(max|x|, K projections)``; ``seed`` picks the
    signs (:func:`_project`)."""
    x = _wide(x)
    top = jnp.max(jnp.abs(x)).astype(jnp.float32)  # (float64: the exponent of its float32)
    return top, _project(x, _power(top).astype(x.dtype), seed)


def drift(rebuilt: Any, recorded: Sketch, seed: int = 0) -> Any:
    """An estimate (float32) of ``||rebuilt - x||_2`` from ``x``'s sketch: at least the change
    of ``max|.|`` (a lower bound of every element's drift); inf where ``rebuilt`` is not
    finite; NaN where ``x``'s own scale is not (nothing measured)."""
    return measure(rebuilt, recorded, seed)[0]


def measure(rebuilt: Any, recorded: Sketch, seed: int = 0) -> tuple[Any, Any]:
    """:func:`drift`, and ``max|rebuilt|`` (float32), which it reads on the way and
    :func:`capped` needs (one reduction of the rebuilt value, not two)."""
    rebuilt = _wide(rebuilt)
    rebuilt_top = jnp.max(jnp.abs(rebuilt)).astype(jnp.float32)
    top, projections = recorded
    # Read at this step: XLA would compute every step's scale of a residual at the start and
    # hold them all (temp memory growing with depth).
    top = _errors.after(top, rebuilt_top)
    power = _power(top).astype(rebuilt.dtype)
    diff = (_project(rebuilt, power, seed) - projections).astype(jnp.float32)  # wrapped back
    norm = jnp.sqrt(jnp.mean(diff * diff)) / power.astype(jnp.float32)  # ~ ||rebuilt - x||_2
    n = rebuilt.size
    spread_max = SAFETY * norm * math.sqrt(2 * math.log(2 * n) / n)
    est = jnp.maximum(jnp.minimum(spread_max, norm), jnp.abs(rebuilt_top - top))
    est = jnp.where(jnp.isfinite(rebuilt_top), est.astype(jnp.float32), jnp.inf)
    return jnp.where(jnp.isfinite(top), est, jnp.nan), rebuilt_top


def capped(err: _errors.Err, top: Any, measured: Any) -> _errors.Err:
    """``err`` (the propagated estimate) of a value whose ``max|.|`` is ``top``
    (:func:`measure`) capped by the measured drift ``measured``: its absolute part at most
    ``measured``, its relative part shrunk in proportion. Unchanged where nothing was measured
    (NaN) or the measurement is larger (the cap never raises an error)."""
    a, r, floor = err
    # The largest of the per-element errors min(A, R |x_j|) (_errors.spread), which grow with
    # |x_j|: min(A, R max|x|), NaN (inf * 0, a NaN element) picking A as spread does.
    largest = _errors.spread(err, top)
    shrink = jnp.where(largest > 0, measured / largest, 1.0)
    shrink = jnp.where(jnp.isnan(shrink) | (shrink > 1), 1.0, shrink)
    r = jnp.where(shrink == 1, r, jnp.where(shrink == 0, 0.0, r * shrink))  # not inf * 0
    return jnp.minimum(a, jnp.where(jnp.isnan(measured), a, measured)), r, floor
