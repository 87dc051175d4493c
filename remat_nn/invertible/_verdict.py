"""The walk's check codes: which run-time check failed, and by how much.

A code is one int32 scalar, 0 where every check passed. A failed check writes its id (the index
of its error text, ``_walk._register_check``) in the low :data:`ID_BITS` bits and a level in the
bits above: :data:`FATAL` for a guard (an inversion that lost information, a bound on its own
rounding) and for anything not finite; for a derivative check (a derivative taken at rebuilt
values that moved by more than the tolerance of its scale: ``_errors.derivative_excess``), the
move rounded up to a :data:`STEPS`-th of an octave (``2 ** (j / STEPS)`` for the least integer
``j`` at or above it). Codes combine by ``max``: the worst failed check, one scalar through
every loop carry and tie the walk already had.

Judged at the end (``_vjp``), a derivative check that failed by less than what the function's
own conditioning allows is accepted: in a chaotic stack the forward pass amplifies rounding as
much as the rebuild does, and plain autodiff's gradient is then as far from exact arithmetic as
the rebuilt one. The allowance (:func:`allowance`) is ``sqrt(eps) * kappa``, at most
:data:`MAX_MOVE`: ``eps`` the machine epsilon of the narrowest float the function computes in,
``kappa = (|dx| / |dy|) (|x| / |y|)`` its relative condition number measured from the
backward's cotangents (``x`` the rebuilt inputs, ``y`` the outputs; as a reversible stack's
drift check measures it, ``remat_nn/_reversible_check.py``). The level rounds the move up and
the allowance down, each to a step of the same grid, so the judgement errs strict by at most two
steps (9%; lenient by at most 1e-4 of a step, log2's rounding). (A first build rounded both to
whole octaves: strict by up to 4x, a move of 0.07 read as 0.125 against an allowance of 0.095
read as 0.0625.) Only with ``rn.invertible``'s default ``rtol``: an explicit one is never
raised. Guards (the inversions' own bounds and domains) are never loosened.

The form is fitted, not derived: the moves are propagated bounds, whose pessimism differs by
dtype, and no multiple of ``eps * kappa`` (the reversible stacks' allowance, 30 of them) fits
both constraints below. Measured on a 2-core Intel Xeon: the canonical-stacks matrix's 88 cells
the fixed tolerance refused (``benchmarks/results/invertible.md``), each run again for the
move (the level in the error), ``kappa`` (of plain autodiff's VJP) and the unchecked
gradient's error against float64 (rn.invertible at rtol 0.5); and the magnitude fuzz's float16
program whose side branch cancels (tests/invertible/test_invertible_magnitudes.py: gradient
30% off float64, 34% off autodiff; its move bound 16, ``kappa`` 134). Float32 chaotic stacks
whose unchecked gradient is within 10x autodiff's own error need up to 405-1,320 ``eps *
kappa`` (``sqrt(eps) * kappa`` times 0.14-0.46); the first float32 cell past 100x, 6.1; the
float16 program must stay below 122 ``eps * kappa`` (``sqrt(eps) * kappa`` times 3.8). At
``sqrt(eps) * kappa``, of those 88 cells 20 are accepted, none past 5x autodiff's error, and
the false refusals among them fall from 44 to 25 (2 of them where autodiff's own error is
below 1e-2). Bfloat16 cells whose move bounds reach thousands of their scale (autodiff's own
gradient 100% off float64) were accepted 140x off by a first build (3,000 ``eps * kappa``)
without :data:`MAX_MOVE`; with the allowance as built the largest move accepted among those 88
cells is 16 (a bfloat16 cell 1.1x autodiff's error).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from remat_nn import _drift

#: The largest move of a derivative a conditioning allowance accepts, relative to its scale
#: (module docstring).
MAX_MOVE = 100.0
#: Bits of a code that hold the check's id (the level takes the 11 bits above).
ID_BITS = 20
_ID_MASK = (1 << ID_BITS) - 1
#: The level of a failed guard or a non-finite move: never accepted.
FATAL = 2047
#: Levels per octave of a derivative check's move.
STEPS = 16
#: Level ``L`` (below FATAL) stands for a relative move of at most ``2 ** ((L - _BIAS) / STEPS)``
#: (moves from ``2**-64`` to ``2**63``; one below ``2**-64`` reads as ``2**-64``).
_BIAS = 1024
#: The least move a level tells apart.
_LEAST = 2.0 ** (-_BIAS // STEPS)
#: log2's own rounding (float32: a few ulps of a step) is absorbed by this fraction of a step.
_SLACK = 1e-4


def _grid(x: Any, up: bool) -> Any:
    """``STEPS * log2(x)`` rounded up (``up``) or down to an integer, for a normal float32
    ``x > 0`` (callers clip at :data:`_LEAST`; what they discard may be anything): the
    exponent read from the bits (exact), the mantissa's log2 within :data:`_SLACK` of a step (a
    value on the grid, such as :func:`bound`'s, maps to its own step both ways).

    Read from the bits, as ``_sketch._power`` reads its exponent: ``jnp.frexp`` (which also
    handles subnormals, zeros and infinities) was 22 of this function's 34 operations, and
    the walk calls it once per check (tested equal to frexp's reading on normal floats)."""
    bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)
    exponent = ((bits >> 23) & 0xFF) - 127  # x = m * 2**exponent, m in [1, 2)
    m = lax.bitcast_convert_type((bits & 0x7FFFFF) | 0x3F800000, jnp.float32)
    steps = STEPS * exponent.astype(jnp.float32) + STEPS * jnp.log2(m)
    return (jnp.ceil(steps - _SLACK) if up else jnp.floor(steps + _SLACK)).astype(jnp.int32)


def encode(result: Any, check: int) -> Any:
    """The code of one check's ``result``: a bool (True: passed; False: :data:`FATAL`) or an
    :func:`remat_nn.invertible._errors.excess` (0: passed). None: nothing was checked."""
    if result is None:
        return None
    assert 0 < check <= _ID_MASK, f"check id {check} does not fit in {ID_BITS} bits"
    if jnp.result_type(result) == np.bool_:
        level = jnp.where(result, 0, FATAL)
    else:
        move = jnp.asarray(result, jnp.float32)
        finite = jnp.clip(_grid(jnp.maximum(move, _LEAST), up=True) + _BIAS, 1, FATAL - 1)
        level = jnp.where(move == 0, 0, jnp.where(jnp.isfinite(move), finite, FATAL))
    level = level.astype(jnp.int32)
    return jnp.where(level == 0, 0, (level << ID_BITS) | check).astype(jnp.int32)


def judged(code: Any, allowed: Any) -> Any:
    """``code``, or 0 if its check is a derivative check whose move is within ``allowed``
    (a float32 scalar, relative; 0 allows nothing)."""
    if code is None:
        return None
    allowed = jnp.asarray(allowed, jnp.float32)
    top = jnp.where(allowed >= _LEAST, _grid(jnp.maximum(allowed, _LEAST), up=False) + _BIAS, 0)
    top = jnp.where(jnp.isfinite(allowed), jnp.minimum(top, FATAL - 1), FATAL - 1)
    top = jnp.where(jnp.isnan(allowed), 0, top)  # (allowance never gives NaN: see _drift)
    return jnp.where((code >> ID_BITS) <= top.astype(jnp.int32), 0, code).astype(jnp.int32)


def allowance(eps: float, x_norm: Any, y_norm: Any, dy_norm: Any, dx_norm: Any) -> jax.Array:
    """The move a derivative check may reach in a function of relative condition number
    ``kappa`` (``_drift.allowance``: from the norms of its rebuilt inputs ``x``, its outputs
    ``y`` and their cotangents): ``sqrt(eps) * kappa``, at most :data:`MAX_MOVE` (module
    docstring). A float32 scalar, 0 where ``kappa`` is not finite."""
    kappa_term = _drift.allowance(math.sqrt(eps), x_norm, y_norm, dy_norm, dx_norm, multiple=1.0)
    return jnp.minimum(kappa_term, jnp.float32(MAX_MOVE))


def check_id(code: int) -> int:
    """The id of the failed check in a (nonzero) code read on the host."""
    return int(code) & _ID_MASK


def bound(code: int) -> float | None:
    """The move a failed derivative check's code stands for, at most (None for a guard)."""
    level = int(code) >> ID_BITS
    return None if level >= FATAL else 2.0 ** ((level - _BIAS) / STEPS)
