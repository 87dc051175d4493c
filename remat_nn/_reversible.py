"""Reversible scan: a stack of invertible blocks whose backward reconstructs activations.

The pure core under :class:`remat_nn.nn.ReversibleSequence`. A block is a :class:`ReversibleBlock`
(``forward`` / ``inverse`` / optional fused ``backward``) over per-layer parameters stacked on a
leading axis of length ``depth``. :func:`reversible_scan` runs the blocks in one ``lax.scan``
(compiled once) inside a ``jax.custom_vjp`` whose forward saves only the final output (plus the
parameters and per-layer constants it was given), and whose backward walks the layers in a
reverse scan: per block, reconstruct the block's input from its output, then take the block's
VJP at the reconstructed input. Activation memory is therefore flat in depth.

The blocks themselves, and :func:`~remat_nn._coupling.coupling_block` (a two-residual coupling
with a fused backward): :mod:`remat_nn._coupling`.

Drift control: ``anchor_every=k`` stores the block input every ``k`` blocks so the backward
restarts reconstruction from a stored anchor; ``recon_dtype`` carries the residual stream (and
does the reconstruction) in a wider dtype than the blocks compute in.
:func:`~remat_nn._coupling.check_invertible` measures the reconstruction error of any module
with ``forward`` / ``inverse`` methods.

References:
  Gomez, Ren, Urtasun, Grosse (2017). The Reversible Residual Network: Backpropagation Without
  Storing Activations. NeurIPS. https://arxiv.org/abs/1707.04585
  Kitaev, Kaiser, Levskaya (2020). Reformer: The Efficient Transformer. ICLR.
  https://arxiv.org/abs/2001.04451
  MemCNN: a Python/PyTorch package for creating memory-efficient invertible neural networks.
  Van de Leemput et al. (2019), JOSS. https://github.com/silvandeleemput/memcnn
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from remat_nn import _drift, _named_axes
from remat_nn._coupling import ReversibleBlock
from remat_nn._jax_internals import sub_jaxprs
from remat_nn._tie import tie, zero_after

__all__ = ["inverse_scan", "plain_scan", "reversible_scan"]

PyTree = Any


# --- scans ----------------------------------------------------------------------------------------


def _depth(params: PyTree, consts: PyTree) -> int:
    leaves = jax.tree.leaves((params, consts))
    if not leaves:
        raise ValueError(
            "reversible_scan: `params` and `consts` have no array leaves, so the depth is unknown. "
            "Fix: pass per-layer parameters stacked on a leading axis of length depth."
        )
    depths = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
    (depth,) = depths if len(depths) == 1 else (None,)
    if depth is None:
        raise ValueError(
            "reversible_scan: every leaf of `params` and `consts` must carry the layer axis first "
            f"with one common length, got leading sizes {sorted(map(str, depths))}. Fix: stack "
            "per-layer values with jnp.stack / jax.vmap(init)."
        )
    return depth


def _cast(tree: PyTree, dtypes: PyTree) -> PyTree:
    return jax.tree.map(lambda a, d: a.astype(d), tree, dtypes)


def _stream_dtypes(x: PyTree, recon_dtype: Any) -> PyTree:
    if recon_dtype is None:
        return jax.tree.map(lambda a: a.dtype, x)
    dtype = jnp.dtype(recon_dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"reversible_scan: `recon_dtype` must be a floating dtype, got {recon_dtype!r}. "
            "Fix: recon_dtype=jnp.float32."
        )
    return jax.tree.map(lambda a: dtype, x)


def _segments(tree: PyTree, num: int) -> PyTree:
    # (depth, ...) -> (num_segments, depth // num_segments, ...)
    return jax.tree.map(lambda a: a.reshape((num, a.shape[0] // num) + a.shape[1:]), tree)


def _unsegment(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), tree)


def _forward_layers(
    block: ReversibleBlock,
    params: PyTree,
    consts: PyTree,
    x: PyTree,
    unroll: int | bool,
    sketch: bool = False,
) -> tuple[PyTree, PyTree, jax.Array | None]:
    """``(y, new_consts, sketches)``: the stack's output, the layers' new constants and, if
    ``sketch``, the :func:`remat_nn._drift.sketch` of every layer's input (``None`` otherwise)."""

    def step(carry, layer):
        p, c = layer
        y, new_consts = block.forward(p, c, carry)
        return y, (new_consts, _drift.sketch(carry) if sketch else None)

    y, (new_consts, sketches) = _named_axes.scan(step, x, (params, consts), unroll=unroll)
    return y, new_consts, sketches


class _Check(NamedTuple):
    """The drift check of one backward scan over layers: the forward's sketch of every layer's
    input, and for ``fallback="recompute"`` the kept value the layers start from."""

    fallback: str
    rtol: float
    sketches: jax.Array  # (layers, k + 2)
    start: PyTree  # the first layer's input, kept (None unless fallback="recompute")
    offset: jax.Array | int  # the first layer's index in the whole stack
    report: bool  # recomputes are counted in the backward's result, not by a host callback


def _block_vjp(block: ReversibleBlock, p, c, y, dy):
    """``(x, dp, dx)``: the block's input rebuilt from ``y`` and its VJP there."""
    if block.backward is not None:
        return block.backward(p, c, y, dy)
    x = block.inverse(p, c, y)
    return (x, *_vjp_at(block, p, c, x, dy))


def _vjp_at(block: ReversibleBlock, p, c, x, dy):
    _, vjp = jax.vjp(lambda p_, x_: block.forward(p_, c, x_)[0], p, x)
    return vjp(dy)


def _recompute(block: ReversibleBlock, params, consts, start, i):
    """The input of layer ``i`` computed forward from ``start``, the input of layer 0 (as many
    block forwards as ``params`` has layers: the segment of ``anchor_every``, or the stack)."""

    def layer(j, h):
        p, c = jax.tree.map(lambda a: a[j], (params, consts))
        return block.forward(p, c, h)[0]

    return _drift.replay(layer, start, _depth(params, consts), i)


_DRIFTED = """\
reversible stack: the input of layer {layer}, rebuilt from its output by the block's inverse, \
is off by {drift:.3g} of its norm (tolerance drift_rtol={rtol:g}; measured from random \
projections kept in the forward pass), so its gradient would be wrong. The stack amplifies \
rounding error when inverted: its activations grow or its blocks are nearly singular. Fix: \
anchor_every=k (keep every k-th layer's input), normalized branches (LayerNorm), a wider \
recon_dtype; fallback="recompute" (recompute a drifted layer's input from the nearest kept \
value: the compiled backward then holds more temporary memory); or reversible=False."""


def _recomputed(layer) -> None:
    _drift.recomputed(f"reversible layer {int(layer)}")


def _checked(block, params, consts, check: _Check, p, c, dy, i, ref, rebuilt):
    """``(rebuilt, drifted, drift)``: ``rebuilt`` (``(x, dp, dx)`` of layer ``i``) if its ``x``
    passes the drift check against the forward's sketch ``ref``; else, by ``check.fallback``,
    recomputed from the kept start (``"recompute"``) or returned as it is, flagged
    (``"flag"``: the caller refuses or reruns once for the whole stack)."""
    drift = _drift.drift(rebuilt[0], ref)
    bad = ~(drift <= check.rtol)  # nan (a non-finite rebuilt value) fails
    if check.fallback != "recompute":
        return rebuilt, bad, drift

    def recompute(params, consts, start, i, layer, p, c, dy):
        if not check.report:
            jax.debug.callback(_recomputed, layer)
        x = _recompute(block, params, consts, start, i)
        return (x, *_vjp_at(block, p, c, x, dy))

    # p and c: the layer's own, tied as the main path's (under shard_map, of the same types).
    args = (params, consts, check.start, i, check.offset + i, p, c, dy)
    return _drift.when(bad, recompute, args, rebuilt), bad, drift


def _none_drifted() -> tuple[jax.Array, jax.Array, jax.Array]:
    """No layer drifted: ``(layer, its drift, count)`` of the first that did and of how many
    did, as the backward carries it (layer -1, count 0)."""
    return jnp.int32(-1), jnp.float32(0.0), jnp.int32(0)


def _first(first, bad, layer, drift, count=1):
    """The first drifted layer, its drift and the count: ``first``, updated with ``(layer,
    drift)`` if it is none and ``bad``, and ``count`` more drifted layers if ``bad``."""
    take = bad & (first[0] < 0)
    layer, drift = jnp.asarray(layer, jnp.int32), jnp.asarray(drift, jnp.float32)
    total = first[2] + jnp.where(bad, jnp.asarray(count, jnp.int32), 0)
    return jnp.where(take, layer, first[0]), jnp.where(take, drift, first[1]), total


def _backward_layers(block: ReversibleBlock, params, consts, y, dy, unroll, check=None):
    """``(dx, dparams, first)``: the reverse scan over layers; ``first`` is ``(layer, drift,
    count)`` of the first layer (in the backward's order) whose rebuilt input failed ``check``
    and of how many failed (:func:`_none_drifted` if none, or without a check)."""

    def step(carry, layer):
        y, dy, after, first = carry
        (p, c), i, ref = layer
        # This block's parameters are tied to the previous step's gradients, so its
        # reconstruction cannot start before that step's backward is done: unrolled, XLA would
        # otherwise reconstruct every block first and hold them all. (Tying the parameters, not
        # the activations: XLA fuses a tie into every consumer of the tied value, and a fused
        # tie on an activation keeps the buffers it is computed from alive, layer after layer.)
        p, c = tie((p, c), after)
        x, dp, dx = _block_vjp(block, p, c, y, dy)
        if check is not None:
            rebuilt = (x, dp, dx)
            (x, dp, dx), bad, drift = _checked(
                block, params, consts, check, p, c, dy, i, ref, rebuilt
            )
            first = _first(first, bad, check.offset + i, drift)
        dx = _cast(dx, jax.tree.map(lambda a: a.dtype, dy))
        return (x, dx, zero_after((dp, dx), after.dtype), first), dp

    # The zero rides in the carry in the stream's dtype (a bfloat16 stream stays bfloat16).
    carry = (y, dy, zero_after(dy, jax.tree.leaves(dy)[0].dtype), _none_drifted())
    depth = _depth(params, consts)
    layers = ((params, consts), jnp.arange(depth), None if check is None else check.sketches)
    (_, dx, _, first), dparams = _named_axes.scan(step, carry, layers, reverse=True, unroll=unroll)
    return dx, dparams, first


def _validate_anchor(anchor_every: int | None, depth: int) -> int:
    if anchor_every is None:
        return depth
    if isinstance(anchor_every, bool) or not isinstance(anchor_every, int) or anchor_every < 1:
        raise ValueError(
            f"reversible_scan: `anchor_every` must be a positive int or None, got "
            f"{anchor_every!r}. Fix: anchor_every=8 (store the block input every 8 blocks)."
        )
    if depth % anchor_every:
        divisors = [d for d in range(1, depth + 1) if depth % d == 0]
        raise ValueError(
            f"reversible_scan: `anchor_every`={anchor_every} must divide the depth {depth}. "
            f"Fix: one of {divisors}."
        )
    return anchor_every


def _convolves(jaxpr: Any) -> bool:
    return any(
        eqn.primitive.name == "conv_general_dilated" or any(map(_convolves, sub_jaxprs(eqn)))
        for eqn in jaxpr.eqns
    )


def _layer_jaxpr(block: ReversibleBlock, params: PyTree, consts: PyTree, x: PyTree) -> Any:
    """The jaxpr of one block's forward (layer 0's shapes; nothing is compiled)."""
    shape = lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype)  # noqa: E731
    layer = jax.tree.map(shape, (params, consts))
    xs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), x)
    return jax.make_jaxpr(block.forward)(*layer, xs).jaxpr


def _default_rtol(block: ReversibleBlock, params: PyTree, consts: PyTree, x: PyTree) -> float:
    """The drift tolerance of a stack whose stream is ``x``: :func:`remat_nn._drift.default_rtol`
    of the stream and of what its blocks compute in (bfloat16 branches rebuild a float32 stream
    to bfloat16 precision only, and plain autodiff's gradient is no more precise)."""
    return _drift.default_rtol(x, _drift.float_dtypes(_layer_jaxpr(block, params, consts, x)))


def _unroll(
    unroll: int | bool | None,
    fn: str,
    block: ReversibleBlock,
    params: PyTree,
    consts: PyTree,
    x: PyTree,
) -> int | bool:
    """``unroll`` of every scan over layers, checked; ``None``: the measured default.

    On XLA:CPU (benchmarks/results/revnet.md, "Unrolled reversible stacks"): a stack of
    convolutional blocks runs many times faster unrolled (XLA:CPU runs convolutions in a while
    loop slowly, jax-ml/jax#12868); a stack of dense blocks runs no faster unrolled and compiles
    several times longer. So the default unrolls on CPU exactly when the block convolves (read
    from the jaxpr of one block; nothing is compiled). GPU/TPU run loops at full speed and
    compile a loop once: a loop (not measured here, there is no accelerator).
    """
    if unroll is None:
        if jax.default_backend() != "cpu":
            return 1
        return _convolves(_layer_jaxpr(block, params, consts, x)) or 1
    if isinstance(unroll, bool) or (isinstance(unroll, int) and unroll >= 1):
        return unroll
    raise ValueError(
        f"{fn}: `unroll` must be a positive int, True/False or None, got {unroll!r}. Fix: "
        "unroll=True (every layer unrolled), unroll=1 (a rolled loop) or None (the measured "
        "default for the backend and block)."
    )


class _Stack(NamedTuple):
    """A stack split into ``num_segments`` anchored segments: its forward and its backward."""

    block: ReversibleBlock
    num_segments: int
    unroll: int | bool
    fallback: str
    rtol: float
    report: bool  # report to a probe's cotangent (remat_nn._drift.report_drift_to), not the host

    @property
    def keep_starts(self) -> bool:  # the stack's input is kept for recomputes
        return self.fallback == "recompute"

    def forward(self, params, consts, x, checks: bool):
        """``(y, new_consts, starts, sketches)``; ``starts``: the anchors (with the stack's input
        first for ``fallback="recompute"``), ``sketches``: each layer's input's, if ``checks``."""
        block, unroll = self.block, self.unroll
        if self.num_segments == 1:
            y, new_consts, sketches = _forward_layers(block, params, consts, x, unroll, checks)
            return y, new_consts, None, sketches

        def segment(carry, seg):
            seg_params, seg_consts = seg
            y, new_consts, sketches = _forward_layers(
                block, seg_params, seg_consts, carry, unroll, checks
            )
            return y, (new_consts, carry, sketches)

        segs = (_segments(params, self.num_segments), _segments(consts, self.num_segments))
        y, (new_consts, starts, sketches) = _named_axes.scan(segment, x, segs, unroll=unroll)
        # starts[s] is the input of segment s: starts[0] is x, the others are the anchors.
        if not self.keep_starts:
            starts = jax.tree.map(lambda a: a[1:], starts)
        return y, _unsegment(new_consts), starts, sketches

    def backward(self, params, consts, y, starts, sketches, dy):
        """``(dx, dparams, counts)``; ``counts``: :func:`remat_nn._drift.counts` (failed
        stacks, recomputed layers) with ``report``, else None (a failed check raises)."""
        args = (params, consts, y, starts, sketches, dy)
        if self.fallback == "error":
            # Flagged in the loop and refused once at the end: a conditional per layer cost
            # RevNet-38's step 11% (an unrolled stack's conditionals break its stream of ops).
            dx, dparams, (layer, drift, _) = self.backward_with(
                *args, mode="flag", unroll=self.unroll
            )
            if self.report:
                return dx, dparams, _drift.counts(layer >= 0, 0)
            _drift.refuse_if(layer >= 0, _DRIFTED, layer, drift, self.rtol)
            return dx, dparams, None
        if self.fallback != "recompute" or self.unroll is not True:
            mode, unroll = self.fallback, self.unroll
            dx, dparams, (_, _, n) = self.backward_with(*args, mode=mode, unroll=unroll)
            return dx, dparams, self._counts(n if mode == "recompute" else 0)
        # Unrolled, a recompute branch per layer would be a loop per layer, each with buffers
        # of its own (memory growing with depth): the unrolled backward only flags drift, and
        # if a layer drifted, the backward runs again rolled, recomputing where needed.
        dx, dparams, (layer, _, _) = self.backward_with(*args, mode="flag", unroll=True)

        def rolled(*a):
            dx, dparams, (_, _, n) = self.backward_with(*a, mode="recompute", unroll=1)
            return dx, dparams, n

        dx, dparams, n = _drift.when(layer >= 0, rolled, args, (dx, dparams, jnp.int32(0)))
        return dx, dparams, self._counts(n)

    def _counts(self, recomputed: jax.Array | int) -> jax.Array | None:
        return _drift.counts(0, recomputed) if self.report else None

    def backward_with(self, params, consts, y, starts, sketches, dy, mode, unroll):
        """``(dx, dparams, first)`` with the drift check in ``mode`` (``first``: see
        :func:`_backward_layers`)."""

        def check(sk, start, offset):
            if self.fallback == "none":
                return None
            return _Check(mode, self.rtol, sk, start, offset, self.report)

        block, num_segments = self.block, self.num_segments
        if num_segments == 1:
            chk = check(sketches, starts, 0)
            return _backward_layers(block, params, consts, y, dy, unroll, chk)

        def segment(carry, seg):
            dy, first = carry
            p, c, end, start, sk, s = seg
            chk = check(sk, start, s * (_depth(params, consts) // num_segments))
            dx, dp, seg_first = _backward_layers(block, p, c, end, dy, unroll, chk)
            return (dx, _first(first, seg_first[2] > 0, *seg_first)), dp

        anchors = jax.tree.map(lambda a: a[1:], starts) if self.keep_starts else starts
        ends = jax.tree.map(lambda a, last: jnp.concatenate([a, last[None]]), anchors, y)
        segs = (
            _segments(params, num_segments),
            _segments(consts, num_segments),
            ends,
            starts if self.keep_starts else None,
            sketches,
            jnp.arange(num_segments),
        )
        init = (dy, _none_drifted())
        (dx, first), dparams = _named_axes.scan(segment, init, segs, reverse=True, unroll=unroll)
        return dx, _unsegment(dparams), first


def _make_reversible(stack: _Stack) -> Callable:
    """The custom_vjp of ``stack``."""
    axes = _named_axes.BoundAxes()

    # probe: None, or what the backward reports to (remat_nn._drift.report_drift_to).
    @jax.custom_vjp
    def run(params, consts, x, probe):
        return stack.forward(params, consts, x, checks=False)[:2]

    def run_fwd(params, consts, x, probe):
        axes.capture()
        y, new_consts, starts, sketches = stack.forward(
            params, consts, x, checks=stack.fallback != "none"
        )
        # The residuals: parameters and constants (the caller holds them anyway), the output,
        # num_segments - 1 anchors, and with the drift check (k + 2) floats per layer, plus the
        # stack's input for fallback="recompute". Nothing per layer of an activation's size.
        # (Under shard_map, also the input types, for 0 bytes: see _named_axes.)
        types = _named_axes.type_witness((params, x, probe))
        if stack.keep_starts and stack.num_segments == 1:
            starts = x
        return (y, new_consts), (params, consts, y, starts, sketches, types)

    def run_bwd(res, cts):
        params, consts, y, starts, sketches, types = res
        dy, _ = cts  # new_consts are not differentiated (see ReversibleBlock.forward)
        with axes.rebound():  # a block's collectives (BatchNorm's pmean) under vmap
            dx, dparams, counts = stack.backward(params, consts, y, starts, sketches, dy)
        # (Under shard_map, a replicated probe's counts are summed over the devices.)
        dparams, dx, counts = _named_axes.cotangents_like((dparams, dx, counts), types)
        return dparams, None, dx, counts

    run.defvjp(run_fwd, run_bwd)
    return run


def reversible_scan(
    block: ReversibleBlock,
    params: PyTree,
    x: PyTree,
    consts: PyTree = None,
    *,
    anchor_every: int | None = None,
    recon_dtype: Any = None,
    unroll: int | bool | None = None,
    drift_rtol: float | None = None,
    fallback: str = "error",
) -> tuple[PyTree, PyTree]:
    """Applies ``depth`` invertible blocks with a backward that reconstructs, not stores.

    Compiled once (``lax.scan`` over layers). The forward saves the output, ``params``,
    ``consts`` and ``depth / anchor_every - 1`` anchors; the backward reconstructs each block's
    input from its output in a reverse scan, so activation memory does not grow with depth. The
    gradient equals plain autodiff of :func:`plain_scan` up to floating-point reconstruction
    error.

    Args:
      block: the layer, see :class:`ReversibleBlock` (e.g. from :func:`coupling_block`).
      params: per-layer parameters stacked on a leading axis of length ``depth``; differentiated.
      x: the input of the first block (a pytree, e.g. a pair ``(x1, x2)``).
      consts: per-layer non-differentiated values stacked like ``params`` (PRNG keys, BatchNorm
        statistics), or ``None``.
      anchor_every: store the block input every ``anchor_every`` blocks so that reconstruction
        restarts from a stored value and drift accumulates over at most ``anchor_every`` blocks;
        must divide ``depth``. ``None``: no anchors.
      recon_dtype: carry the residual stream, and reconstruct, in this dtype (e.g.
        ``jnp.float32`` when the blocks compute in bfloat16). The output is cast back to the
        dtype of ``x``.
      unroll: ``unroll`` of ``lax.scan``, the same for the forward scan and the backward's
        reverse scan (and the segment scans of ``anchor_every``): a positive int (blocks per
        loop iteration) or ``True`` (no loop). It changes speed and compile time, not the
        results or what is stored: the custom VJP saves the same residuals either way
        (unrolled, XLA may also keep a parameter-sized copy of per-layer slices). ``None``
        (default): ``True`` on CPU when the block convolves (XLA:CPU runs convolutions in a
        loop many times slower than unrolled, jax-ml/jax#12868), else ``1`` (dense blocks run no
        faster unrolled on CPU and compile longer; GPU/TPU run loops at full speed).
      drift_rtol: the largest relative drift (2-norm error over 2-norm) a rebuilt layer input
        may have. The forward keeps ``k + 2`` floats per layer (random projections of the
        layer's input, :mod:`remat_nn._drift`), and the backward measures every rebuilt input
        against them: the actual error, not a bound. ``None`` (default): 2048 times the
        machine epsilon of the narrowest float the stream or the block computes in (float32:
        2.4e-4; bfloat16 branches on a float32 stream: 0.1; the projections' own rounding is
        about 1e-7). A float32 stack's gradient error was 0.2x to 14x its largest layer drift
        on the canonical-stacks matrix: pass a smaller one (down to about 1e-6 in float32)
        for a tighter check.
      fallback: what a layer whose rebuilt input drifted past ``drift_rtol`` gets:
        ``"error"`` (default): :class:`remat_nn.NotInvertibleError` at run time (one host
        callback, staged in a branch that runs only then). ``"recompute"``: its input is
        recomputed forward from the nearest kept value (the stack's input, kept for this, or
        the anchor of its segment) and its VJP taken there; the layers below are rebuilt from
        that exact value. Memory stays flat in depth, but XLA reserves the recompute branch's
        buffers beside the backward's own (measured on RevNet-38, batch 64: temp 62.9 MB
        unchecked, 61.8 MB with ``"error"``, 122.7 MB with ``"recompute"``), and a recompute
        costs ``anchor_every`` (or ``depth``) block forwards. ``"none"``: no check (nothing
        kept; the gradient is whatever reconstruction gives).

    Returns:
      ``(y, new_consts)``: the output of the last block, and the per-layer ``new_consts`` of
      the forward pass stacked like ``consts``. ``new_consts`` is not differentiated.

    >>> import jax, jax.numpy as jnp, remat_nn as rn
    >>> f = lambda p, c, x: (jnp.tanh(x * p["a"]), c)
    >>> block = rn.coupling_block(f, f)
    >>> params = {"a": jnp.linspace(0.1, 0.5, 8)}  # depth 8
    >>> x = (jnp.ones(3), jnp.zeros(3))
    >>> loss = lambda p, x: jnp.sum(rn.reversible_scan(block, p, x)[0][0])
    >>> plain = lambda p, x: jnp.sum(rn.plain_scan(block, p, x)[0][0])
    >>> rn.relative_error(jax.grad(loss)(params, x), jax.grad(plain)(params, x)) < 1e-5
    True

    References:
      Gomez et al. (2017), The Reversible Residual Network; Kitaev et al. (2020), Reformer: The
      Efficient Transformer (reversible layers in a scan over layers); MemCNN (Van de Leemput
      et al. 2019).
    """
    if not isinstance(block, ReversibleBlock):
        raise TypeError(
            f"reversible_scan: `block` must be a ReversibleBlock, got {type(block).__name__}. "
            "Fix: rn.ReversibleBlock(forward, inverse) or rn.coupling_block(f, g)."
        )
    depth = _depth(params, consts)
    num_segments = depth // _validate_anchor(anchor_every, depth)
    _drift.validate("reversible_scan", fallback, drift_rtol)
    dtypes = jax.tree.map(lambda a: a.dtype, x)
    stream = _cast(x, _stream_dtypes(x, recon_dtype))
    unroll = _unroll(unroll, "reversible_scan", block, params, consts, stream)
    if drift_rtol is None:  # fallback="none" checks nothing: no tolerance to work out
        drift_rtol = 0.0 if fallback == "none" else _default_rtol(block, params, consts, stream)
    sink = _drift.current_sink()
    stack = _Stack(block, num_segments, unroll, fallback, float(drift_rtol), sink is not None)
    y, new_consts = _make_reversible(stack)(params, consts, stream, sink and sink.take())
    return _cast(y, dtypes), new_consts


def plain_scan(
    block: ReversibleBlock,
    params: PyTree,
    x: PyTree,
    consts: PyTree = None,
    *,
    recon_dtype: Any = None,
    unroll: int | bool | None = None,
) -> tuple[PyTree, PyTree]:
    """The same stack as :func:`reversible_scan`, differentiated by plain autodiff.

    The baseline: every block's activations are saved for the backward, so memory grows
    linearly with depth. Same arguments and results as :func:`reversible_scan` (``recon_dtype``
    and ``unroll`` as there).

    >>> import jax.numpy as jnp, remat_nn as rn
    >>> block = rn.coupling_block(lambda p, c, x: (x * p, c), lambda p, c, x: (x * p, c))
    >>> rn.plain_scan(block, jnp.ones(2), (jnp.ones(1), jnp.ones(1)))[0]
    (Array([5.], dtype=float32), Array([8.], dtype=float32))
    """
    _depth(params, consts)
    dtypes = jax.tree.map(lambda a: a.dtype, x)
    stream = _cast(x, _stream_dtypes(x, recon_dtype))
    unroll = _unroll(unroll, "plain_scan", block, params, consts, stream)
    y, new_consts, _ = _forward_layers(block, params, consts, stream, unroll)
    return _cast(y, dtypes), new_consts


def inverse_scan(
    block: ReversibleBlock,
    params: PyTree,
    y: PyTree,
    consts: PyTree = None,
    *,
    recon_dtype: Any = None,
    unroll: int | bool | None = None,
) -> PyTree:
    """Inverts a stack: the input ``x`` of :func:`reversible_scan` given its output ``y``.

    Runs ``block.inverse`` from the last layer to the first. Not differentiable by design
    (use it to measure drift, or to invert a flow). ``recon_dtype`` and ``unroll`` as in
    :func:`reversible_scan`.

    >>> import jax.numpy as jnp, remat_nn as rn
    >>> block = rn.coupling_block(lambda p, c, x: (x * p, c), lambda p, c, x: (x * p, c))
    >>> rn.inverse_scan(block, jnp.ones(2), (jnp.array([5.0]), jnp.array([8.0])))
    (Array([1.], dtype=float32), Array([1.], dtype=float32))
    """
    _depth(params, consts)
    dtypes = jax.tree.map(lambda a: a.dtype, y)
    stream = _cast(y, _stream_dtypes(y, recon_dtype))
    unroll = _unroll(unroll, "inverse_scan", block, params, consts, stream)

    def step(carry, layer):
        p, c = layer
        return block.inverse(p, c, carry), None

    x, _ = _named_axes.scan(step, stream, (params, consts), reverse=True, unroll=unroll)
    return _cast(x, dtypes)
