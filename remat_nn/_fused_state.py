"""The optimizer state of a fused update, per layer: where the stack sits in the parameters
(:class:`_Layout`), the optimizer state split into the stack's slices, the rest and the per-step
scalars, the update of one layer's slice and of the rest, and the check that an optimizer is
element-wise (it refuses, with :class:`FusedUpdateError`, one whose update of a leaf reads more
than that leaf). The backward scan that calls them: :mod:`remat_nn._fused_update`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from remat_nn.errors import RematNNError

if TYPE_CHECKING:  # optax is the caller's (the [train] extra), not a core dependency
    import optax

__all__ = ["FusedUpdateError"]


class FusedUpdateError(RematNNError, ValueError):
    """The optimizer cannot be applied per layer inside the backward pass.

    Example: ``fused_update_step(..., optimizer=optax.chain(optax.clip_by_global_norm(1.0),
    optax.adam(1e-3)))`` needs the norm of the whole gradient before any layer is updated.
    """


class _Layout:
    """Where the stack is in ``params``: ``params[key]`` (a dict), or ``params[0]`` of a pair.

    ``join(stack, rest)`` puts a part back in its place; a part given as None is left out, so the
    optimizer sees one layer as ``{key: layer}`` (or ``(layer, ())``) with the same paths as in
    the whole parameters (masks given as callables on paths see the same names).
    """

    def __init__(self, key: str | None):
        self.key = key

    def parts(self, tree: Any) -> tuple[Any, Any]:
        if self.key is None:
            return tree[0], tree[1]
        return tree.get(self.key), {k: v for k, v in tree.items() if k != self.key}

    def join(self, stack: Any, rest: Any) -> Any:
        if self.key is None:
            return (() if stack is None else stack, () if rest is None else rest)
        return {**(rest or {}), **({} if stack is None else {self.key: stack})}

    def check(self, params: Any) -> None:
        if self.key is None and not (isinstance(params, tuple) and len(params) == 2):
            raise TypeError(
                f"fused_update_step: params must be a pair (stack, rest), got "
                f"{type(params).__name__}; put the stacked layer parameters first and everything "
                "else second, e.g. params = (variables['params']['layers'], other_params), or "
                "pass stack_key='layers' to keep the parameter dict as it is."
            )
        if self.key is not None and not (isinstance(params, dict) and self.key in params):
            got = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise TypeError(
                f"fused_update_step: stack_key={self.key!r} needs params to be a dict with that "
                f"key, got {got}. Fix: stack_key= the key of the stacked layers (nn.scan's name)."
            )
        leaves = jax.tree.leaves(self.parts(params)[0])
        if not leaves or len({x.shape[:1] for x in leaves}) != 1 or leaves[0].ndim == 0:
            shapes = [x.shape for x in leaves]
            where = "params[0]" if self.key is None else f"params[{self.key!r}]"
            raise ValueError(
                f"fused_update_step: every leaf of {where} (the stack) needs the same leading "
                f"layer axis, got shapes {shapes}; stack the layers with "
                "jax.tree.map(jnp.stack, ...) or nn.scan's variable_axes={'params': 0}."
            )


# --- splitting the optimizer state: stack slices, rest, and per-step scalars ---------------------
# An optax state mirrors the parameters wherever it holds per-parameter values (adam's mu and nu,
# momentum's trace): such a node has the tree structure of ``params``. Per layer the step calls
# ``optimizer.update`` on ``join(layer_i, None)`` with each mirror node replaced by its slice
# ``join(m_stack[i], None)``; the rest is updated on ``join(None, rest)``. Every other leaf
# (adam's ``count``, schedules' step) is passed unchanged to every call and taken from the rest
# update, so it advances exactly once per step.


def _mirror_test(treedef: Any) -> Callable[[Any], bool]:
    def is_mirror(node: Any) -> bool:
        return isinstance(node, tuple | dict) and jax.tree.structure(node) == treedef

    return is_mirror


Split = tuple[Any, list[Any], list[bool]]


def _split(opt_state: Any, params: Any, layout: _Layout) -> Split:
    del layout  # the mirrors are found by the structure of the whole parameters
    is_mirror = _mirror_test(jax.tree.structure(params))
    flat, treedef = jax.tree.flatten(opt_state, is_leaf=is_mirror)
    return treedef, flat, [is_mirror(x) for x in flat]


def _stack_halves(split: Split, layout: _Layout) -> list[Any]:
    _, flat, is_mirror = split
    return [layout.parts(x)[0] for x, m in zip(flat, is_mirror, strict=True) if m]


def _flatten_like(state: Any, params: Any) -> list[Any]:
    return jax.tree.flatten(state, is_leaf=_mirror_test(jax.tree.structure(params)))[0]


def _state_for(split: Split, layout: _Layout, *, stacks: list[Any] | None) -> Any:
    """The state of one layer (``stacks`` = its slices) or, with None, of the rest."""
    treedef, flat, is_mirror = split
    if stacks is None:
        return treedef.unflatten(
            [
                layout.join(None, layout.parts(x)[1]) if m else x
                for x, m in zip(flat, is_mirror, strict=True)
            ]
        )
    sliced = iter(stacks)
    return treedef.unflatten(
        [layout.join(next(sliced), None) if m else x for x, m in zip(flat, is_mirror, strict=True)]
    )


def _update_slice(
    tx: optax.GradientTransformation,
    split: Split,
    layout: _Layout,
    stack: Any,
    stacks: list[Any],
    grad: Any,
    i: jax.Array | int,
    after: Any = None,
) -> tuple[Any, list[Any], tuple[jax.Array, jax.Array], Any]:
    """Updates layer ``i`` of the parameter stack and of the state's stack halves.

    ``after``: values computed from layer ``i``'s old parameters (in the backward: the input's
    cotangent and the scan's carry), returned unchanged, the new slices written after them.
    """

    def update(stack: Any, grad: Any, stacks: list[Any], i: jax.Array, after: Any) -> Any:
        layer = _read(stack, i)
        slices = [_read(s, i) for s in stacks]
        state_i = _state_for(split, layout, stacks=slices)
        updates, new_state_i = tx.update(layout.join(grad, None), state_i, layout.join(layer, None))
        new_flat = _flatten_like(new_state_i, layout.join(layer, None))
        new_slices = [layout.parts(x)[0] for x, m in zip(new_flat, split[2], strict=True) if m]
        updates = layout.parts(updates)[0]
        sq = (_squared_norm(grad), _squared_norm(updates))
        return _apply_updates(layer, updates), new_slices, sq, lax.optimization_barrier(after)

    # The update runs as a branch of a conditional: XLA does not fuse across it, so no read of an
    # old slice is fused into a consumer scheduled after the slice's write (which would make XLA
    # copy the whole stack each iteration). The state's slices are read inside the branch, which
    # runs once the gradient exists: read outside, XLA scheduled those reads before the layer's
    # backward, and every state slice (adam: 2 x the layer's bytes) was live at its peak. So are
    # the layer's parameters: a slice read outside (the one the VJP read) is materialized for the
    # branch and stays live from the VJP to the update, across the layer's backward peak. Every
    # read of the old parameters must still precede their write, or XLA copies the stack's leaf:
    # the reads feeding only the input's cotangent or the rebuilt input (a reversible layer's)
    # are not the gradient's, so ``after`` goes through the branch, and the write depends on it.
    # (The barrier keeps JAX from forwarding ``after`` around the conditional as unchanged.)
    operands = (stack, grad, stacks, jnp.asarray(i), after)
    new_layer, new_slices, sq, after = lax.cond(jnp.asarray(i) >= 0, update, update, *operands)
    stack = _write(stack, new_layer, i)
    return stack, [_write(s, n, i) for s, n in zip(stacks, new_slices, strict=True)], sq, after


def _update_rest(
    tx: optax.GradientTransformation,
    split: Split,
    layout: _Layout,
    stacks: list[Any],
    rest: Any,
    g_rest: Any,
) -> tuple[Any, Any, tuple[jax.Array, jax.Array]]:
    """Updates the non-stacked parameters; also advances the per-step scalars exactly once."""
    treedef, _, is_mirror = split
    updates, new_state = tx.update(
        layout.join(None, g_rest),
        _state_for(split, layout, stacks=None),
        layout.join(None, rest),
    )
    updates = layout.parts(updates)[1]
    sq = (_squared_norm(g_rest), _squared_norm(updates))
    rest = _apply_updates(rest, updates)
    carried = iter(stacks)
    new_flat = _flatten_like(new_state, layout.join(None, rest))
    state = treedef.unflatten(
        [
            layout.join(next(carried), layout.parts(x)[1]) if m else x
            for x, m in zip(new_flat, is_mirror, strict=True)
        ]
    )
    return rest, state, sq


def _squared_norm(tree: Any) -> jax.Array:
    dtype = jnp.result_type(float)  # float32, or float64 with jax_enable_x64
    leaves = jax.tree.leaves(tree)
    return sum((jnp.sum(jnp.square(x.astype(dtype))) for x in leaves), jnp.zeros((), dtype))


def _depth(stack: Any) -> int:
    return jax.tree.leaves(stack)[0].shape[0]


def _read(stack: Any, i: jax.Array | int) -> Any:
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), stack)


def _write(stack: Any, layer: Any, i: jax.Array | int) -> Any:
    return jax.tree.map(lambda s, x: lax.dynamic_update_index_in_dim(s, x, i, 0), stack, layer)


# --- refusing optimizers that are not element-wise ------------------------------------------------
# Two checks, both before the first step is traced. A deny-list names the optax transformations
# known to read the whole gradient (found in the optimizer's update closures), with the
# alternative for each. Then a numerical probe, which covers transformations nobody listed: on
# small random parameters of the same tree and ranks (so callable masks see the same ranks), two
# steps of the per-layer split update must equal the whole update. The gradients are large
# (norm 1e3 per element) so that norm-based clipping, if any, is active during the probe.

_WHOLE_GRADIENT = {
    "clip_by_global_norm": "pass the optimizer without it and clip_norm= to the fused step (a "
    "second backward pass computes the global norm first), or clip each layer separately with "
    "optax.clip_by_block_rms or optax.clip (element-wise)",
    "MultiSteps": "gradient accumulation keeps a full gradient buffer, which is what the fused "
    "step removes: use the two-phase step with optax.MultiSteps",
    "scale_by_trust_ratio": "the trust ratio is a norm over the whole stacked leaf: use the "
    "two-phase step",
    "adaptive_grad_clip": "the clipping norm is taken over the whole stacked leaf: use the "
    "two-phase step",
}


def _transform_names(fn: Any, seen: set[int] | None = None) -> list[str]:
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    names = [getattr(fn, "__qualname__", type(fn).__name__)]
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        names.append(type(owner).__name__)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        values = value if isinstance(value, list | tuple) else (value,)
        for v in values:
            if _is_transformation(v):
                names += _transform_names(v.update, seen)
            elif callable(v):
                names += _transform_names(v, seen)
    return names


def _check_element_wise(
    tx: optax.GradientTransformation,
    params: Any,
    layout: _Layout,
    where: str = "fused_update_step",
) -> None:
    names = " ".join(_transform_names(tx.update))
    for name, alternative in _WHOLE_GRADIENT.items():
        if name in names:
            raise FusedUpdateError(
                f"{where}: optimizer contains optax.{name}, which reads the whole "
                f"gradient before updating any leaf, so it cannot run per layer inside the "
                f"backward pass. Alternative: {alternative}."
            )
    try:
        with jax.ensure_compile_time_eval():  # the step may be being traced: probe eagerly
            err = _probe(tx, params, layout)
    except Exception as e:  # noqa: BLE001 -- any failure of the split update is a refusal
        raise FusedUpdateError(
            f"{where}: optimizer {names.split()[0]} cannot be applied to one layer's "
            f"slice of the state ({type(e).__name__}: {e}). Per-layer updates need an "
            "element-wise optax transformation (sgd, adam, adamw, lion, ...) without masks given "
            "as pytrees; use the two-phase step (jax.grad, then tx.update) otherwise."
        ) from e
    if not err <= 1e-6:
        raise FusedUpdateError(
            f"{where}: optimizer {names.split()[0]} is not element-wise: on a probe, "
            f"updating each layer separately differs from updating the whole stack (max-scaled "
            f"relative error {err:.3g}). It needs more than one leaf slice's gradient (a global "
            "norm, a trust ratio, an accumulation?): use per-layer clipping (optax.clip, "
            "optax.clip_by_block_rms) or the two-phase step (jax.grad, then tx.update)."
        )


def _probe(tx: optax.GradientTransformation, params: Any, layout: _Layout) -> float:
    rng = np.random.default_rng(0)

    def small(x: jax.Array, lead: int = 0) -> np.ndarray:
        shape = x.shape[:lead] + tuple(min(d, 3) for d in x.shape[lead:])
        return rng.standard_normal(shape).astype(np.float32)

    stack, rest = layout.parts(params)
    length = min(_depth(stack), 3)
    p = layout.join(jax.tree.map(lambda x: small(x[:length], 1), stack), jax.tree.map(small, rest))
    whole_state = split_state = tx.init(p)
    whole_p = split_p = p
    # Jitted: op by op, the probe's many tiny operations would each compile on their own.
    whole_update = jax.jit(lambda p, s, g: _whole_update(tx, p, s, g))
    split_update = jax.jit(lambda p, s, g: _split_update(tx, layout, p, s, g))
    err = 0.0
    for _ in range(2):
        g = jax.tree.map(lambda x: 1e3 * rng.standard_normal(x.shape).astype(np.float32), p)
        whole_p, whole_state = whole_update(whole_p, whole_state, g)
        split_p, split_state = split_update(split_p, split_state, g)
        for a, b in zip(
            jax.tree.leaves((split_p, split_state)),
            jax.tree.leaves((whole_p, whole_state)),
            strict=True,
        ):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            scale = np.max(np.abs(b)) if b.size else 0.0
            err = max(
                err,
                float(np.max(np.abs(a - b)) / scale)
                if scale
                else float(np.max(np.abs(a), initial=0.0)),
            )
    return err


def _split_update(
    tx: optax.GradientTransformation, layout: _Layout, params: Any, opt_state: Any, grads: Any
) -> Any:
    """The fused step's update order, eagerly: each layer's slice, then the rest."""
    (stack, rest), (g_stack, g_rest) = layout.parts(params), layout.parts(grads)
    split = _split(opt_state, params, layout)
    stacks = _stack_halves(split, layout)
    for i in reversed(range(_depth(stack))):
        stack, stacks, *_ = _update_slice(tx, split, layout, stack, stacks, _read(g_stack, i), i)
    rest, state, _ = _update_rest(tx, split, layout, stacks, rest, g_rest)
    return layout.join(stack, rest), state


def _whole_update(
    tx: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any
) -> tuple[Any, Any]:
    """The two-phase step's update: the whole gradient at once."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return _apply_updates(params, updates), opt_state


def _apply_updates(params: Any, updates: Any) -> Any:
    import optax  # noqa: PLC0415  (imported on use: `import remat_nn` needs no optax)

    return optax.apply_updates(params, updates)


def _is_transformation(v: Any) -> bool:
    import optax  # noqa: PLC0415

    return isinstance(v, optax.GradientTransformation)
