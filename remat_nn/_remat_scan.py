"""``rn.remat_scan``: ``lax.scan`` with nested (multi-level, sqrt(n) style) checkpointing.

A scan of ``n`` steps is cut into ``levels`` nested levels of chunks. The forward pass keeps only
the carries entering each outermost chunk; the backward pass re-runs one chunk at a time from its
kept carry, keeping the carries entering its sub-chunks, and so on down to single steps, whose
VJPs run under the caller's policy or plan. With lengths ``(n_0, ..., n_{k-1})`` (chunks per
level, outermost first) the carries held at the peak are about ``n_0 + ... + n_{k-1}`` instead of
``n``: ``2 sqrt(n)`` at two levels, for one extra forward pass per level below the outermost
(Chen et al. 2016).

Unlike ``flax.linen.remat_scan``, the lengths need not multiply to ``n`` (a shorter last chunk
takes the remainder at each level), the body takes a policy or a plan, and the carries of each
inner level can be kept (``carry_policy``) instead of recomputed. Pure JAX: no flax.

References:
  Chen, Xu, Zhang, Guestrin. Training Deep Nets with Sublinear Memory Cost. arXiv:1604.06174, 2016.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from remat_nn import _named_axes
from remat_nn._checkpoint import check_bool, check_policy
from remat_nn._checkpoint import checkpoint as rn_checkpoint
from remat_nn._jax_internals import core, pe

__all__ = ["CARRY_ACTIONS", "remat_scan", "remat_scan_lengths"]

PyTree = Any
WHERE = "rn.remat_scan"
#: What ``carry_policy`` may do with the carries of an inner level.
CARRY_ACTIONS = ("recompute", "save")
# An exact factorization is preferred when it holds at most this much more than the fewest
# carries: a remainder chunk costs no memory, but compiles its chunk's loops once more.
_EXACT_SLACK = 1.05


# --- choosing the lengths -------------------------------------------------------------------------


def _cover(n: int, inner: Sequence[int]) -> tuple[int, ...]:
    return (-(-n // math.prod(inner)), *inner) if n else (0, *inner)


def remat_scan_lengths(n: int, levels: int) -> tuple[int, ...]:
    """The lengths, outermost first, :func:`remat_scan` uses for ``n`` steps at ``levels``.

    Minimizes the carries held at the peak, ``sum(lengths)``, with ``lengths[0] =
    ceil(n / prod(lengths[1:]))``; among choices within 5% of the least, one whose inner
    lengths divide ``n`` (no remainder chunk) is preferred.

    >>> import remat_nn as rn
    >>> rn.remat_scan_lengths(512, 2), rn.remat_scan_lengths(1000, 2), rn.remat_scan_lengths(97, 2)
    ((16, 32), (25, 40), (9, 11))
    """
    if levels == 1 or n <= 1:
        return (max(n, 0), *([1] * (levels - 1)))
    root = n ** (1 / levels)
    lo, hi = max(1, math.floor(root / 2)), min(n, math.ceil(2 * root))
    if levels > 6:  # exhaustive search too large: equal inner lengths
        return _cover(n, [math.ceil(root)] * (levels - 1))
    best: dict[bool, tuple[int, tuple[int, ...]]] = {}
    for inner in _products(range(lo, hi + 1), levels - 1):
        sizes = _cover(n, inner)
        exact = n % math.prod(inner) == 0
        key = (sum(sizes), sizes)
        if exact not in best or key < best[exact]:
            best[exact] = key
    least = min(cost for cost, _ in best.values())
    if True in best and best[True][0] <= _EXACT_SLACK * least:
        return best[True][1]
    return best[False][1]


def _products(values: range, k: int) -> Any:
    if k == 0:
        yield ()
        return
    for v in values:
        for rest in _products(values, k - 1):
            yield (v, *rest)


# --- argument checks ------------------------------------------------------------------------------


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _scan_length(xs: PyTree, length: Any) -> int:
    if length is not None and (not _int(length) or length < 0):
        raise TypeError(
            f"{WHERE}: argument `length` must be a non-negative int or None, got "
            f"{type(length).__name__} {length!r}. Fix: {WHERE}(body, carry, None, length=8)."
        )
    leaves = jax.tree.leaves(xs)
    if not leaves:
        if length is None:
            raise ValueError(
                f"{WHERE}: argument `xs` is {xs!r} (no arrays), so the number of steps is "
                f"unknown. Fix: {WHERE}(body, carry, None, length=8)."
            )
        return length
    shapes: list[tuple[int, ...]] = [tuple(jnp.shape(leaf)) for leaf in leaves]
    if any(len(s) == 0 for s in shapes):
        raise ValueError(
            f"{WHERE}: argument `xs` has a scalar leaf (shapes {shapes}); every leaf is scanned "
            "over its leading axis. Fix: stack the per-step values along axis 0."
        )
    firsts = sorted({s[0] for s in shapes})
    if len(firsts) > 1:
        raise ValueError(
            f"{WHERE}: argument `xs` leaves have different leading axis sizes {firsts} (shapes "
            f"{shapes}); every leaf holds one slice per step. Fix: stack each leaf to the same "
            "number of steps."
        )
    if length is not None and length != firsts[0]:
        raise ValueError(
            f"{WHERE}: argument `length` is {length} but `xs` has {firsts[0]} steps along its "
            f"leading axis. Fix: {WHERE}(..., length={firsts[0]}) or leave length=None."
        )
    return firsts[0]


def _check_lengths(n: int, levels: Any, lengths: Any) -> tuple[int, ...]:
    if levels is not None and lengths is not None:
        raise TypeError(
            f"{WHERE}: give `levels` or `lengths`, not both (got levels={levels!r}, "
            f"lengths={lengths!r}). Fix: {WHERE}(..., levels=2) to choose the lengths, or "
            f"{WHERE}(..., lengths=(32, 16))."
        )
    if lengths is None:
        levels = 2 if levels is None else levels
        if not _int(levels) or levels < 1:
            raise ValueError(
                f"{WHERE}: argument `levels` must be an int >= 1 (1: one checkpointed scan; 2: "
                f"sqrt(n) nesting), got {type(levels).__name__} {levels!r}. "
                f"Fix: {WHERE}(..., levels=2)."
            )
        return remat_scan_lengths(n, levels)
    if isinstance(lengths, str | bytes) or not isinstance(lengths, Sequence) or not lengths:
        raise TypeError(
            f"{WHERE}: argument `lengths` must be a non-empty tuple of ints, outermost first, "
            f"got {type(lengths).__name__} {lengths!r}. Fix: {WHERE}(..., lengths=(32, 16))."
        )
    if not all(_int(v) and v >= 1 for v in lengths):
        raise ValueError(
            f"{WHERE}: argument `lengths` must hold ints >= 1, got {lengths!r}. "
            f"Fix: {WHERE}(..., lengths={remat_scan_lengths(n, len(lengths))})."
        )
    lengths = tuple(lengths)
    if n == 0:
        return lengths
    inner = math.prod(lengths[1:])
    need = -(-n // inner)
    if lengths[0] != need:
        covered = math.prod(lengths)
        why = (
            f"cover only {covered} steps"
            if covered < n
            else f"would leave {lengths[0] - need} outermost chunk(s) of {inner} steps empty"
        )
        raise ValueError(
            f"{WHERE}: argument `lengths` {lengths} {why} for a scan of {n} steps; the outermost "
            f"length must be ceil({n} / {inner}) = {need} (the last chunk may be shorter). Fix: "
            f"{WHERE}(..., lengths={(need, *lengths[1:])}), or levels={len(lengths)} to choose."
        )
    return lengths


def _check_carry_policy(carry_policy: Any, levels: int) -> tuple[str, ...]:
    n = levels - 1
    if isinstance(carry_policy, str):
        given: tuple[Any, ...] = (carry_policy,) * n
        shown = carry_policy
    elif isinstance(carry_policy, Sequence) and len(carry_policy) == n:
        given = tuple(carry_policy)
        shown = given
    else:
        raise TypeError(
            f"{WHERE}: argument `carry_policy` must be one of {list(CARRY_ACTIONS)} or a sequence "
            f"of them, one per inner level ({n} here, outermost first), got "
            f"{type(carry_policy).__name__} {carry_policy!r}. "
            f"Fix: {WHERE}(..., carry_policy='recompute')."
        )
    bad = [a for a in given if a not in CARRY_ACTIONS]
    if bad:
        raise ValueError(
            f"{WHERE}: argument `carry_policy` {shown!r} holds {bad[0]!r}; each level's carries "
            f"are one of {list(CARRY_ACTIONS)}. Fix: {WHERE}(..., carry_policy='recompute')."
        )
    return given


# --- the nested scan ------------------------------------------------------------------------------
#
# The chunks of depth d start at the steps that are multiples of S(d) = prod(lengths[d:]) (by
# induction: a chunk's start is a multiple of its own size, and its sub-chunks' size divides it),
# so "the carries of depth d" are the carries entering steps 0, S(d+1), 2 S(d+1), ... A custom
# VJP runs the schedule: the forward pass keeps the depth-0 carries (and those of the depths
# carry_policy saves) in buffers indexed by step // S(d+1); the backward pass walks the chunks
# last to first, re-running a chunk's forward to get its sub-chunks' carries where they were not
# kept, and takes one step's VJP at a time. Every value of ``xs`` and every cotangent is read or
# written in place at its step's index: slicing ``xs`` per chunk, as nested ``jax.checkpoint``
# scans do, makes XLA copy the slices and the chunk's gradient (more bytes than the carries
# saved).


def _inexact(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def _at(tree: PyTree, i: Any) -> PyTree:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _put(tree: PyTree, value: PyTree, i: Any) -> PyTree:
    return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value)


def _stack_zeros(n: int, like: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jnp.zeros((n, *jnp.shape(a)), jnp.result_type(a)), like)


class _Diff:
    """Splits a pytree into its differentiable (inexact) leaves and the rest, and back; a
    cotangent is the list of the differentiable leaves' cotangents (float0 ones never enter a
    loop)."""

    def __init__(self, tree: PyTree) -> None:
        self.leaves, self.treedef = jax.tree.flatten(tree)
        self.mask = [_inexact(leaf) for leaf in self.leaves]

    def split(self, tree: PyTree) -> list[Any]:
        return [x for x, m in zip(jax.tree.leaves(tree), self.mask, strict=True) if m]

    def merge(self, diff: list[Any], rest: list[Any]) -> PyTree:
        it, others = iter(diff), iter(rest)
        out = [next(it) if m else next(others) for m in self.mask]
        return jax.tree.unflatten(self.treedef, out)

    def full_ct(self, diff: list[Any]) -> PyTree:
        zeros = [np.zeros(jnp.shape(x), jax.dtypes.float0) for x in self.leaves]
        return self.merge(diff, [z for z, m in zip(zeros, self.mask, strict=True) if not m])

    def zeros(self) -> list[Any]:
        return [
            jnp.zeros(jnp.shape(x), jnp.result_type(x))
            for x, m in zip(self.leaves, self.mask, strict=True)
            if m
        ]


class _Schedule:
    """The nested schedule for one call: lengths, kept depths, direction, the body."""

    def __init__(
        self,
        fn: Callable[..., Any],
        n: int,
        lengths: tuple[int, ...],
        actions: tuple[str, ...],
        reverse: bool,
        unroll: Any,
    ) -> None:
        self.fn, self.n, self.lengths, self.reverse, self.unroll = fn, n, lengths, reverse, unroll
        # step_vjp's traced function, per manual-axis types of its arguments (under shard_map a
        # loop's carry is traced once less varying, to find the types it settles on).
        self._vjp: dict[Any, Callable[..., Any]] = {}
        self.kept = frozenset([0, *(d for d in range(1, len(lengths)) if actions[d - 1] == "save")])

    def size(self, depth: int) -> int:
        return math.prod(self.lengths[depth:])

    def index(self, step: Any) -> Any:
        """The index into ``xs`` / ``ys`` of the ``step``-th step run."""
        return self.n - 1 - step if self.reverse else step

    def loop(self, count: int, body: Callable[[Any, Any], Any], state: Any, innermost: bool) -> Any:
        unroll = self.unroll if innermost else 1
        return _named_axes.fori_loop(0, count, body, state, unroll=unroll)

    # --- forward ----------------------------------------------------------------------------

    def forward(
        self,
        consts: list[Any],
        carry: PyTree,
        xs: PyTree,
        bufs: dict[str, Any],
        depth: int = 0,
        start: Any = 0,
        steps: int | None = None,
    ) -> tuple[PyTree, dict]:
        """Runs ``steps`` steps from ``start`` as a chunk of ``depth``; writes the ys and the
        kept carries into ``bufs`` (those of its keys present)."""
        if depth == len(self.lengths):  # one step
            i = self.index(start)
            carry, y = self.fn(consts, carry, _at(xs, i))
            if "ys" in bufs:
                bufs = {**bufs, "ys": _put(bufs["ys"], y, i)}
            return carry, bufs
        steps = self.n if steps is None else steps
        sub = self.size(depth + 1)
        q, r = divmod(steps, sub)
        innermost = depth == len(self.lengths) - 1

        def one(state: tuple[PyTree, dict], sub_start: Any, sub_steps: int) -> tuple[PyTree, dict]:
            carry, bufs = state
            if f"c{depth}" in bufs:
                bufs = {**bufs, f"c{depth}": _put(bufs[f"c{depth}"], carry, sub_start // sub)}
            return self.forward(consts, carry, xs, bufs, depth + 1, sub_start, sub_steps)

        state = (carry, bufs)
        if q:
            state = self.loop(q, lambda j, st: one(st, start + j * sub, sub), state, innermost)
        if r:
            state = one(state, start + q * sub, r)
        return state

    # --- backward ---------------------------------------------------------------------------

    def step_vjp(
        self, consts: list[Any], carry: PyTree, x: PyTree, ct_carry: list[Any], ct_y: list[Any]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """One step's VJP: cotangents of the differentiable leaves of consts, carry and x.

        Traced once per backward pass with the unused primal outputs removed: ``jax.vjp`` of a
        checkpointed body computes its outputs once for the forward pass and once more in its
        backward (the recompute); only the second is needed here. XLA would drop the first too,
        but a FLOP count from the jaxpr would not.
        """
        primals = (consts, carry, x)
        pd = _Diff(primals)
        flat = pd.split(primals)
        rest = [leaf for leaf, m in zip(pd.leaves, pd.mask, strict=True) if not m]
        args = (*flat, *rest, *ct_carry, *ct_y)
        key = tuple(_named_axes.varying(a) for a in args)
        if key not in self._vjp:

            def vjp(args: list[Any], rest: list[Any], cts: list[Any]) -> Any:
                out, pullback = jax.vjp(lambda *d: self.fn(*pd.merge(list(d), rest)), *args)
                return pullback(_Diff(out).full_ct(cts))

            closed = jax.make_jaxpr(vjp)(flat, rest, [*ct_carry, *ct_y])
            jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, True, instantiate=True)
            self._vjp[key] = core.jaxpr_as_fun(core.ClosedJaxpr(jaxpr, closed.consts))
        grads = self._vjp[key](*args)
        nk, nc = len(_Diff(consts).split(consts)), len(_Diff(carry).split(carry))
        return list(grads[:nk]), list(grads[nk : nk + nc]), list(grads[nk + nc :])

    def backward(
        self,
        consts: list[Any],
        xs: PyTree,
        kept: dict[str, PyTree],
        carry: PyTree,
        state: tuple[Any, ...],
        ct_ys: list[Any],
        cd: _Diff,
        kd: _Diff,
        depth: int = 0,
        start: Any = 0,
        steps: int | None = None,
    ) -> tuple[Any, ...]:
        """The VJP of a chunk of ``depth`` entered with ``carry``: ``state`` is (carry cotangent,
        xs cotangent buffers, consts cotangents), all lists of differentiable leaves."""
        steps = self.n if steps is None else steps
        sub = self.size(depth + 1)
        q, r = divmod(steps, sub)
        innermost = depth == len(self.lengths) - 1
        if depth in self.kept:
            carry_of = lambda j: _at(kept[f"c{depth}"], start // sub + j)
            rem_carry = carry_of(q) if r else None
        else:  # re-run the chunk, keeping its sub-chunks' carries (q of them)

            def advance(j: Any, st: tuple[PyTree, PyTree]) -> tuple[PyTree, PyTree]:
                c, stack = st
                stack = _put(stack, c, j)
                c, _ = self.forward(consts, c, xs, {}, depth + 1, start + j * sub, sub)
                return c, stack

            rem_carry, stack = carry, None
            if q:
                init = (carry, _stack_zeros(q, carry))  # (q, *carry)
                rem_carry, stack = _named_axes.fori_loop(0, q, advance, init)
            carry_of = lambda j: _at(stack, j)

        def one(st: tuple[Any, ...], c: PyTree, sub_start: Any, sub_steps: int) -> tuple[Any, ...]:
            if not innermost:
                return self.backward(
                    consts, xs, kept, c, st, ct_ys, cd, kd, depth + 1, sub_start, sub_steps
                )
            ct_carry, ct_xs, ct_consts = st
            i = self.index(sub_start)
            y_ct = [jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in ct_ys]
            d_consts, d_carry, d_x = self.step_vjp(consts, c, _at(xs, i), ct_carry, y_ct)
            ct_xs = [
                jax.lax.dynamic_update_index_in_dim(b, v, i, 0)
                for b, v in zip(ct_xs, d_x, strict=True)
            ]
            ct_consts = [a + v for a, v in zip(ct_consts, d_consts, strict=True)]
            return list(d_carry), ct_xs, ct_consts

        if r:
            state = one(state, rem_carry, start + q * sub, r)
        if q:

            def back(j: Any, st: tuple[Any, ...]) -> tuple[Any, ...]:
                jj = q - 1 - j
                return one(st, carry_of(jj), start + jj * sub, sub)

            state = self.loop(q, back, state, innermost)
        return state


def _closure_converted(
    body: Callable[..., Any], init: PyTree, x0: PyTree
) -> tuple[Callable[..., Any], list[Any], Any]:
    """``body`` as ``fn(carry, x, *consts)``: the traced values it closes over become explicit
    arguments, so the custom VJP differentiates them (a custom_vjp cannot differentiate what it
    closes over); constants stay inside. Also returns the shapes of its outputs.

    ``jax.closure_convert`` does the same, but keeps every converted function in a global cache.
    """
    closed, out_shape = jax.make_jaxpr(body, return_shape=True)(init, x0)
    traced = [isinstance(c, core.Tracer) for c in closed.consts]
    consts = [c for c, t in zip(closed.consts, traced, strict=True) if t]
    out_tree = jax.tree.structure(out_shape)

    def fn(carry: PyTree, x: PyTree, *hoisted: Any) -> Any:
        it = iter(hoisted)
        values = [next(it) if t else c for c, t in zip(closed.consts, traced, strict=True)]
        out = core.eval_jaxpr(closed.jaxpr, values, *jax.tree.leaves((carry, x)))
        return jax.tree.unflatten(out_tree, out)

    return fn, consts, out_shape


def _nested(
    body: Callable[..., Any],
    init: PyTree,
    xs: PyTree,
    n: int,
    lengths: tuple[int, ...],
    actions: tuple[str, ...],
    reverse: bool,
    unroll: Any,
) -> tuple[PyTree, PyTree]:
    init = jax.tree.map(jnp.asarray, init)
    x0 = _at(xs, 0)  # one step's x, to trace the body (dead code once traced)
    # The body is traced once, so with the carry types it settles on (under shard_map).
    init = _named_axes.stable_carry(lambda c: body(c, x0)[0], init)
    fn, consts, (carry_out, y0) = _closure_converted(body, init, x0)
    want = jax.tree.map(lambda a: (a.shape, a.dtype), jax.eval_shape(lambda: init))
    got = jax.tree.map(lambda a: (a.shape, a.dtype), carry_out)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise TypeError(
            f"{WHERE}: argument `f` must return a carry of the same structure, shapes and dtypes "
            f"as `init` (as in lax.scan): init is {want}, f returns {got}. Fix: return the new "
            "carry with the dtypes of init, e.g. jnp.asarray(c, init.dtype)."
        )
    sched = _Schedule(lambda ks, c, x: fn(c, x, *ks), n, lengths, actions, reverse, unroll)
    cd, xd = _Diff(init), _Diff(xs)

    @jax.custom_vjp
    def run(consts: list[Any], init: PyTree, xs: PyTree) -> tuple[PyTree, PyTree]:
        carry, bufs = sched.forward(consts, init, xs, {"ys": _stack_zeros(n, y0)})
        return carry, bufs["ys"]

    axes = _named_axes.BoundAxes()

    def run_fwd(consts: list[Any], init: PyTree, xs: PyTree) -> tuple[Any, Any]:
        axes.capture()
        bufs: dict[Any, Any] = {"ys": _stack_zeros(n, y0)}
        for d in sched.kept:  # (ceil(n / S(d+1)), *carry) per kept depth
            bufs[f"c{d}"] = _stack_zeros(-(-n // sched.size(d + 1)), init)
        carry, bufs = sched.forward(consts, init, xs, bufs)
        ys = bufs.pop("ys")
        types = _named_axes.type_witness((consts, init))  # under shard_map: see _named_axes
        return (carry, ys), (consts, xs, bufs, types)

    def run_bwd(res: Any, cts: Any) -> tuple[Any, Any, Any]:
        consts, xs, kept, types = res
        sched._vjp = {}  # traced anew in each trace of the backward pass
        ct_carry, ct_ys = cts
        kd, yd = _Diff(consts), _Diff(y0)
        state = (cd.split(ct_carry), xd.zeros(), kd.zeros())
        with axes.rebound():  # the body's collectives under vmap (see _named_axes)
            ct_c, ct_xs, ct_k = sched.backward(
                consts, xs, kept, None, state, yd.split(ct_ys), cd, kd
            )
        out = kd.full_ct(ct_k), cd.full_ct(ct_c), xd.full_ct(ct_xs)
        return _named_axes.cotangents_like(out, types and (*types, xs))

    run.defvjp(run_fwd, run_bwd)
    return run(consts, init, xs)


def remat_scan(
    f: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    init: PyTree,
    xs: PyTree = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    levels: int | None = None,
    lengths: Sequence[int] | None = None,
    policy: Any = None,
    carry_policy: str | Sequence[str] = "recompute",
) -> tuple[PyTree, PyTree]:
    """``jax.lax.scan`` with nested checkpointing: about ``levels * n**(1/levels)`` carries held
    instead of ``n``, for one extra forward pass per level below the outermost.

    The first six parameters are ``lax.scan``'s, with its meaning: ``f(carry, x) -> (carry, y)``,
    and the result is ``(final carry, stacked ys)``. ``levels=1`` is exactly
    ``lax.scan(rn.checkpoint(f, policy=policy), ...)``. From two levels the schedule is a custom
    VJP: ``jax.grad``, ``jax.vjp``, ``jax.jit`` and ``jax.vmap`` work, forward-mode ``jax.jvp``
    does not (use ``levels=1`` there).

    Args:
      f: the body, ``(carry, x) -> (carry, y)``; the carry keeps its structure, shapes and dtypes.
      init: the initial carry (a pytree).
      xs: the values scanned over, a pytree of arrays with the steps on axis 0; or None with
        ``length``. Read in place at each step's index (never sliced per chunk).
      length: the number of steps, needed when ``xs`` is None.
      reverse: scan from the last step to the first (ys stay in step order), as ``lax.scan``.
      unroll: ``lax.scan``'s ``unroll``, for the innermost loops (over single steps).
      levels: the nesting depth (default 2 when ``lengths`` is not given): 1 is one
        checkpointed scan (``n`` carries held), 2 the sqrt(n) nesting, ... The lengths are
        chosen by :func:`remat_nn.remat_scan_lengths`.
      lengths: instead of ``levels``, the number of chunks at each level, outermost first;
        ``lengths[0]`` must be ``ceil(n / prod(lengths[1:]))``: the last chunk of a level
        takes the remainder when the lengths do not multiply to ``n``.
      policy: what one step keeps between its recompute and its VJP in the backward pass, as
        :func:`remat_nn.checkpoint` takes it: a policy name, a plan, or a callable; None
        recomputes everything. A plan is validated against ``f``.
      carry_policy: for each level below the outermost (depth ``d = 1 .. levels - 1``: the
        carries entering every ``prod(lengths[d+1:])``-th step), ``"recompute"`` (re-run the
        enclosing chunk in the backward pass) or ``"save"`` (kept from the forward pass: more
        memory, one forward pass less); one action for all, or one per level, outermost
        first. The outermost level's carries are always kept.

    Returns:
      ``(carry, ys)`` as ``lax.scan`` returns them.

    Raises:
      TypeError / ValueError: a bad argument, named with its value and a fix.
      PolicyError / PlanError: an unknown policy, a malformed plan, a plan name ``f`` lacks.

    References:
      Chen et al. 2016, Training Deep Nets with Sublinear Memory Cost (arXiv:1604.06174).

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> def layer(h, w):
    ...     return jnp.tanh(h @ w), None
    >>> ws = jnp.full((10, 3, 3), 0.1)  # 10 layers: lengths (4, 3), the last chunk 1 layer
    >>> loss = lambda ws: rn.remat_scan(layer, jnp.ones(3), ws, lengths=(4, 3))[0].sum()
    >>> plain = lambda ws: jax.lax.scan(layer, jnp.ones(3), ws)[0].sum()
    >>> rn.relative_error(jax.grad(loss)(ws), jax.grad(plain)(ws)) < 1e-6  # max-scaled
    True
    """
    if not callable(f):
        raise TypeError(
            f"{WHERE}: argument `f` must be a callable (carry, x) -> (carry, y), got "
            f"{type(f).__name__} {f!r}. Fix: {WHERE}(lambda c, x: (c + x, None), 0.0, xs)."
        )
    check_policy(policy, WHERE)
    check_bool(reverse, "reverse", WHERE)
    if not (isinstance(unroll, bool) or (_int(unroll) and unroll >= 1)):
        raise TypeError(
            f"{WHERE}: argument `unroll` must be an int >= 1 or a bool (as in lax.scan), got "
            f"{type(unroll).__name__} {unroll!r}. Fix: {WHERE}(..., unroll=1)."
        )
    n = _scan_length(xs, length)
    sizes = _check_lengths(n, levels, lengths)
    actions = _check_carry_policy(carry_policy, len(sizes))
    body = rn_checkpoint(f, policy=policy, prevent_cse=False)
    if n == 0 or len(sizes) == 1:  # one level: a checkpointed scan (n carries kept)
        return _named_axes.scan(body, init, xs, length=n, reverse=reverse, unroll=unroll)
    return _nested(body, init, xs, n, sizes, actions, reverse, unroll)
