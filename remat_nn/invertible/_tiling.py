"""Slices that tile their operand: found per jaxpr, so the walk rebuilds the operand from them.

``x[:, :8], x[:, 8:]`` (a coupling's halves) or ``x[:, ::2], x[:, 1::2]`` (RealNVP's even and
odd masks) are separate ``slice`` equations, none of which determines ``x``; together they hold
every element of ``x`` exactly once, as the outputs of ``split`` do. :func:`tilings` finds such
sets (contiguous or strided, on any axes, of one value or of equal reshapes of it) and says why
the other slices of an operand do not rebuild it (a gap or an overlap); :func:`assemble` puts the
pieces back together, moving data only (exact for every dtype).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np
from jax import lax

from remat_nn._jax_internals import core
from remat_nn.invertible._jaxpr import aval_str, is_var

#: (start_indices, limit_indices, strides) of one ``slice`` equation.
Slice = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

_MAX_SLICES = 16  # slices of one operand searched for a tiling (the search is exponential)
_MAX_CELLS = 1 << 16  # cells of the compressed grid (see _cells)
# Operations whose outputs are equal when their operands and parameters are: the slices of two
# equal reshapes of ``x`` (``x.reshape(B, D, 2)[..., 0]`` and ``[..., 1]`` trace two reshapes)
# tile the same value.
_LAYOUT = frozenset(
    {prims.reshape_p, prims.transpose_p, prims.squeeze_p, prims.rev_p, prims.copy_p}
)


@dataclasses.dataclass(frozen=True)
class Tilings:
    """The tilings of one jaxpr's slices."""

    groups: tuple[tuple[int, ...], ...]  # equation indices of each tiling, in a canonical order
    refused: dict[int, str]  # a slice in no tiling -> why its operand is not rebuilt from it


def slice_params(eqn: core.JaxprEqn) -> Slice:
    p = eqn.params
    strides = p["strides"] or (1,) * len(p["start_indices"])
    return tuple(p["start_indices"]), tuple(p["limit_indices"]), tuple(strides)


def _value_keys(jaxpr: core.Jaxpr) -> dict[core.Var, Any]:
    """A key per value, equal for values that layout operations compute alike from one value."""
    keys: dict[core.Var, Any] = {}
    for e in jaxpr.eqns:
        if e.primitive in _LAYOUT and len(e.outvars) == 1 and is_var(e.invars[0]):
            params = repr(sorted(e.params.items()))
            keys[e.outvars[0]] = (e.primitive.name, params, keys.get(e.invars[0], e.invars[0]))
    return keys


def _cells(shape: Sequence[int], slices: Sequence[Slice]) -> tuple[Any, Any] | None:
    """Each slice's cover of the operand on a compressed grid: along each axis, the indices
    that the same slices hold form one class. Returns ``(cover, sizes)``: ``cover[k]`` is a
    bool array over the grid (slice ``k`` holds the cell), ``sizes`` the elements per cell;
    None if the grid is too large to search."""
    n = len(slices)
    covers, sizes = [], []
    for d, length in enumerate(shape):
        masks = np.zeros((n, length), bool)
        for k, (lo, hi, st) in enumerate(slices):
            masks[k, lo[d] : hi[d] : st[d]] = True
        classes, counts = np.unique(masks, axis=1, return_counts=True)
        covers.append(classes)  # (n, classes along d)
        sizes.append(counts)
    grid = tuple(c.shape[1] for c in covers)
    if math.prod(grid) > _MAX_CELLS:
        return None
    cover, size = np.ones((n, *grid), bool), np.ones(grid, np.int64)
    for d, (c, s) in enumerate(zip(covers, sizes, strict=True)):
        along = [1] * len(grid)
        along[d] = grid[d]
        cover = cover & c.reshape((n, *along))
        size = size * s.reshape(along)
    return cover.reshape(n, -1), size.ravel()


def _exact_cover(cover: Any) -> tuple[int, ...] | None:
    """The first set of slices, in their order, that holds every cell exactly once."""
    n, cells = cover.shape

    def search(used: tuple[int, ...], count: Any) -> tuple[int, ...] | None:
        holes = np.flatnonzero(count == 0)
        if holes.size == 0:
            return used
        for k in range(n):  # some slice must hold the first hole
            if k not in used and cover[k, holes[0]] and not count[cover[k]].any():
                found = search((*used, k), count + cover[k])
                if found is not None:
                    return found
        return None

    return search((), np.zeros(cells, np.int64))


def _why_not(aval: Any, cover: Any, size: Any) -> str:
    count = cover.sum(0)
    gap, overlap = int(size[count == 0].sum()), int(size[count > 1].sum())
    faults = [f"{gap} are in none"] * bool(gap) + [f"{overlap} are in more than one"] * bool(
        overlap
    )
    found = f"of its {int(size.sum())} elements, " + " and ".join(faults)
    return (
        f"a slice holds only part of its operand ({aval_str(aval)}); the slices of one operand "
        "rebuild it together only if they hold each of its elements exactly once (a tiling, "
        f"like x[:, :8] and x[:, 8:], or x[:, ::2] and x[:, 1::2]); here, {found}"
    )


def tilings(jaxpr: core.Jaxpr) -> Tilings:
    """The sets of ``slice`` equations of ``jaxpr`` that tile their operand, and why the other
    slices do not rebuild theirs."""
    keys = _value_keys(jaxpr)
    by_value: dict[Any, list[int]] = {}
    for i, e in enumerate(jaxpr.eqns):
        if e.primitive is prims.slice_p and is_var(e.invars[0]) and is_var(e.outvars[0]):
            by_value.setdefault(keys.get(e.invars[0], e.invars[0]), []).append(i)
    groups, refused = [], {}
    for members in by_value.values():
        members.sort(key=lambda i: (slice_params(jaxpr.eqns[i]), i))
        aval: Any = jaxpr.eqns[members[0]].invars[0].aval
        if jnp.issubdtype(aval.dtype, jax.dtypes.extended) or not math.prod(aval.shape):
            continue  # a PRNG key or an empty operand: nothing to assemble
        slices = [slice_params(jaxpr.eqns[i]) for i in members]
        cells = _cells(aval.shape, slices) if len(members) <= _MAX_SLICES else None
        if cells is None:
            for i in members:
                refused[i] = f"its operand has {len(members)} slices, too many pieces to search"
            continue
        chosen = _exact_cover(cells[0])
        if chosen is None:
            why = _why_not(aval, *cells)
            refused.update((i, why) for i in members)
        else:
            groups.append(tuple(members[k] for k in sorted(chosen)))
    return Tilings(tuple(groups), refused)


def _contiguous_axis(shape: Sequence[int], slices: Sequence[Slice]) -> int | None:
    """The axis the slices cut into contiguous blocks, if they cut no other axis."""
    cut = {
        d
        for lo, hi, st in slices
        for d, length in enumerate(shape)
        if (lo[d], hi[d]) != (0, length) or st[d] != 1
    }
    if any(st != (1,) * len(shape) for _, _, st in slices) or len(cut) > 1:
        return None
    return next(iter(cut), None)


def assemble(shape: Sequence[int], slices: Sequence[Slice], pieces: Sequence[Any]) -> Any:
    """The operand of ``shape`` that ``pieces`` (its slices, which tile it) were cut from."""
    if len(pieces) == 1:  # a slice that holds everything is the identity
        return pieces[0]
    axis = _contiguous_axis(shape, slices)
    if axis is not None:  # blocks along one axis: split's inverse
        order = sorted(range(len(slices)), key=lambda k: slices[k][0][axis])
        return lax.concatenate([pieces[k] for k in order], axis)
    x = None
    for (lo, hi, st), piece in zip(slices, pieces, strict=True):
        # Spread the piece to its positions (interior padding for strides), then select them.
        config = [
            (lo[d], length - 1 - lo[d] - (piece.shape[d] - 1) * st[d], st[d] - 1)
            for d, length in enumerate(shape)
        ]
        spread = lax.pad(piece, jnp.zeros((), piece.dtype), config)
        if x is None:
            x = spread
            continue
        x = jnp.where(_positions(shape, (lo, hi, st)), spread, x)
    return x


def _positions(shape: Sequence[int], piece: Slice) -> Any:
    """Where a slice's elements are in its operand: a bool array broadcastable to ``shape``
    (made from one small constant per axis)."""
    lo, hi, st = piece
    mask = jnp.ones((), bool)
    for d, length in enumerate(shape):
        along = np.zeros(length, bool)
        along[lo[d] : hi[d] : st[d]] = True
        mask = mask & jnp.asarray(along).reshape(
            [length if e == d else 1 for e in range(len(shape))]
        )
    return mask
