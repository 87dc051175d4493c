"""Primitive rules that move values without arithmetic, exact for every dtype: identities
(``copy``, ``pvary``, ``optimization_barrier``, ...), layout changes (reshape, transpose,
broadcast, concatenate, split, pad) and the dtype changes whose inverse is exact (widening casts,
same-width bitcasts). Registered in :mod:`remat_nn.invertible._primitive_rules`'s registry when
the package is imported; the registry, its types and the arithmetic rules are there.
"""

from __future__ import annotations

from typing import Any

import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np
from jax import lax

from remat_nn._jax_internals import core, optimization_barrier_p, split_p
from remat_nn.invertible._primitive_rules import (
    _ANY,
    _RING,
    _RULES,
    PrimitiveRule,
    _any_subset,
    identity,
    is_unknown,
)

__all__: list[str] = []


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
