"""The optimizer update inside the backward pass, for several stacks of layers with state.

``fused_update_stages`` extends :func:`remat_nn.fused_update_step` to a model made of stages
(``embed``; per stage an optional non-stacked function, then a scan over a stack of layers;
``head``), e.g. the stages of a RevNet or ResNet whose widths and resolutions differ. Each
stack's layers are updated by its reverse scan as soon as their gradients are known; the
non-stacked parameters at the end. Every function also carries non-trainable state
(BatchNorm's running averages): the forward pass computes the new state once, and the
backward's recomputation or reconstruction of a layer uses the state the forward saw.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from remat_nn import _drift, _named_axes
from remat_nn._fused_state import (
    _check_element_wise,
    _Layout,
    _read,
    _split,
    _squared_norm,
    _stack_halves,
    _update_rest,
)
from remat_nn._fused_update import (
    _backward_update,
    _clipped,
    _Inputs,
    _segments,
    _stack_norm,
    check_clip_norm,
    check_report_drift,
    check_save_every,
    drift_check,
    drift_report,
)
from remat_nn._tie import tie, zero_after

if TYPE_CHECKING:  # optax is the caller's (the [train] extra), not a core dependency
    import optax

__all__ = ["FusedStage", "fused_update_stages"]


@dataclass(frozen=True)
class FusedStage:
    """One stage of :func:`fused_update_stages`: a non-stacked function, then a stack of layers.

    Attributes:
      key: ``params[key]`` is the stage's stack (a leading layer axis on every leaf), and
        ``state[key]``, if present, its layers' state stacked the same way.
      layer: ``(layer_params, layer_state, h) -> (h, new_layer_state)``, one layer (the state
        is ``{}`` when ``state`` has no ``key``).
      before: ``(rest, rest_state, h) -> (h, new_rest_state)``, applied before the stack (e.g.
        a downsampling unit), its parameters in ``rest``; None: nothing.
      inverse: ``(layer_params, layer_state, y) -> h`` with ``layer(...)[0] == y``: the backward
        rebuilds each layer's input from its output instead of the forward saving it (as
        :func:`remat_nn.fused_update_step`'s ``inverse_fn``).
      backward: instead of ``inverse``, the inverse fused with the layer's VJP,
        ``(layer_params, layer_state, y, dy) -> (h, d_layer_params, dh)`` (``backward_fn``).
      save_every: the forward saves the input of every ``save_every``-th layer of the stack
        only, and the backward recomputes a segment's inputs from its saved one, each layer
        with the state the forward gave it (the recomputation's new state is dropped: the
        state moves once per step), as :func:`remat_nn.fused_update_step`'s ``save_every``.
        Per stage: ``k ~ sqrt(depth)`` holds ``ceil(depth / k) + k`` inputs instead of
        ``depth``. Not with ``inverse`` or ``backward`` (a rebuilt stack saves no inputs).
        None: every layer's input is saved.
      drift_rtol, fallback: with ``inverse`` / ``backward``, the measured drift check of every
        rebuilt layer input and what a drifted one gets (``"error"``, ``"recompute"`` from
        the stack's input, ``"none"``), as :func:`remat_nn.fused_update_step`'s.
    """

    key: str
    layer: Callable[[Any, Any, Any], tuple[Any, Any]]
    before: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None
    inverse: Callable[[Any, Any, Any], Any] | None = None
    backward: Callable[[Any, Any, Any, Any], tuple[Any, Any, Any]] | None = None
    save_every: int | None = None
    drift_rtol: float | None = None
    fallback: str = "error"


def fused_update_stages(
    embed_fn: Callable[[Any, Any, Any], tuple[Any, Any]],
    stages: Sequence[FusedStage],
    head_fn: Callable[[Any, Any, Any, Any], tuple[Any, Any]],
    optimizer: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    norms: bool = False,
    clip_norm: float | None = None,
    report_drift: bool = False,
) -> Callable[[Any, Any, Any, Any], tuple[Any, ...]]:
    """A train step over several stacks of layers that updates each layer in the backward pass.

    The model is ``h, s = embed_fn(rest, s, batch)``; for each stage, ``h, s =
    stage.before(rest, s, h)`` and a scan of ``stage.layer`` over ``params[stage.key]`` (and
    ``state[stage.key]``); then ``loss, s = head_fn(rest, s, h, batch)``. ``rest`` is the
    parameters but the stacks, ``s`` the state but the stacks'. As in
    :func:`remat_nn.fused_update_step`, each layer's parameters and optimizer state are
    updated right after its gradient is known (the full gradient never exists), and ``rest``
    at the end; the result equals the two-phase step for element-wise optimizers. Each layer
    is recomputed from its saved input (with a stage's ``save_every``, from the input the
    backward recomputed from its segment's saved one) or rebuilt from its output
    (``inverse``/``backward``), with the state the forward saw; the non-stacked functions are
    differentiated by ``jax.vjp`` (wrap one in ``jax.checkpoint`` to recompute it instead of
    storing it: the recomputation is tied to the incoming cotangent, so it runs when the
    backward reaches the unit on every backend). Jit the step with ``donate_argnums=(0, 1,
    2)``.

    Args:
      embed_fn: ``(rest, rest_state, batch) -> (h, rest_state)``.
      stages: the :class:`FusedStage` s, in the order the forward applies them.
      head_fn: ``(rest, rest_state, h, batch) -> (loss, rest_state)`` (``loss`` a scalar, or
        ``(loss, aux)`` with ``has_aux``).
      optimizer: an element-wise optax transformation; ``opt_state = optimizer.init(params)``.
      has_aux: ``head_fn``'s loss is ``(loss, aux)``; so is the step's.
      norms: also return ``{"grad_norm", "update_norm"}``.
      clip_norm: clip the gradient by its global norm (a first backward pass computes it), as
        in :func:`remat_nn.fused_update_step`.
      report_drift: with ``norms``, the stages' drift checks report in the norms' dict
        (``drift_failed``, ``drift_recomputed``, summed over the stages) and raise nothing,
        as in :func:`remat_nn.fused_update_step`.

    Returns:
      ``step(params, opt_state, state, batch) -> (params, opt_state, state, loss)`` (and the
      norms' dict with ``norms``); ``params`` and ``state`` are dicts holding the stacks at the
      stages' keys (``state`` may omit a stage without state, or be ``{}``); the new state is
      the forward pass's.

    >>> import jax, jax.numpy as jnp, optax
    >>> import remat_nn as rn
    >>> def layer(w, avg, h):  # a layer normalizing by its batch's mean, with a running average
    ...     mean = jnp.mean(h, axis=0, keepdims=True)  # (1, D)
    ...     return jnp.tanh((h - mean) @ w) + h, 0.9 * avg + 0.1 * mean[0]
    >>> stages = [
    ...     rn.FusedStage("a", layer),
    ...     rn.FusedStage("b", layer, before=lambda rest, s, h: (h @ rest["down"], s)),
    ... ]
    >>> step = rn.fused_update_stages(
    ...     lambda rest, s, x: (x, s), stages,
    ...     lambda rest, s, h, x: (jnp.mean(h**2), s), optax.adam(1e-2),
    ... )
    >>> params = {"a": jnp.ones((3, 4, 4)) / 8, "b": jnp.ones((2, 2, 2)) / 8,
    ...           "down": jnp.ones((4, 2))}
    >>> state = {"a": jnp.zeros((3, 4)), "b": jnp.zeros((2, 2))}
    >>> tx_state = optax.adam(1e-2).init(params)
    >>> params, tx_state, state, loss = jax.jit(step, donate_argnums=(0, 1, 2))(
    ...     params, tx_state, state, jnp.arange(8.0).reshape(2, 4)
    ... )
    >>> state["b"].shape, params["down"].shape
    ((2, 2), (4, 2))
    """
    stages = tuple(stages)
    keys = _check_stages(stages, clip_norm)
    check_report_drift(report_drift, norms, "fused_update_stages")
    whole = _Keys(keys)
    checked: list[bool] = []

    def step(params: Any, opt_state: Any, state: Any, batch: Any) -> tuple[Any, ...]:
        whole.check(params, state)
        if not checked:
            for key in keys:
                _check_element_wise(optimizer, params, _Layout(key), "fused_update_stages")
            checked.append(True)
        stacks, rest = whole.parts(params)
        consts = {k: state.get(k, {}) for k in keys}
        h, tape, new_consts, rest_state = _forward(
            embed_fn, stages, rest, stacks, consts, state, batch, report_drift
        )
        out, head_vjp, (aux, rest_state) = jax.vjp(
            partial(_head, head_fn, has_aux, rest_state, batch), rest, h, has_aux=True
        )
        g_head, dh = head_vjp(jnp.ones_like(out))
        clip = None
        if clip_norm is not None:  # the first backward pass: the global norm only
            g_norm = _global_norm(stages, tape, stacks, consts, dh, g_head)
            clip = partial(_clipped, g_norm=g_norm, max_norm=clip_norm)
        split = _split(opt_state, params, whole)
        stacks, halves, g_rest, sq, drift = _backward(
            optimizer, split, stages, tape, stacks, consts, dh, g_head, clip
        )
        g_rest = g_rest if clip is None else clip(g_rest)
        rest, opt_state, sq_rest = _update_rest(optimizer, split, whole, halves, rest, g_rest)
        kept = {k: v for k, v in new_consts.items() if k in state}
        new = (whole.join(stacks, rest), opt_state, {**rest_state, **kept})
        value = (out, aux) if has_aux else out
        if not norms:
            return (*new, value)
        sq = jax.tree.map(jnp.add, sq, sq_rest)
        grad_norm = jnp.sqrt(sq[0]) if clip_norm is None else g_norm
        out = {"grad_norm": grad_norm, "update_norm": jnp.sqrt(sq[1])}
        return (*new, value, {**out, **drift_report(report_drift, drift)})

    return step


def _check_stages(stages: tuple[Any, ...], clip_norm: Any) -> tuple[str, ...]:
    """The stages' keys; refuses bad stages or options, naming the fix."""
    bad = [type(s).__name__ for s in stages if not isinstance(s, FusedStage)]
    if not stages or bad:
        raise TypeError(
            f"fused_update_stages: stages must be a non-empty sequence of rn.FusedStage, got "
            f"{bad or 'none'}. Fix: stages=[rn.FusedStage('stage0', layer_fn), ...]."
        )
    keys = tuple(s.key for s in stages)
    if len(set(keys)) != len(keys):
        raise ValueError(
            f"fused_update_stages: each stage needs its own stack, got the keys {list(keys)}. "
            "Fix: one FusedStage per key of the params holding a stack."
        )
    both = [s.key for s in stages if s.inverse is not None and s.backward is not None]
    if both:
        raise ValueError(
            f"fused_update_stages: stages {both} give inverse and backward; backward is the "
            "inverse fused with the layer's VJP. Fix: drop inverse."
        )
    for s in stages:
        check_save_every(s.save_every, f"fused_update_stages: stage {s.key!r}")
        _drift.validate(f"fused_update_stages: stage {s.key!r}", s.fallback, s.drift_rtol)
    rebuilt = [
        s.key
        for s in stages
        if s.save_every is not None and (s.inverse is not None or s.backward is not None)
    ]
    if rebuilt:
        raise ValueError(
            f"fused_update_stages: stages {rebuilt} give save_every with inverse or backward: a "
            "reversible stack rebuilds its inputs and saves none. Fix: drop save_every."
        )
    check_clip_norm(clip_norm, "fused_update_stages")
    return keys


class _Keys(_Layout):
    """The stacks of all stages: ``parts(tree) = ({key: stack}, rest)``; ``join`` inverts it.

    As :class:`_Layout` for one key, a part given as None is left out, so the rest's update
    sees the parameters but the stacks, with their paths.
    """

    def __init__(self, keys: tuple[str, ...]):
        super().__init__(None)
        self.keys = keys

    def parts(self, tree: Any) -> tuple[Any, Any]:
        return (
            {k: tree[k] for k in self.keys if k in tree},
            {k: v for k, v in tree.items() if k not in self.keys},
        )

    def join(self, stack: Any, rest: Any) -> Any:
        return {**(rest or {}), **(stack or {})}

    def check(self, params: Any, state: Any = None) -> None:
        if not isinstance(params, Mapping) or any(k not in params for k in self.keys):
            got = sorted(params) if isinstance(params, Mapping) else type(params).__name__
            raise TypeError(
                f"fused_update_stages: params must be a dict holding each stage's stack at its "
                f"key {list(self.keys)}, got {got}. Fix: the stages' keys (nn.scan's names)."
            )
        if not isinstance(state, Mapping):
            raise TypeError(
                f"fused_update_stages: state must be a dict (BatchNorm's batch_stats, or {{}}), "
                f"got {type(state).__name__}. Fix: step(params, opt_state, {{}}, batch)."
            )
        for key in self.keys:
            _Layout(key).check(params)


def _forward(
    embed_fn: Callable[..., Any],
    stages: tuple[FusedStage, ...],
    rest: Any,
    stacks: dict[str, Any],
    consts: dict[str, Any],
    state: Any,
    batch: Any,
    report: bool = False,
) -> tuple[Any, _Tape, dict[str, Any], Any]:
    """The forward pass: the last stack's output, the tape the backward walks, the stacks' new
    state and the rest's new state; ``report``: the drift checks report (``report_drift``)."""
    rest_state = {k: v for k, v in state.items() if k not in stacks}
    embed = lambda r: embed_fn(r, rest_state, batch)  # noqa: E731
    h, embed_vjp, rest_state = jax.vjp(embed, rest, has_aux=True)
    per_stage, new_consts = [], {}
    for stage in stages:
        before_vjp = None
        if stage.before is not None:
            before = partial(_with_state, stage.before, rest_state)
            h, vjp, rest_state = jax.vjp(before, rest, h, has_aux=True)
            before_vjp = partial(_tied, vjp, rest)
        h, source, new_consts[stage.key] = _stack_forward(
            stage, stacks[stage.key], consts[stage.key], h, report
        )
        per_stage.append((before_vjp, source))
    return h, (embed_vjp, per_stage), new_consts, rest_state


#: What the backward walks: the embedding's VJP; per stage, its ``before``'s VJP (or None) and
#: its layers' inputs (saved, or rebuilt from the stack's output).
_Tape = tuple[Callable[[Any], Any], list[tuple[Callable[[Any], Any] | None, _Inputs]]]


def _with_state(fn: Callable[..., Any], state: Any, rest: Any, h: Any) -> tuple[Any, Any]:
    return fn(rest, state, h)


def _head(
    head_fn: Callable[..., Any], has_aux: bool, state: Any, batch: Any, rest: Any, h: Any
) -> tuple[Any, tuple[Any, Any]]:
    out, state = head_fn(rest, state, h, batch)
    return (out[0], (out[1], state)) if has_aux else (out, (None, state))


def _stack_forward(
    stage: FusedStage, stack: Any, consts: Any, h0: Any, report: bool = False
) -> tuple[Any, _Inputs, Any]:
    """One stack's forward scan: its output, its layers' inputs (saved unless the backward
    rebuilds them; every ``save_every``-th only) and the layers' new state."""
    if stage.save_every is not None:
        return _segments(stage.layer, h0, stack, stage.save_every, consts)
    rebuilds = stage.inverse is not None or stage.backward is not None
    sketch = rebuilds and stage.fallback != "none"

    def forward(h: Any, xs: tuple[Any, Any]) -> tuple[Any, Any]:
        y, new_const = stage.layer(*xs, h)
        return y, (_drift.sketch(h) if sketch else None if rebuilds else h, new_const)

    h_last, (inputs, new_consts) = _named_axes.scan(forward, h0, (stack, consts))
    if not rebuilds:
        return h_last, _Inputs(inputs, None, None, None), new_consts

    def rerun(stack: Any, j: Any, h: Any) -> Any:  # layer j as the forward ran it
        return stage.layer(_read(stack, j), _read(consts, j), h)[0]

    check = None
    if sketch:
        check = drift_check(stage.fallback, stage.drift_rtol, inputs, h0, rerun, stack, report)
    return h_last, _Inputs(None, h_last, stage.inverse, stage.backward, check), new_consts


def _walk(
    tape: _Tape, dh: Any, g_rest: Any, through_stack: Callable[[int, _Inputs, Any], Any]
) -> Any:
    """The backward over the stages: ``through_stack(k, inputs, dh) -> dh`` for stack ``k``,
    the VJPs of the non-stacked functions between; the gradient of ``rest``."""
    embed_vjp, per_stage = tape
    for k in reversed(range(len(per_stage))):
        before_vjp, source = per_stage[k]
        dh = through_stack(k, source, dh)
        if before_vjp is not None:
            g_before, dh = before_vjp(dh)
            g_rest = jax.tree.map(jnp.add, g_rest, g_before)
    (g_embed,) = embed_vjp(dh)
    return jax.tree.map(jnp.add, g_rest, g_embed)


def _tied(vjp: Callable[[Any], Any], rest: Any, dh: Any) -> Any:
    """``vjp(dh)`` with the residuals tied to ``dh`` (see :mod:`remat_nn._tie`), but those that
    are leaves of ``rest`` (parameters, read as they are: tying would copy them). A unit under
    ``jax.checkpoint`` then recomputes here, not at the start of the backward pass, where
    XLA:CPU, which drops ``prevent_cse``'s barrier, would run it (or keep the forward's)."""
    zero = zero_after(dh)
    params = {id(x) for x in jax.tree.leaves(rest)}
    leaves, treedef = jax.tree.flatten(vjp)
    return treedef.unflatten([x if id(x) in params else tie(x, zero) for x in leaves])(dh)


def _global_norm(
    stages: tuple[FusedStage, ...],
    tape: _Tape,
    stacks: dict[str, Any],
    consts: dict[str, Any],
    dh: Any,
    g_head: Any,
) -> jax.Array:
    """The whole gradient's global norm, from a backward pass keeping only sums of squares."""
    sq = []

    def through_stack(k: int, source: _Inputs, dh: Any) -> Any:
        key = stages[k].key
        dh, sq_k = _stack_norm(stages[k].layer, stacks[key], source, dh, consts[key])
        sq.append(sq_k)
        return dh

    g_rest = _walk(tape, dh, g_head, through_stack)
    return jnp.sqrt(sum(sq, _squared_norm(g_rest)))


def _backward(
    tx: optax.GradientTransformation,
    split: Any,
    stages: tuple[FusedStage, ...],
    tape: _Tape,
    stacks: dict[str, Any],
    consts: dict[str, Any],
    dh: Any,
    g_head: Any,
    clip: Callable[[Any], Any] | None,
) -> tuple[dict[str, Any], list[Any], Any, tuple[jax.Array, jax.Array], list[Any]]:
    """The backward pass updating each stack per layer: the new stacks, the optimizer state's
    new stack halves (per mirror node, ``{key: stack}``), the rest's gradient, the stacks'
    squared norms of the gradient and the update, and each stack's drift counts (or None)."""
    new_stacks, halves, sq, drift = {}, {}, [], []

    def through_stack(k: int, source: _Inputs, dh: Any) -> Any:
        key, layout = stages[k].key, _Layout(stages[k].key)
        new_stacks[key], halves[key], dh, sq_k, drift_k = _backward_update(
            stages[k].layer,
            tx,
            split,
            layout,
            stacks[key],
            _stack_halves(split, layout),
            source,
            dh,
            clip,
            consts=consts[key],
        )
        sq.append(sq_k)
        drift.append(drift_k)
        return dh

    g_rest = _walk(tape, dh, g_head, through_stack)
    per_mirror = [dict(zip(halves, h, strict=True)) for h in zip(*halves.values(), strict=True)]
    zero = jnp.zeros((), jnp.result_type(float))
    total = jax.tree.map(lambda *x: sum(x, zero), *sq)
    return new_stacks, per_mirror, g_rest, total, drift
