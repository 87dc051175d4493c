"""Measured reconstruction drift: a few random projections of a value, kept in the forward pass.

A backward pass that rebuilds an activation instead of storing it (a reversible stack, the fused
update's inverse) can check the rebuilt value against the true one without storing it: the
forward keeps a *sketch* of the value, ``k`` random ±1 projections of its elements (``k`` floats,
:data:`NUM_PROJECTIONS`), and the backward computes the same projections of the rebuilt value.
For a Rademacher vector ``w``, ``E[(w·e)^2] = |e|^2``, so the root mean square of the ``k``
differences estimates the 2-norm of the rebuilt value's error (Johnson-Lindenstrauss; with
``k = 8`` the estimate lies within a factor 3 of the true norm with probability above 0.99).
Divided by the value's 2-norm it is the relative drift the check compares with its tolerance:
the actual error, measured, not a bound propagated through every layer.

The projection weights are products of two sign matrices of ``O(k sqrt(n))`` numbers, hashes of
their elements' indices that numpy makes once per shape (constants of the program), so nothing
of the value's size is stored or materialized. The
sketch is taken of the value divided by its max |value| (kept with the sketch), so it neither
overflows nor underflows for any finite float32 value; a rebuilt value that is not finite has a
drift of ``nan``, which fails every check.

Floor: the sketch of the same value computed in two compiled programs differs by the rounding
of a sum of ``n`` terms, at most about ``eps * sqrt(n)`` relative and in practice about ``eps``
(measured for float32 on CPU, ``n`` from 2^11 to 2^22: 6e-8 to 1.8e-7). Sketches of float64
values are computed in float64. A value rebuilt in 16-bit floats has a floor of that format's
``eps``. The default tolerance (:func:`default_rtol`) sits far above
the floor: ``EPS_MULTIPLE`` (2048) times the machine epsilon of the narrowest float the rebuilt
value or the layer that rebuilds it computes in (a float32 stream whose branches compute in
bfloat16 is rebuilt to bfloat16 precision, and its gradient is that precise too), capped at
0.1. ``recon_dtype=jnp.float32`` keeps a 16-bit stack's reconstruction in float32.

Cost, per checked value: ``k + 2`` float32 numbers kept, and ``2 k`` flops per element in each
pass (a matmul with sign matrices of ``O(k sqrt(n))`` numbers); measured on RevNet-38 and a dense
stack in ``benchmarks/results/drift_cost.md``.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from remat_nn import _named_axes
from remat_nn._host_errors import raise_from_callback
from remat_nn._jax_internals import sub_jaxprs
from remat_nn.errors import NotInvertibleError

__all__ = [
    "EPS_MULTIPLE",
    "FALLBACKS",
    "NUM_PROJECTIONS",
    "REPORT_FIELDS",
    "DriftSink",
    "current_sink",
    "current_tally",
    "default_eps",
    "default_rtol",
    "drift",
    "drift_recomputes",
    "float_dtypes",
    "recomputed",
    "refuse_if",
    "replay",
    "report_drift_to",
    "report_if",
    "sketch",
    "tally",
    "validate",
    "when",
]

PyTree = Any

NUM_PROJECTIONS = 8
#: The default tolerance, in units of machine epsilon: float32 2.4e-4. Measured on the
#: canonical-stacks matrix (benchmarks/results/invertible.md): a float32 stack's gradient error
#: was 0.2x to 14x its largest measured layer drift, and the two affine stacks that drifted by
#: 5.4e-4 and 6.5e-4 gave gradients 146x and 119x further from float64 than plain autodiff's
#: (8192 epsilons, 9.8e-4, accepted them); the RevNet-38 trainer run's largest drift, at init,
#: is 1.2e-4 (then below 1e-5). A user who needs more sets ``drift_rtol``.
EPS_MULTIPLE = 2048
#: The name scope of the projections' equations (``train.dtypes`` leaves their float32
#: matmuls out of its count of the model's matmuls).
SCOPE = "drift_projections"
FALLBACKS = ("error", "recompute", "none")
#: The default tolerances' allowance for a badly conditioned computation, in units of ``eps``
#: times its relative condition number (:func:`allowance`; set on the canonical-stacks matrix:
#: ``remat_nn/_reversible_check.py``'s module docstring).
CONDITION_MULTIPLE = 30.0


#: How many times each checked value (by its label, e.g. ``"reversible layer 7"``) was
#: recomputed in this process (:func:`remat_nn.drift_recomputes` reads it).
RECOMPUTED: collections.Counter[str] = collections.Counter()
_LOGGED: list[str] = []  # the first recompute logged in this process
logger = logging.getLogger("remat_nn")


def drift_recomputes(*, reset: bool = False) -> dict[str, int]:
    """How many times each rebuilt value was recomputed by ``fallback="recompute"`` in this
    process, by label (``"reversible layer 7"``: layer 7 of a reversible stack, counted over
    every stack). Counted by a host callback when the recompute runs (after the computation
    that ran it is done: ``jax.block_until_ready`` the gradients first).

    Args:
      reset: clear the counts after reading them.

    >>> import remat_nn as rn
    >>> _ = rn.drift_recomputes(reset=True)  # count from here
    >>> rn.drift_recomputes()
    {}
    """
    counts = dict(RECOMPUTED)
    if reset:
        RECOMPUTED.clear()
    return counts


#: What a drift probe's cotangent counts, by position (:func:`report_drift_to`): failed checks
#: (a reversible stack's, once however many of its layers drifted; the fused update's, per
#: layer) and recomputed layers. (``fused_update_step(report_drift=True)`` reports the same.)
REPORT_FIELDS = ("drift_failed", "drift_recomputed")


class DriftSink:
    """Where the checks traced inside :func:`report_drift_to` report: ``probe``'s cotangent.
    ``used`` turns true when a checked stack took the probe (at trace time)."""

    def __init__(self, probe: jax.Array):
        self.probe, self.used = probe, False

    def take(self) -> jax.Array:
        """The probe, for a checked stack's custom VJP to take as an input."""
        self.used = True
        return self.probe


_SINK: contextvars.ContextVar[DriftSink | None] = contextvars.ContextVar("drift_sink", default=None)


def current_sink() -> DriftSink | None:
    """The sink of the innermost :func:`report_drift_to`, or None (checks report to the host)."""
    return _SINK.get()


@contextlib.contextmanager
def report_drift_to(probe: jax.Array):
    """Inside, checked reversible stacks report to ``probe``'s cotangent, not to the host.

    By default a drift check that fails raises (``fallback="error"``) and a recompute is counted
    (``"recompute"``) by a host callback. JAX never stores a compiled program that holds a host
    callback in its persistent compilation cache, so such a training step compiles again in
    every process. Traced inside this context, a reversible stack (:func:`remat_nn.reversible_scan`
    and the modules over it) and a :func:`remat_nn.invertible` function with run-time checks
    (its failed checks and recomputed scan iterations) take ``probe`` (float32 zeros of shape
    ``(2,)``, see
    :data:`REPORT_FIELDS`) as an input of its custom VJP and returns, as its cotangent, how many
    stacks failed their check (no error is raised: the caller must read it and refuse the
    gradient) and how many layers were recomputed. Cotangents add up, so differentiating with
    respect to ``probe`` gives the counts summed over every stack, layer and, under ``vmap``,
    example. The step then holds no host callback.

    Yields the :class:`DriftSink`; its ``used`` tells, after tracing, whether any stack took it.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> block = rn.coupling_block(lambda p, c, x: (x * p, c), lambda p, c, x: (x * p, c))
    >>> def loss(p, probe):
    ...     with rn.report_drift_to(probe):
    ...         return jnp.sum(rn.reversible_scan(block, p, (jnp.ones(2), jnp.ones(2)))[0][0])
    >>> jax.grad(loss, argnums=1)(jnp.full(4, 0.5), jnp.zeros(2)).tolist()  # nothing drifted
    [0.0, 0.0]
    """
    sink = DriftSink(probe)
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


_TALLY: contextvars.ContextVar[list | None] = contextvars.ContextVar("drift_tally", default=None)


@contextlib.contextmanager
def tally():
    """Inside (a backward pass being traced), recomputes are counted in the program: a checked
    scan appends its traced count to the yielded list (:func:`current_tally`) instead of
    staging a host callback. For a backward that reports to a probe (:func:`report_drift_to`)."""
    counted: list = []
    token = _TALLY.set(counted)
    try:
        yield counted
    finally:
        _TALLY.reset(token)


def current_tally() -> list | None:
    """The list of the innermost :func:`tally`, or None (recomputes are counted on the host)."""
    return _TALLY.get()


def counts(failed: jax.Array | int, recomputed: jax.Array | int) -> jax.Array:
    """A probe's cotangent: ``(2,)`` float32, in the order of :data:`REPORT_FIELDS`."""
    return jnp.stack([jnp.asarray(failed, jnp.float32), jnp.asarray(recomputed, jnp.float32)])


_DRIFTED = (
    "its input, rebuilt by the backward pass, drifted past drift_rtol",
    "anchor_every=k, normalized branches or a wider recon_dtype make the drift smaller",
)


def recomputed(label: str, why: tuple[str, str] = _DRIFTED) -> None:
    """Counts a fallback recompute of ``label`` and logs it once per process (a host callback's
    target: a callback must not raise, and Python's warnings may be set to raise); ``why``:
    (what failed, what makes it rarer), for the log."""
    RECOMPUTED[label] += 1
    if not _LOGGED:
        _LOGGED.append(label)
        logger.warning(
            "remat_nn: %s: %s and was recomputed from the nearest kept value: the gradient is "
            "right, the step slower. rn.drift_recomputes() counts every recompute (this is "
            "logged once); %s.",
            label,
            *why,
        )


def _dtype(tree: PyTree) -> Any:
    """The dtype sketches of ``tree`` are computed and kept in: float32, or float64 for a
    float64 value (a float32 sketch's rounding would be far above a float64 value's drift)."""
    return jnp.result_type(jnp.float32, *(jnp.result_type(a) for a in jax.tree.leaves(tree)))


def default_rtol(tree: PyTree, computes: Iterable[Any] = ()) -> float:
    """:data:`EPS_MULTIPLE` times the machine epsilon of the narrowest float dtype among
    ``tree``'s and ``computes`` (the dtypes the layer that rebuilds ``tree`` computes in):
    float32 2.4e-4, float64 4.5e-13, 16-bit floats capped at 0.1."""
    return min(EPS_MULTIPLE * default_eps(tree, computes), 0.1)


def default_eps(tree: PyTree, computes: Iterable[Any] = ()) -> float:
    """The machine epsilon of the narrowest float dtype among ``tree``'s and ``computes``."""
    dtypes = [jnp.result_type(a) for a in jax.tree.leaves(tree)] + list(computes)
    return max(float(jnp.finfo(d).eps) for d in dtypes if jnp.issubdtype(d, jnp.floating))


def float_dtypes(jaxpr: Any) -> set[Any]:
    """The float dtypes of the values ``jaxpr`` computes (its sub-jaxprs' included): what a
    layer computes in, for :func:`default_rtol`'s ``computes``."""
    out = set()
    for eqn in jaxpr.eqns:
        out |= {v.aval.dtype for v in eqn.outvars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
        for sub in sub_jaxprs(eqn):
            out |= float_dtypes(sub)
    return out


@functools.cache
def _sign_matrix(shape: tuple[int, int], salt: int, dtype: str) -> np.ndarray:
    idx = np.arange(shape[0] * shape[1], dtype=np.uint32).reshape(shape)
    with np.errstate(over="ignore"):  # uint32 products wrap, as the hash means them to
        h = idx * np.uint32(0x9E3779B1) + np.uint32((salt * 0x85EBCA77 + 0x165667B1) % 2**32)
        h = (h ^ (h >> np.uint32(15))) * np.uint32(0x2C1B3C6D)
        h = (h ^ (h >> np.uint32(12))) * np.uint32(0x297A2D39)
    negative = ((h ^ (h >> np.uint32(15))) >> np.uint32(31)).astype(np.float32)
    return (1 - 2 * negative).astype(jnp.dtype(dtype))


def _signs(shape: tuple[int, int], salt: int, dtype: Any) -> jax.Array:
    """``shape`` ±1 of ``dtype``: a hash of each element's flat index and of ``salt``, made
    by numpy once per shape, salt and dtype: a constant of the program. (Hashed in the
    program, XLA computed each matrix once and held it from the forward pass to the end of
    the backward: RevNet-38's peak held four ``(1024, 8)`` ones, 128 KiB, a third of what the
    drift check added to it.)"""
    return jnp.asarray(_sign_matrix(shape, salt, jnp.dtype(dtype).name))


def _grid(size: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols == size`` and ``cols`` the divisor nearest below
    ``sqrt(size)``: the sign matrices below then hold about ``2 k sqrt(size)`` numbers."""
    cols = max(1, math.isqrt(size))
    while size % cols:
        cols -= 1
    return size // cols, cols


def _projections(tree: PyTree, scale: jax.Array) -> jax.Array:
    """``(k,)``: ``k`` random ±1 projections of ``tree / scale``.

    Each leaf is viewed as a ``(rows, cols)`` matrix ``X`` (a free reshape) and projection ``j``
    is ``sum(R[:, j] * (X @ C)[:, j])`` with ``R`` ``(rows, k)`` and ``C`` ``(cols, k)`` hashed
    signs: a sum of every element times the sign ``R[m, j] C[c, j]``, whose products are
    pairwise independent, so ``E[projection^2] = |X|^2`` as for a dense sign matrix, while
    only ``O(k sqrt(n))`` numbers are made (a value-sized sign array, or a value-sized copy of
    ``X``, is never materialized, whatever XLA fuses).
    """
    k = NUM_PROJECTIONS
    out = jnp.zeros((k,), scale.dtype)
    with jax.named_scope(SCOPE):
        out = _project_leaves(tree, out, k)
    return out / scale


def _project_leaves(tree: PyTree, out: jax.Array, k: int) -> jax.Array:
    for salt, leaf in enumerate(jax.tree.leaves(tree)):
        rows, cols = _grid(leaf.size)
        x = leaf.reshape(rows, cols)
        dtype = jnp.promote_types(leaf.dtype, out.dtype)
        left = _signs((cols, k), 2 * salt, leaf.dtype)  # ±1: exact in every float dtype
        t = jnp.matmul(x, left, preferred_element_type=dtype)  # (rows, k)
        out = out + jnp.sum(_signs((rows, k), 2 * salt + 1, dtype) * t, axis=0)
    return out


def sketch(tree: PyTree) -> jax.Array:
    """``(k + 2,)``: ``[max|value|, |value / max| (2-norm), k projections of value / max]``.

    ``tree``'s float leaves are taken as one vector; a tree of zeros has scale 1. Float32, or
    float64 for a float64 value.
    """
    leaves, dtype = jax.tree.leaves(tree), _dtype(tree)
    big = jnp.max(jnp.stack([jnp.max(jnp.abs(a.astype(dtype))) for a in leaves]))
    scale = jnp.where(big > 0, big, jnp.ones((), dtype))
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(a.astype(dtype) / scale)) for a in leaves))
    return jnp.concatenate([jnp.stack([scale, norm]), _projections(tree, scale)])


def drift(tree: PyTree, reference: jax.Array) -> jax.Array:
    """The relative 2-norm error of ``tree`` against the value whose :func:`sketch` is
    ``reference``, estimated from the projections: a float32 scalar, ``nan`` if ``tree`` is not
    finite, ``inf`` if the reference value was all zeros and ``tree`` is not."""
    scale, norm, proj = reference[0], reference[1], reference[2:]
    diff = _projections(tree, scale) - proj
    err = jnp.sqrt(jnp.mean(jnp.square(diff)))
    return jnp.where(norm > 0, err / jnp.where(norm > 0, norm, 1.0), jnp.where(err > 0, jnp.inf, 0))


def validate(fn: str, fallback: Any, rtol: Any) -> None:
    """Refuses a ``fallback`` / ``drift_rtol`` pair that is not one of the documented values."""
    if fallback not in FALLBACKS:
        raise ValueError(
            f"{fn}: `fallback` must be one of {FALLBACKS}, got {fallback!r}. Fix: "
            'fallback="error" (the default: a drifted rebuilt value raises), "recompute" '
            '(it is recomputed from the nearest kept value: more memory, see the docs) or "none" '
            "(no check)."
        )
    if rtol is None:
        return
    if isinstance(rtol, bool) or not isinstance(rtol, int | float) or not rtol > 0:
        raise ValueError(
            f"{fn}: `drift_rtol` must be a positive number or None, got {rtol!r}. Fix: "
            f"drift_rtol=None (the default: {EPS_MULTIPLE} times the stream's machine epsilon, "
            "float32 2.4e-4) or e.g. drift_rtol=1e-5 (relative 2-norm drift of a rebuilt value)."
        )


def when(pred: jax.Array, fn: Callable[..., PyTree], args: tuple, default: PyTree) -> PyTree:
    """``fn(*args)`` where the boolean scalar ``pred`` holds, else ``default``; ``fn`` runs
    only then.

    A ``lax.while_loop`` run zero or one times rather than a ``lax.cond``: under ``jax.vmap`` a
    batched ``cond`` becomes a ``select`` that runs ``fn`` for every element, while a batched
    loop runs ``fn`` only if some element's ``pred`` holds (and keeps ``default`` for the
    others). Under ``shard_map`` every device runs ``fn`` if one does (``fn`` may hold
    collectives). ``fn`` must return values of ``default``'s types. Reverse-differentiable
    (a ``while_loop`` is not: the VJP is the same branch over ``fn``'s VJP), so a
    Hessian-vector product through a checked backward works.
    """
    runs = pred.astype(jnp.int32)
    axes = tuple(sorted(_named_axes.varying(runs)))
    if axes:
        runs = jax.lax.pmax(runs, axes)
    converted, hoisted = jax.closure_convert(fn, *args)
    return _when(converted, runs, tuple(args), tuple(hoisted), default)


def replay(layer: Callable[[jax.Array, PyTree], PyTree], start: PyTree, depth: int, i) -> PyTree:
    """The input of layer ``i`` of a stack, computed forward from ``start`` (the input of layer
    0) by ``layer(j, h)`` (layer ``j`` on ``h``, as the forward ran it).

    A scan over all ``depth`` layers that keeps the carry from layer ``i`` on: a static trip
    count, so that the recompute is reverse-differentiable (a Hessian-vector product through a
    checked backward); it costs ``depth`` layer forwards whatever ``i`` is.
    """

    def step(h: PyTree, j: jax.Array) -> tuple[PyTree, None]:
        return jax.tree.map(lambda a, b: jnp.where(j < i, a, b), layer(j, h), h), None

    return _named_axes.scan(step, start, jnp.arange(depth))[0]


def refuse_if(bad: jax.Array, message: str, layer: Any, drift: jax.Array, rtol: Any) -> None:
    """Stages a :class:`~remat_nn.NotInvertibleError` raised at run time where ``bad`` holds:
    ``message`` formatted with the ``layer``, its ``drift`` and ``rtol`` (under ``vmap``, of the
    first element that drifted). Under ``jit`` it reads first: :mod:`remat_nn._host_errors`."""
    tol = jnp.asarray(rtol, jnp.float32)
    report_if(bad, functools.partial(_refuse, message), bad, layer, drift, tol)


def _refuse(message: str, bad: Any, layer: Any, drift: Any, rtol: Any) -> None:
    bad, layer, drift, rtol = (np.ravel(np.asarray(a)) for a in (bad, layer, drift, rtol))
    if bad.any():
        k = int(np.argmax(bad))
        at = lambda a: a[k % a.size]  # noqa: E731 -- under vmap, the element that drifted
        text = message.format(layer=int(at(layer)), drift=float(at(drift)), rtol=float(at(rtol)))
        raise_from_callback(NotInvertibleError(text))


def report_if(pred: jax.Array, report: Callable[..., None], *args: Any) -> None:
    """Stages the host callback ``report(*args)``, run only where the boolean scalar ``pred``
    holds (a check that passes costs no host round trip; under ``vmap``, it runs if some
    element's ``pred`` holds, with the batch of ``args``)."""

    def branch(*args: Any) -> jax.Array:
        jax.debug.callback(report, *args)
        return jnp.zeros((), jnp.int32)

    when(pred, branch, args, jnp.zeros((), jnp.int32))


def _loop(runs: jax.Array, fn: Callable[..., PyTree], operands: tuple, default: PyTree) -> PyTree:
    """``fn(*operands)`` if ``runs`` (0 or 1) is 1, else ``default``: a loop run ``runs`` times.

    The operands enter the body through an optimization barrier with the loop's counter. They
    are invariant in the loop, and XLA's loop-invariant code motion would otherwise hoist
    whatever ``fn`` computes from them out of the loop, so that the branch ran every time
    (measured on the dense depth-64 stack: the recompute branch's forward replay then ran at
    every layer of the backward, 19x its time, with no layer drifted).
    """

    def body(state: tuple[jax.Array, PyTree]) -> tuple[jax.Array, PyTree]:
        # One barrier per leaf: a barrier's outputs vary over the union of its operands'
        # named axes (shard_map), and each operand must keep its own type.
        ops = jax.tree.map(lambda a: jax.lax.optimization_barrier((state[0], a))[1], operands)
        out = jax.tree.map(lambda a, d: a.astype(d.dtype), fn(*ops), state[1])
        return state[0] + 1, out

    init = _named_axes.stable_carry(body, (jnp.int32(0), default))
    return jax.lax.while_loop(lambda state: state[0] < runs, body, init)[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _when(fn: Callable[..., PyTree], runs, args, hoisted, default):
    return _loop(runs, fn, (*args, *hoisted), default)


def _when_fwd(fn, runs, args, hoisted, default):
    return _when(fn, runs, args, hoisted, default), (runs, args, hoisted)


def _when_bwd(fn, res, ct):
    runs, args, hoisted = res
    leaves, treedef = jax.tree.flatten((args, hoisted))
    inexact = [jnp.issubdtype(jnp.result_type(a), jnp.inexact) for a in leaves]

    def call(*diff: Any) -> PyTree:
        it = iter(diff)
        full = [next(it) if d else a for a, d in zip(leaves, inexact, strict=True)]
        a, h = jax.tree.unflatten(treedef, full)
        return fn(*a, *h)

    diff = [a for a, d in zip(leaves, inexact, strict=True) if d]
    pull = lambda ct, *diff: jax.vjp(call, *diff)[1](ct)  # noqa: E731
    dleaves = iter(_loop(runs, pull, (ct, *diff), tuple(jnp.zeros_like(a) for a in diff)))
    cts = [next(dleaves) if d else None for d in inexact]
    dargs, dhoisted = jax.tree.unflatten(treedef, cts)
    ddefault = jax.tree.map(lambda c: jnp.where(runs > 0, jnp.zeros_like(c), c), ct)
    return None, dargs, dhoisted, ddefault


_when.defvjp(_when_fwd, _when_bwd)


def norm(tree: PyTree) -> jax.Array:
    """The 2-norm of ``tree``'s leaves taken as one vector, in float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(a.astype(jnp.float32))) for a in jax.tree.leaves(tree)))


def allowance(
    eps: float,
    x_norm: Any,
    y_norm: Any,
    dy_norm: Any,
    dx_norm: Any,
    multiple: float = CONDITION_MULTIPLE,
) -> jax.Array:
    """``multiple`` times ``eps`` times the relative condition number of a map
    ``x -> y`` as its backward pass measured it, ``kappa = (|dx| / |dy|) (|x| / |y|)`` (``dy``
    the output's cotangent, ``dx = J^T dy`` the input's): the relative error float arithmetic
    at ``eps`` already puts in the map's own result, the rounding a rebuilt value may carry
    without being worse than plain autodiff (``remat_nn/_reversible_check.py``). A float32
    scalar; 0 where ``kappa`` is not finite (a zero cotangent, an overflow)."""
    kappa = (dx_norm / dy_norm) * (x_norm / y_norm)
    return jnp.where(jnp.isfinite(kappa), multiple * eps * kappa, 0.0).astype(jnp.float32)
