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
from remat_nn import _reversible_check as rc
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


def _backward_layers(block: ReversibleBlock, params, consts, y, dy, unroll, check=None):
    """``(dx, dparams, worst)``: the reverse scan over layers; ``worst`` is ``(layer, drift,
    count)`` of the layer whose rebuilt input failed ``check`` by the most and of how many
    failed (``rc.none_drifted()`` if none, or without a check)."""

    def step(carry, layer):
        y, dy, after, first = carry
        (p, c), i, ref = layer
        # This block's parameters are tied to the previous step's gradients, so its
        # reconstruction cannot start before that step's backward is done: unrolled, XLA would
        # otherwise reconstruct every block first and hold them all. (Tying the parameters, not
        # the activations: XLA fuses a tie into every consumer of the tied value, and a fused
        # tie on an activation keeps the buffers it is computed from alive, layer after layer.)
        p, c = tie((p, c), after)
        x, dp, dx = rc.block_vjp(block, p, c, y, dy)
        if check is not None:
            rebuilt = (x, dp, dx)
            (x, dp, dx), bad, drift = rc.checked(
                block, params, consts, check, p, c, dy, i, ref, rebuilt
            )
            first = rc.worst(first, bad, check.offset + i, drift)
        dx = _cast(dx, jax.tree.map(lambda a: a.dtype, dy))
        return (x, dx, zero_after((dp, dx), after.dtype), first), dp

    # The zero rides in the carry in the stream's dtype (a bfloat16 stream stays bfloat16).
    first_after = (dy, None if check is None else check.after)
    carry = (y, dy, zero_after(first_after, jax.tree.leaves(dy)[0].dtype), rc.none_drifted())
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


def _default_rtol(block: ReversibleBlock, params: PyTree, consts: PyTree, x: PyTree):
    """``(rtol, eps)``: the drift tolerance of a stack whose stream is ``x``
    (:func:`remat_nn._drift.default_rtol` of the stream and of what its blocks compute in:
    bfloat16 branches rebuild a float32 stream to bfloat16 precision only, and plain
    autodiff's gradient is no more precise), and that narrowest dtype's machine epsilon."""
    computes = _drift.float_dtypes(_layer_jaxpr(block, params, consts, x))
    return _drift.default_rtol(x, computes), _drift.default_eps(x, computes)


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
    eps: float | None = None  # the default tolerance: loosened by the stack's sensitivity to eps

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
        if self.fallback == "none" or (
            self.fallback == "recompute" and self.unroll is not True and self.eps is None
        ):  # checked (and recomputed) layer by layer, or not at all
            mode = self.fallback
            dx, dparams, (_, _, n) = self.backward_with(*args, mode=mode, unroll=self.unroll)
            return dx, dparams, self._counts(n if mode == "recompute" else 0)
        # Flagged in the loop and judged once at the end: a conditional per layer cost
        # RevNet-38's step 11% (an unrolled stack's conditionals break its stream of ops), and
        # the default tolerance is known only then (rc.loosened: from the input's cotangent).
        # The output's norms are taken first, the backward's checks tied after them: taken at
        # the end, they kept y and dy alive through it (RevNet-38's peak 2.7% above unchecked).
        norms = None if self.eps is None else (rc.norm(y), rc.norm(dy))
        dx, dparams, (layer, drift, _) = self.backward_with(
            *args, mode="flag", unroll=self.unroll, after=norms
        )
        bad, tol = self._judge(layer, drift, sketches, norms, dx)
        if self.fallback == "error":
            if self.report:
                return dx, dparams, _drift.counts(bad, 0)
            _drift.refuse_if(bad, rc.DRIFTED, layer, drift, tol)
            return dx, dparams, None
        # "recompute": the backward runs again, rolled, recomputing every layer past drift_rtol
        # (unrolled, a recompute branch per layer would be a loop per layer, each with buffers
        # of its own: memory growing with depth).
        rolled = 1 if self.unroll is True else self.unroll

        def again(*a):
            dx, dparams, (_, _, n) = self.backward_with(*a, mode="recompute", unroll=rolled)
            return dx, dparams, n

        dx, dparams, n = _drift.when(bad, again, args, (dx, dparams, jnp.int32(0)))
        return dx, dparams, self._counts(n)

    def _judge(self, layer, drift, sketches, norms, dx):
        """``(refused, tolerance)`` of a backward whose worst layer is ``layer`` (-1: none
        drifted past ``rtol``) with ``drift``; the default tolerance is raised by the stack's
        condition number (``rc.loosened``: from the first layer's sketch, the norms of the
        output and its cotangent and the input's cotangent ``dx``, nothing recomputed)."""
        drifted = layer >= 0
        if norms is None:
            return drifted, jnp.float32(self.rtol)
        first = sketches.reshape((-1, sketches.shape[-1]))[0]  # (segments and) layers
        assert self.eps is not None  # norms are taken for the default tolerance only
        tol = rc.loosened(self.rtol, self.eps, first, norms[0], norms[1], dx)
        return drifted & ~(drift <= tol), tol

    def _counts(self, recomputed: jax.Array | int) -> jax.Array | None:
        return _drift.counts(0, recomputed) if self.report else None

    def backward_with(self, params, consts, y, starts, sketches, dy, mode, unroll, after=None):
        """``(dx, dparams, worst)`` with the drift check in ``mode`` (``worst``: see
        :func:`_backward_layers`); the first layer's after ``after`` (values, or None)."""

        def check(sk, start, offset):
            if self.fallback == "none":
                return None
            return rc.Check(mode, self.rtol, sk, start, offset, self.report, after)

        block, num_segments = self.block, self.num_segments
        if num_segments == 1:
            chk = check(sketches, starts, 0)
            return _backward_layers(block, params, consts, y, dy, unroll, chk)

        def segment(carry, seg):
            dy, first = carry
            p, c, end, start, sk, s = seg
            chk = check(sk, start, s * (_depth(params, consts) // num_segments))
            dx, dp, seg_first = _backward_layers(block, p, c, end, dy, unroll, chk)
            return (dx, rc.worst(first, seg_first[2] > 0, *seg_first)), dp

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
        init = (dy, rc.none_drifted())
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
        for a tighter check. Only the default is raised, for a chaotic stack: to 30
        epsilons times the stack's relative condition number, estimated from the backward's
        cotangents (:mod:`remat_nn._reversible_check`), where that is larger.
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
    eps = None  # the default tolerance follows the stack's sensitivity (_reversible_check)
    if drift_rtol is None and fallback != "none":  # "none" checks nothing: no tolerance
        drift_rtol, eps = _default_rtol(block, params, consts, stream)
    sink = _drift.current_sink()
    rtol = float(drift_rtol or 0.0)
    stack = _Stack(block, num_segments, unroll, fallback, rtol, sink is not None, eps)
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
