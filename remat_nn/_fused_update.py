"""The optimizer update inside the backward pass, for a stack of layers applied with a scan.

``fused_update_step`` builds a train step whose backward is a reverse ``lax.scan`` that, right
after computing layer ``i``'s gradient, applies the optimizer's update to layer ``i``'s slice of
the parameter stack and of the optimizer state (``dynamic_update_index_in_dim`` on the carried
stacks). The full gradient of the stack never exists: at any time one layer's gradient is live.
Jitted with the state donated, the updates are written into the old state's buffers. Each
layer's input is saved by the forward, or, for a reversible layer (``inverse_fn`` /
``backward_fn``), rebuilt from its output in the backward.

Only element-wise optimizers qualify (the update of a leaf reads only that leaf's gradient,
state and parameter). The step checks this once, numerically, before its first use: see
``_fused_state._check_element_wise`` (with the optimizer state's split per layer).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from remat_nn import _drift, _named_axes
from remat_nn._fused_state import (
    Split,
    _check_element_wise,
    _depth,
    _Layout,
    _read,
    _split,
    _squared_norm,
    _stack_halves,
    _update_rest,
    _update_slice,
    _write,
)

if TYPE_CHECKING:  # optax is the caller's (the [train] extra), not a core dependency
    import optax

__all__ = ["fused_update_step"]

# Transformations whose update of a leaf reads the whole gradient; each with the alternative.


def fused_update_step(
    embed_fn: Callable[[Any, Any], jax.Array],
    layer_fn: Callable[[Any, jax.Array], jax.Array],
    head_fn: Callable[[Any, jax.Array, Any], Any],
    optimizer: optax.GradientTransformation,
    *,
    stack_key: str | None = None,
    has_aux: bool = False,
    norms: bool = False,
    inverse_fn: Callable[[Any, Any], Any] | None = None,
    backward_fn: Callable[[Any, Any, Any], tuple[Any, Any, Any]] | None = None,
    save_every: int | None = None,
    clip_norm: float | None = None,
    drift_rtol: float | None = None,
    fallback: str = "error",
    report_drift: bool = False,
) -> Callable[[Any, Any, Any], tuple[Any, ...]]:
    """A train step that updates each layer of a stack as soon as its gradient is known.

    The model is ``head_fn(rest, scan(layer_fn, embed_fn(rest, batch), stack), batch) -> loss``
    with ``params = (stack, rest)`` (or, with ``stack_key``, a dict holding the stack at that key
    and ``rest`` = the other keys): every leaf of ``stack`` has a leading layer axis. The step's
    backward recomputes one layer at a time from its saved input (remat per layer), takes that
    layer's VJP, updates that layer's parameters and optimizer state in place, and moves on; the
    parameters in ``rest`` (embeddings, head, norms outside the stack) are updated at the end.
    Jit it with ``donate_argnums=(0, 1)`` so the in-place updates reuse the old state's buffers.

    The result equals the two-phase step (``jax.grad``, then ``optimizer.update``) for
    element-wise optimizers (sgd with momentum, adam, adamw, lion, their schedules), up to
    float32 round-off of the reordered arithmetic. Others are refused with
    :class:`FusedUpdateError` on the first call.

    Args:
      embed_fn: ``(rest, batch) -> h``, the input of the first layer.
      layer_fn: ``(layer_params, h) -> h``, one layer; ``layer_params`` is one slice of ``stack``.
      head_fn: ``(rest, h, batch) -> loss``, a scalar loss from the last layer's output
        (``(loss, aux)`` with ``has_aux``).
      optimizer: an optax transformation; ``opt_state = optimizer.init(params)``.
      stack_key: None: ``params`` is the pair ``(stack, rest)``; a string: ``params`` is a dict
        and ``params[stack_key]`` is the stack (flax's parameters of an ``nn.scan`` named so).
        The optimizer then sees one layer as ``{stack_key: layer}``: callable masks (weight
        decay by path) see the same paths as on the whole parameters.
      has_aux: ``head_fn`` returns ``(loss, aux)``; the step returns ``(loss, aux)`` as its loss.
      norms: also return ``{"grad_norm", "update_norm"}``, the global norms of the gradient and
        of the update (accumulated layer by layer: the full gradient still never exists).
      inverse_fn: ``(layer_params, y) -> h`` with ``layer_fn(layer_params, h) == y`` (a
        reversible layer, e.g. an additive coupling). The forward then keeps no layer inputs:
        the backward rebuilds each layer's input from its output with the layer's parameters
        before their update, so activation memory does not grow with depth. The rebuilt inputs
        carry the inverse's round-off, accumulated over the layers (as with
        :func:`remat_nn.reversible_scan`); the layer runs twice per backward step (inverse,
        then its VJP). ``None``: each layer's input is saved by the forward.
      backward_fn: instead of ``inverse_fn``, the inverse fused with the layer's VJP:
        ``(layer_params, y, dy) -> (h, d_layer_params, dh)``, e.g. the ``backward`` of
        :func:`remat_nn.coupling_block` (adapted to take no consts), which runs each branch of
        a coupling once and holds one branch's residuals at a time; a plain VJP of the whole
        layer holds both branches' at once.
      save_every: the forward saves the input of every ``save_every``-th layer only (layers 0,
        k, 2k, ...); before the VJPs of a segment's layers, the backward recomputes their
        inputs from the segment's saved one (one more forward pass of the stack in all). Layer
        inputs held: ``ceil(L / k) + k`` instead of ``L`` (``k ~ sqrt(L)``: the two-level
        nesting of :func:`remat_nn.remat_scan`). ``None``: every layer's input is saved.
      clip_norm: clip the gradient by its global norm before the optimizer, as
        ``optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)`` does (pass
        ``optimizer`` without the clip). The norm is known only once every layer's gradient is,
        so a first backward pass computes it (nothing stored but the running sum, as in LOMO),
        and the second scales each layer's gradient before its update: one more backward pass
        (with its recomputation), no gradient stack. The returned ``grad_norm`` is the norm
        before clipping.
      drift_rtol, fallback: with ``inverse_fn`` / ``backward_fn``, every rebuilt layer input is
        measured against random projections the forward keeps of it (10 floats per layer), as
        in :func:`remat_nn.reversible_scan`: a layer whose input drifted past ``drift_rtol``
        (``None``: 2048 times the epsilon of the narrowest float the input or a layer computes
        in: float32 2.4e-4) raises ``NotInvertibleError``
        (``"error"``, default), or is recomputed forward from the stack's input (kept for this)
        and its VJP taken there (``"recompute"``: XLA then reserves the recompute branch's
        buffers too); ``"none"`` checks nothing.
      report_drift: with ``norms``, the checks raise nothing and call nothing on the host:
        the norms' dict also holds ``drift_failed`` (layers whose check failed, with
        ``"error"``: the caller must refuse the step, whose update is already taken) and
        ``drift_recomputed`` (layers recomputed), float32 counts. A step without host
        callbacks is one JAX's persistent compilation cache can store (``python -m train``
        reports so). ``False``: a failed check raises, recomputes are counted by
        :func:`remat_nn.drift_recomputes`.

    Returns:
      ``step(params, opt_state, batch) -> (new_params, new_opt_state, loss)``, loss before the
      update (``(loss, aux)`` with ``has_aux``), and the norms' dict as a fourth element with
      ``norms``.

    >>> import jax, jax.numpy as jnp, optax
    >>> import remat_nn as rn
    >>> tx = optax.adam(1e-2)
    >>> step = rn.fused_update_step(
    ...     lambda rest, x: x * rest["scale"],
    ...     lambda w, h: jnp.tanh(h @ w),
    ...     lambda rest, h, x: jnp.mean((h - x) ** 2),
    ...     tx,
    ... )
    >>> params = (jnp.ones((3, 4, 4)) * 0.1, {"scale": jnp.ones(())})
    >>> params, opt_state, loss = jax.jit(step, donate_argnums=(0, 1))(
    ...     params, tx.init(params), jnp.ones((2, 4))
    ... )
    >>> params[0].shape
    (3, 4, 4)
    """
    _check_options(inverse_fn, backward_fn, save_every, clip_norm)
    _drift.validate("fused_update_step", fallback, drift_rtol)
    check_report_drift(report_drift, norms, "fused_update_step")
    layout = _Layout(stack_key)
    checked: list[bool] = []

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, ...]:
        layout.check(params)
        if not checked:
            _check_element_wise(optimizer, params, layout)
            checked.append(True)
        stack, rest = layout.parts(params)
        split = _split(opt_state, params, layout)
        h0, embed_vjp = jax.vjp(lambda r: embed_fn(r, batch), rest)

        if save_every is not None:
            h_last, source, _ = _segments(layer_fn, h0, stack, save_every)
        else:
            rebuild = (inverse_fn, backward_fn, fallback, drift_rtol, report_drift)
            h_last, source = _forward(layer_fn, h0, stack, *rebuild)
        if has_aux:
            out, head_vjp, aux = jax.vjp(
                lambda r, h: head_fn(r, h, batch), rest, h_last, has_aux=True
            )
        else:
            out, head_vjp = jax.vjp(lambda r, h: head_fn(r, h, batch), rest, h_last)
            aux = None
        g_rest, dh = head_vjp(jnp.ones_like(out))
        clip = None
        if clip_norm is not None:  # the first backward pass: the global norm only
            g_norm = _gradient_norm(layer_fn, stack, source, dh, embed_vjp, g_rest)
            clip = partial(_clipped, g_norm=g_norm, max_norm=clip_norm)
        stacks = _stack_halves(split, layout)
        stack, stacks, dh, sq, drift = _backward_update(
            layer_fn, optimizer, split, layout, stack, stacks, source, dh, clip
        )
        (g_embed,) = embed_vjp(dh)
        g_rest = jax.tree.map(jnp.add, g_rest, g_embed)
        g_rest = g_rest if clip is None else clip(g_rest)
        rest, opt_state, sq_rest = _update_rest(optimizer, split, layout, stacks, rest, g_rest)
        value = (out, aux) if has_aux else out
        new = (layout.join(stack, rest), opt_state, value)
        if not norms:
            return new
        sq = jax.tree.map(jnp.add, sq, sq_rest)
        grad_norm = jnp.sqrt(sq[0]) if clip_norm is None else g_norm
        out = {"grad_norm": grad_norm, "update_norm": jnp.sqrt(sq[1])}
        return (*new, {**out, **drift_report(report_drift, [drift])})

    return step


def check_report_drift(report_drift: Any, norms: Any, where: str) -> None:
    """Refuses ``report_drift`` without ``norms`` (the counts ride in the norms' dict)."""
    if report_drift and not norms:
        raise ValueError(
            f"{where}: report_drift=True returns the drift counts in the norms' dict, but "
            "norms=False returns none. Fix: norms=True with report_drift=True."
        )


def drift_report(report_drift: bool, counts: list[jax.Array | None]) -> dict[str, jax.Array]:
    """The norms' dict's drift counts (:data:`remat_nn._drift.REPORT_FIELDS`): ``counts`` of
    every checked stack summed (zeros if no stack is checked); empty without ``report_drift``."""
    if not report_drift:
        return {}
    total = sum((c for c in counts if c is not None), _drift.counts(0, 0))
    return dict(zip(_drift.REPORT_FIELDS, total, strict=True))


def _check_options(inverse_fn: Any, backward_fn: Any, save_every: Any, clip_norm: Any) -> None:
    """Refuses bad or clashing options of :func:`fused_update_step`, naming the fix."""
    if inverse_fn is not None and backward_fn is not None:
        raise ValueError(
            "fused_update_step: pass inverse_fn or backward_fn, not both (backward_fn is the "
            "inverse fused with the layer's VJP). Fix: drop inverse_fn."
        )
    rebuilds = inverse_fn is not None or backward_fn is not None
    check_save_every(save_every, "fused_update_step")
    check_clip_norm(clip_norm, "fused_update_step")
    if save_every is not None and rebuilds:
        raise ValueError(
            "fused_update_step: save_every with inverse_fn or backward_fn: a reversible stack "
            "rebuilds its inputs and saves none. Fix: drop save_every."
        )


def check_save_every(save_every: Any, where: str) -> None:
    """Refuses a ``save_every`` that is not None or a positive int, naming ``where``."""
    if save_every is not None and (
        isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1
    ):
        raise ValueError(
            f"{where}: save_every must be a positive int (save every k-th layer's "
            f"input), got {save_every!r}. Fix: save_every=4, or None to save every input."
        )


def check_clip_norm(clip_norm: Any, where: str) -> None:
    """Refuses a ``clip_norm`` that is not None or a positive finite number, naming ``where``."""
    if clip_norm is not None and (
        isinstance(clip_norm, bool)
        or not isinstance(clip_norm, int | float)
        or not 0 < clip_norm < float("inf")
    ):
        raise ValueError(
            f"{where}: clip_norm must be a positive finite number (the largest global "
            f"gradient norm), got {clip_norm!r}. Fix: clip_norm=1.0, or None not to clip."
        )


class _Inputs:
    """Layer ``i``'s input and VJP in the backward: from the saved input, or rebuilt.

    Rebuilt (``inverse_fn`` or ``backward_fn`` given), the reverse scan carries the output of
    layer ``i`` (``carry``) and inverts it with layer ``i``'s parameters before their update.
    Functions that also take a layer's state (``(params, state, y)``, ``(params, state, y,
    dy)``) are used through :meth:`bound`.
    """

    def __init__(
        self,
        saved: Any,
        carry: Any,
        inverse_fn: Callable[..., Any] | None,
        backward_fn: Callable[..., tuple[Any, Any, Any]] | None,
        check: DriftCheck | None = None,
    ):
        self.saved, self.carry = saved, carry
        self.inverse_fn, self.backward_fn = inverse_fn, backward_fn
        self.check = check

    def bound(self, const: Any) -> _Inputs:
        """These inputs for layer functions that also take a layer's state, given ``const``."""
        inverse, backward = self.inverse_fn, self.backward_fn
        return _Inputs(
            self.saved,
            self.carry,
            None if inverse is None else lambda p, y: inverse(p, const, y),
            None if backward is None else lambda p, y, dy: backward(p, const, y, dy),
            self.check,
        )

    def input(self, stack: Any, layer: Any, carry: Any, i: jax.Array) -> tuple[Any, Any]:
        """Layer ``i``'s input, and the carry for layer ``i - 1``."""
        del stack
        if self.inverse_fn is None:
            return _read(self.saved, i), carry
        h = self.inverse_fn(layer, carry)
        return h, h

    def vjp(
        self,
        layer_fn: Callable[[Any, Any], Any],
        stack: Any,
        layer: Any,
        carry: Any,
        dh: Any,
        i: jax.Array,
    ) -> tuple[tuple[Any, Any, Any], jax.Array | None]:
        """``((layer i's gradient, its input's cotangent, the carry for layer i - 1), counts)``;
        ``counts``: the drift check's (:meth:`DriftCheck.verify`), or None."""
        if self.check is not None:
            rebuilt = _Inputs(self.saved, self.carry, self.inverse_fn, self.backward_fn)
            out, _ = rebuilt.vjp(layer_fn, stack, layer, carry, dh, i)
            return self.check.verify(layer_fn, stack, layer, dh, i, out)
        if self.backward_fn is not None:
            h, grad, dh = self.backward_fn(layer, carry, dh)
            return (grad, dh, h), None
        h, carry = self.input(stack, layer, carry, i)
        _, layer_vjp = jax.vjp(layer_fn, layer, h)
        # The layer's forward (its residuals) finishes before its backward starts. Else XLA
        # begins the backward with the cotangent, which is there from the start, during the
        # recomputation and holds what it computed across it (the benchmark transformer: 19 MiB
        # more). A no-op for a layer under a remat plan, whose residuals are its inputs: hence
        # the models hand a layer under `full` over plain (models._spec.fused_unit_plan).
        dh, layer_vjp = _named_axes.optimization_barrier((dh, layer_vjp))
        grad, dh = layer_vjp(dh)
        return (grad, dh, carry), None


def _recomputed(layer: Any) -> None:
    _drift.recomputed(f"fused update layer {int(layer)}")


_DRIFTED = """\
fused_update_step: the input of layer {layer}, rebuilt from its output, is off by {drift:.3g} of \
its norm (drift_rtol={rtol:g}), so its gradient and update would be wrong. Fix: \
normalized layers; fallback="recompute" (recompute a drifted layer's input from the stack's \
input, at a memory cost); or no inverse_fn / backward_fn (the forward then saves every input)."""


class DriftCheck:
    """The measured drift check of a rebuilt stack: the forward's sketch of every layer's
    input (``(L, k + 2)``, :mod:`remat_nn._drift`), the stack's input ``start`` (kept for
    recomputes), ``rerun(stack, j, h)``: layer ``j`` on ``h`` as the forward ran it."""

    def __init__(
        self,
        sketches: Any,
        start: Any,
        rerun: Callable,
        fallback: str,
        rtol: float,
        report: bool = False,
    ):
        self.sketches, self.start, self.rerun = sketches, start, rerun
        self.fallback, self.rtol, self.report = fallback, rtol, report

    def verify(self, layer_fn, stack, layer, dy, i, rebuilt):
        """``(rebuilt, counts)``: ``rebuilt`` = ``(grad, dh, h)`` of layer ``i`` if its input
        ``h`` passes; else recomputed from ``start`` (its VJP taken there), or an error. With
        ``report``, no error: ``counts`` (:func:`remat_nn._drift.counts`) says it; else None."""
        drift = _drift.drift(rebuilt[2], _read(self.sketches, i))
        bad = ~(drift <= self.rtol)
        if self.fallback == "error":
            if self.report:
                return rebuilt, _drift.counts(bad, 0)
            _drift.refuse_if(bad, _DRIFTED, i, drift, self.rtol)
            return rebuilt, None

        def recompute(stack, layer, dy, i, start):
            if not self.report:
                jax.debug.callback(_recomputed, i)
            rerun = lambda j, h: self.rerun(stack, j, h)  # noqa: E731
            h = _drift.replay(rerun, start, _depth(stack), i)
            grad, dh = jax.vjp(layer_fn, layer, h)[1](dy)
            return grad, dh, h

        out = _drift.when(bad, recompute, (stack, layer, dy, i, self.start), rebuilt)
        return out, (_drift.counts(0, bad) if self.report else None)


def drift_check(
    fallback: str,
    rtol: float | None,
    sketches: Any,
    start: Any,
    rerun: Callable,
    stack: Any,
    report: bool = False,
) -> DriftCheck | None:
    """The :class:`DriftCheck` of a rebuilt stack, or None for ``fallback="none"``. The default
    tolerance reads the dtypes layer 0 computes in, as :func:`remat_nn.reversible_scan`'s."""
    if fallback == "none":
        return None
    if rtol is None:
        computes = _drift.float_dtypes(jax.make_jaxpr(rerun)(stack, 0, start).jaxpr)
        rtol = _drift.default_rtol(start, computes)
    return DriftCheck(sketches, start, rerun, fallback, float(rtol), report)


class _Segments(_Inputs):
    """Inputs saved every ``k`` layers; a segment's are recomputed into ``carry`` (k slots)
    when the backward reaches its last layer, with its layers' parameters before their update.

    ``run(stack, j, h)`` is layer ``j`` on ``h`` as the forward ran it (with layer ``j``'s
    state, if the layers have state: the recomputation's new state is dropped)."""

    def __init__(
        self, anchors: Any, buffer: Any, k: int, length: int, run: Callable[[Any, Any, Any], Any]
    ):
        super().__init__(anchors, buffer, None, None)
        self.k, self.length, self.run = k, length, run

    def bound(self, const: Any) -> _Inputs:
        del const  # ``run`` reads each recomputed layer's own state
        return self

    def input(self, stack: Any, layer: Any, carry: Any, i: jax.Array) -> tuple[Any, Any]:
        del layer
        start = (i // self.k) * self.k

        def refill(buffer: Any) -> Any:
            def one(j: jax.Array, state: tuple[Any, Any]) -> tuple[Any, Any]:
                h, buffer = state
                return self.run(stack, j, h), _write(buffer, h, j - start)

            first = _read(self.saved, i // self.k)
            return _named_axes.fori_loop(start, i + 1, one, (first, buffer))[1]

        last = (i == self.length - 1) | ((i + 1) % self.k == 0)  # a segment's last layer
        carry = lax.cond(last, refill, lambda b: b, carry)
        return _read(carry, i - start), carry


def _segments(
    layer_fn: Callable[..., Any], h0: Any, stack: Any, k: int, consts: Any = None
) -> tuple[Any, _Segments, Any]:
    """The forward scan saving the input of layers 0, k, 2k, ... (``anchors``).

    With ``consts`` (the layers' state, stacked), ``layer_fn`` is ``(params, state, h) -> (h,
    new_state)`` and the layers' new states are returned, stacked; else ``(params, h) -> h``
    and None."""
    length = _depth(stack)
    # Slots of h0's type (inside shard_map: varying as h0 does); their values are never read
    # before a layer's input is written there.
    slots = lambda n: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), h0)  # noqa: E731

    def apply(layer: Any, const: Any, h: Any) -> tuple[Any, Any]:
        return (layer_fn(layer, h), None) if consts is None else layer_fn(layer, const, h)

    def forward(carry: tuple[Any, Any], xs: tuple[Any, Any, jax.Array]) -> tuple[Any, Any]:
        (h, anchors), (layer, const, i) = carry, xs
        keep = i % k == 0
        slot = jax.tree.map(partial(jnp.where, keep), h, _read(anchors, i // k))
        h, new_const = apply(layer, const, h)
        return (h, _write(anchors, slot, i // k)), new_const

    def run(stack: Any, j: jax.Array, h: Any) -> Any:
        return apply(_read(stack, j), _read(consts, j), h)[0]

    init = (h0, slots(-(-length // k)))
    xs = (stack, consts, jnp.arange(length))
    (h_last, anchors), new_consts = _named_axes.scan(forward, init, xs)
    return h_last, _Segments(anchors, slots(min(k, length)), k, length, run), new_consts


def _backward_update(
    layer_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    split: Split,
    layout: _Layout,
    stack: Any,
    stacks: list[Any],
    source: _Inputs,
    dh: Any,
    clip: Callable[[Any], Any] | None = None,
    consts: Any = None,
) -> tuple[Any, list[Any], Any, tuple[jax.Array, jax.Array], jax.Array | None]:
    """Reverse scan carrying the parameter stack and the state's stack halves, updated per slice.
    Returns them, the input's cotangent, the squared norms and the drift counts of a check
    that reports (:class:`DriftCheck`; summed over the layers), else None.

    Also carries the squared norms of the gradients and of the updates taken so far, and the
    input source's carry: a reversible layer's output (the next input is rebuilt from it), or
    the current segment's recomputed inputs (``save_every``). With ``consts`` (the layers'
    non-trainable state, stacked), the layer functions take layer ``i``'s slice of it.
    """

    reports = source.check is not None and source.check.report

    def body(carry: Any, i: jax.Array) -> Any:
        stack, stacks, dh, sq, y, counts = carry
        fn, src = _layer_at(layer_fn, source, consts, i)
        (grad, dh, y), counts_i = src.vjp(fn, stack, _read(stack, i), y, dh, i)
        grad = grad if clip is None else clip(grad)
        stack, stacks, sq_i, (dh, y) = _update_slice(
            tx, split, layout, stack, stacks, grad, i, after=(dh, y)
        )
        counts = counts if counts_i is None else counts + counts_i
        return (stack, stacks, dh, jax.tree.map(jnp.add, sq, sq_i), y, counts), None

    zero = jnp.zeros((), jnp.result_type(float))
    init = (stack, stacks, dh, (zero, zero), source.carry, _drift.counts(0, 0) if reports else None)
    stack, stacks, dh, sq, _, counts = _reverse_over_layers(body, init, stack)
    return stack, stacks, dh, sq, counts


def _layer_at(
    layer_fn: Callable[..., Any], source: _Inputs, consts: Any, i: jax.Array
) -> tuple[Callable[[Any, Any], Any], _Inputs]:
    """``layer_fn`` and ``source`` as functions of (parameters, input) for layer ``i``: as they
    are without ``consts``; else given layer ``i``'s state (its updated state is dropped: the
    forward pass computed it, the backward's recomputation must not count it twice)."""
    if consts is None:
        return layer_fn, source
    const = _read(consts, i)
    return (lambda p, h: layer_fn(p, const, h)[0]), source.bound(const)


def _gradient_norm(
    layer_fn: Callable[[Any, Any], Any],
    stack: Any,
    source: _Inputs,
    dh: Any,
    embed_vjp: Callable[[Any], Any],
    g_head: Any,
) -> jax.Array:
    """The global norm of the whole gradient, from a backward pass that keeps only its sum of
    squares (layer by layer, then the embedding's and head's parameters, summed per leaf first:
    a leaf both use, e.g. tied embeddings, counts once)."""

    dh, sq = _stack_norm(layer_fn, stack, source, dh)
    (g_embed,) = embed_vjp(dh)
    return jnp.sqrt(sq + _squared_norm(jax.tree.map(jnp.add, g_head, g_embed)))


def _stack_norm(
    layer_fn: Callable[..., Any], stack: Any, source: _Inputs, dh: Any, consts: Any = None
) -> tuple[Any, jax.Array]:
    """A backward pass over ``stack``: the input's cotangent and the gradient's squared norm."""

    def body(carry: Any, i: jax.Array) -> Any:
        dh, sq, y = carry
        fn, src = _layer_at(layer_fn, source, consts, i)
        (grad, dh, y), _ = src.vjp(fn, stack, _read(stack, i), y, dh, i)
        return (dh, sq + _squared_norm(grad), y), None

    zero = jnp.zeros((), jnp.result_type(float))
    dh, sq, _ = _reverse_over_layers(body, (dh, zero, source.carry), stack)
    return dh, sq


def _clipped(tree: Any, *, g_norm: jax.Array, max_norm: float) -> Any:
    """``optax.clip_by_global_norm``'s scaling of ``tree`` for the global norm ``g_norm``."""
    trigger = g_norm < max_norm
    return jax.tree.map(
        lambda t: lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), tree
    )


def _forward(
    layer_fn: Callable[[Any, Any], Any],
    h0: Any,
    stack: Any,
    inverse_fn: Callable[[Any, Any], Any] | None,
    backward_fn: Callable[[Any, Any, Any], tuple[Any, Any, Any]] | None,
    fallback: str = "none",
    drift_rtol: float | None = None,
    report: bool = False,
) -> tuple[Any, _Inputs]:
    """The forward scan, saving every layer's input unless the backward rebuilds them (then a
    sketch of each, for the drift check)."""
    rebuilds = inverse_fn is not None or backward_fn is not None
    sketch = rebuilds and fallback != "none"

    def forward(h: Any, layer: Any) -> tuple[Any, Any]:
        kept = _drift.sketch(h) if sketch else None
        return layer_fn(layer, h), (kept if rebuilds else h)

    h_last, inputs = _named_axes.scan(forward, h0, stack)  # inputs: (L, *h.shape)
    if not rebuilds:
        return h_last, _Inputs(inputs, None, None, None)
    rerun = lambda stack, j, h: layer_fn(_read(stack, j), h)  # noqa: E731
    check = drift_check(fallback, drift_rtol, inputs, h0, rerun, stack, report) if sketch else None
    return h_last, _Inputs(None, h_last, inverse_fn, backward_fn, check)


def _reverse_over_layers(body: Callable[[Any, jax.Array], Any], init: Any, stack: Any) -> Any:
    """``body(carry, i)`` for the layers ``i = L - 1, ..., 0`` of ``stack``; the last carry."""
    return _named_axes.scan(body, init, jnp.arange(_depth(stack)), reverse=True)[0]
