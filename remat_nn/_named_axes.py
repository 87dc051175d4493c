"""The types hand-written VJPs and loop carries must give their values under ``jax.shard_map``.

Inside ``shard_map`` a value's type says over which manual mesh axes it varies (a weight passed
with ``P()`` varies over none: every device holds the same copy). JAX's own autodiff transposes
the implicit "unvarying -> varying" broadcast into a ``psum``, so the cotangent of a replicated
weight is the sum of every device's contribution. A ``jax.custom_vjp`` backward and a loop built
by hand are outside those rules, so remat_nn applies the same rule here, in one place:

- :func:`cotangents_like`: a cotangent varying over axes its primal does not vary over is summed
  over exactly those axes (and one varying over fewer is cast up), read from the primal's type;
- :func:`scan` / :func:`fori_loop`: ``lax`` loops whose initial carry is first cast to vary over
  every axis the body's output carry varies over (JAX requires equal carry types).

Outside ``shard_map`` (no manual axes) every function here returns its input unchanged and traces
nothing. Under ``jax.vmap(..., axis_name=...)`` vmap's rule for ``custom_vjp`` already sums the
cotangents of unbatched inputs, but when ``jax.grad`` is taken outside the ``vmap`` the backward
is traced after the axis name went out of scope, so a collective in it (a BatchNorm's
``pmean`` recomputed by a reversible backward) would find no such axis: :class:`BoundAxes`
records the names bound around the forward and binds them again around the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from remat_nn._jax_internals import core

__all__ = [
    "BoundAxes",
    "cotangents_like",
    "fori_loop",
    "manual_axes",
    "optimization_barrier",
    "scan",
    "stable_carry",
    "type_witness",
    "varying",
]

PyTree = Any


def manual_axes() -> frozenset[str]:
    """The mesh axes the current trace is manual over (``shard_map``'s), empty outside it."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def varying(x: Any) -> frozenset[str]:
    """The manual axes ``x`` (an array, tracer or ``ShapeDtypeStruct``) varies over."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else core.typeof(x)
    mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def optimization_barrier(tree: PyTree) -> PyTree:
    """``jax.lax.optimization_barrier`` over ``tree``'s leaves, one barrier per set of manual axes
    they vary over: one barrier's operands must vary alike, and JAX would cast the others up
    (an unvarying cotangent would come out varying). Outside ``shard_map``: one barrier."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[frozenset[str], list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(varying(leaf), []).append(i)
    out = list(leaves)
    for members in groups.values():
        kept = jax.lax.optimization_barrier([leaves[i] for i in members])
        for i, x in zip(members, kept, strict=True):
            out[i] = x
    return jax.tree.unflatten(treedef, out)


def _vary(x: Any, axes: frozenset[str]) -> Any:
    missing = tuple(sorted(axes - varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def type_witness(tree: PyTree) -> PyTree:
    """Zero-size arrays with the manual-axis types of ``tree``'s leaves (``None`` outside
    ``shard_map``): a residual that lets a backward read its primal inputs' types for 0 bytes."""
    if not manual_axes():
        return None
    return jax.tree.map(lambda a: _vary(jnp.zeros((0,), jnp.result_type(a)), varying(a)), tree)


class BoundAxes:
    """The axis names (and sizes) bound where a ``custom_vjp``'s forward was traced; ``with
    bound.rebound():`` binds those the backward's trace lacks.

    One per ``custom_vjp`` function object: call :meth:`capture` in its ``fwd``.
    """

    def __init__(self) -> None:
        self.sizes: dict[Any, int] = {}

    def capture(self) -> None:
        self.sizes.update(core.get_axis_env().axis_sizes)

    def rebound(self) -> Any:
        env = core.get_axis_env()
        missing = [(n, s) for n, s in self.sizes.items() if not env.axis_exists(n)]
        return core.extend_axis_env_nd(missing)


def _is_zero_ct(ct: Any) -> bool:
    return ct is None or jnp.result_type(ct) == jax.dtypes.float0


def cotangents_like(cts: PyTree, primals: PyTree) -> PyTree:
    """``cts`` with each leaf summed over the manual axes it varies over and its primal does not
    (the primal was replicated there, so its cotangent is every device's contribution), and cast
    to vary over those the primal varies over and it does not.

    ``primals`` are the primal inputs or their :func:`type_witness`; ``None`` cotangents (and
    float0 ones) pass through. The identity outside ``shard_map``.
    """
    if primals is None or not manual_axes():
        return cts

    def like(ct: Any, primal: Any) -> Any:
        if _is_zero_ct(ct):
            return ct
        extra = tuple(sorted(varying(ct) - varying(primal)))
        if extra:
            ct = jax.lax.psum(ct, extra)
        return _vary(ct, varying(primal))

    # A None cotangent stands for a whole subtree of zeros: map over the cotangents' structure.
    return jax.tree.map(like, cts, primals, is_leaf=lambda c: c is None)


def stable_carry(step: Callable[[PyTree], PyTree], carry: PyTree) -> PyTree:
    """``carry`` cast until ``step`` (carry -> new carry) returns a carry of the same types."""
    if not manual_axes():
        return carry
    while True:
        out = jax.eval_shape(step, carry)
        new = jax.tree.map(lambda c, o: _vary(c, varying(o) | varying(c)), carry, out)
        if all(
            varying(a) == varying(b)
            for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(carry), strict=True)
        ):
            return carry
        carry = new


def scan(
    f: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    init: PyTree,
    xs: PyTree = None,
    length: int | None = None,
    **kwargs: Any,
) -> tuple[PyTree, PyTree]:
    """``jax.lax.scan`` whose initial carry varies over every manual axis its body's carry does."""
    leaves = jax.tree.leaves(xs)
    if manual_axes() and (not leaves or leaves[0].shape[0]):
        x0 = jax.tree.map(lambda a: a[0], xs)
        init = stable_carry(lambda c: f(c, x0)[0], init)
    return jax.lax.scan(f, init, xs, length=length, **kwargs)


def fori_loop(
    lower: int | jax.Array,
    upper: int | jax.Array,
    body: Callable[[Any, PyTree], PyTree],
    init: PyTree,
    **kwargs: Any,
) -> PyTree:
    """``jax.lax.fori_loop`` whose initial carry varies over every manual axis its body's does."""
    init = stable_carry(lambda c: body(jnp.int32(lower), c), init)
    return jax.lax.fori_loop(lower, upper, body, init, **kwargs)
