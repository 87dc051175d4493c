"""Every memory path x every transformation with named axes gives plain autodiff's gradient.

The seed's "reduction over named axes in reverse-mode AD", in today's JAX: inside
``jax.shard_map`` the cotangent of a weight replicated over an axis is summed over that axis, and
under ``jax.vmap(..., axis_name=...)`` the cotangent of an unbatched weight is summed over the
batch. remat_nn's custom VJPs and hand-built loop carries must do what JAX's own rules do
(``remat_nn/_named_axes.py``). Each cell runs a memory path and its plain-autodiff twin in the
same context and compares the gradients of the parameters and of the input (max-scaled relative
error), and the BatchNorm running averages of the forward pass where the path has BatchNorm.

Contexts: ``plain`` (op by op), ``jit``, ``vmap`` (per-example gradients, the batch a vmapped
axis named ``data``), ``vmap_sum`` (the gradient of the batch's loss summed over that vmapped
axis), ``shard_map`` (a 2 x 2 mesh: parameters replicated ``P()``, batch ``P("data")``, the
``model`` axis unused), ``shard_map_2d`` (the same mesh: parameters varying over ``model``,
replicated over ``data``), ``grad_of_grad`` (a Hessian-vector product). Every cell runs but the
ones :func:`not_applicable` names; the smallest shapes that still run each mechanism keep the
whole matrix cheap (one compile per cell: the path and its twin in one jit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import models
import remat_nn as rn
from models import revnet as rv
from remat_nn import _named_axes, nn
from remat_nn import nnx as rnnx
from remat_nn.invertible import _errors as _inv_errors
from tests.gradients import random_variables, rel_err

TOL = 1e-5
B, D = 4, 8  # batch (divisible by the 2 devices of an axis), features


@dataclasses.dataclass(frozen=True)
class Case:
    """A memory path and its plain-autodiff twin: ``fn(params, stats, x) -> (loss, new_stats)``,
    the loss a sum over the batch (axis 0 of every leaf of ``x``)."""

    fn: Callable[..., Any]
    ref: Callable[..., Any]
    params: Any
    x: Any
    stats: Any = None
    axis: bool = False  # BatchNorm(axis_name="data"): runs only where the axis is bound
    # Models: each leaf's scale floored at 1% of the largest (rn.relative_error's floor): a leaf
    # whose exact gradient is 0 (a bias under BatchNorm, the attention key bias) holds round-off.
    floor: float = 0.0
    # (object, attribute, value) set while the cell is traced (mock.patch.object).
    patches: tuple[tuple[Any, str, Any], ...] = ()


def _normal(key: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(key), shape)


def _no_stats(f: Callable[[Any, Any], jax.Array]) -> Callable[..., Any]:
    return lambda p, s, x: (f(p, x), s)


def _mlp(p: Any, x: jax.Array) -> jax.Array:
    h = rn.name(jnp.tanh(x @ p["w1"]), "hidden")
    return jnp.sum(jnp.tanh(h @ p["w2"]) ** 2)


def _mlp_params() -> dict[str, jax.Array]:
    return {"w1": _normal(0, (D, D), 0.4), "w2": _normal(1, (D, D), 0.4)}


def _checkpoint(policy: Any) -> Case:
    return Case(
        _no_stats(rn.checkpoint(_mlp, policy=policy)),
        _no_stats(_mlp),
        _mlp_params(),
        _normal(2, (B, D)),
    )


def _layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.tanh(h @ w), jnp.sum(h)


def _remat_scan(levels: int) -> Case:
    def run(scan: Callable[..., Any]) -> Callable[..., Any]:
        def f(ws: jax.Array, x: jax.Array) -> jax.Array:
            h, ys = scan(_layer, x, ws)
            return jnp.sum(h**2) + jnp.sum(ys)

        return _no_stats(f)

    scan = functools.partial(rn.remat_scan, levels=levels)
    # lax.scan with the carry cast to vary as the body's does (remat_scan does the same).
    return Case(run(scan), run(_named_axes.scan), _normal(0, (8, D, D), 0.4), _normal(2, (B, D)))


_BLOCK = rn.coupling_block(
    lambda p, c, x: (jnp.tanh(x @ p["f"]), c), lambda p, c, x: (jnp.tanh(x @ p["g"]), c)
)


def _reversible(**kw: Any) -> Case:
    def run(scan: Callable[..., Any]) -> Callable[..., Any]:
        def f(p: Any, x: jax.Array) -> jax.Array:
            y1, y2 = scan(_BLOCK, p, (x, 0.5 * x))[0]
            return jnp.sum(y1**2) + jnp.sum(jnp.sin(y2))

        return _no_stats(f)

    params = {"f": _normal(0, (4, D, D), 0.4), "g": _normal(1, (4, D, D), 0.4)}
    rev = functools.partial(rn.reversible_scan, **kw)
    return Case(run(rev), run(rn.plain_scan), params, _normal(2, (B, D)))


class _BNDense(fnn.Module):
    """BatchNorm over the ``data`` axis -> tanh(Dense): F or G of a coupling."""

    @fnn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = fnn.BatchNorm(use_running_average=not train, axis_name="data", momentum=0.5)(x)
        return jnp.tanh(fnn.Dense(x.shape[-1], kernel_init=fnn.initializers.normal(0.4))(x))


def _linen(module: fnn.Module, x: jax.Array, **kw: Any) -> tuple[Any, Any, Any]:
    """The loss of a linen module with ``batch_stats``, its params and its stats."""

    def run(m: fnn.Module) -> Callable[..., Any]:
        def f(params: Any, stats: Any, x: jax.Array) -> tuple[jax.Array, Any]:
            out, upd = m.apply(
                {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"], **kw
            )
            return jnp.sum(jnp.sin(out) + out**2), upd["batch_stats"]

        return f

    return run


def _nn_reversible() -> Case:
    stack = nn.ReversibleSequence(nn.AdditiveCoupling(_BNDense(), _BNDense()), depth=3)
    x = _normal(2, (B, D))
    v = jax.eval_shape(jax.vmap(stack.init, (None, 0), axis_name="data"), jax.random.key(0), x)
    v = random_variables(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), v))
    run = _linen(stack, x)
    return Case(
        run(stack), run(stack.copy(reversible=False)), v["params"], x, v["batch_stats"], axis=True
    )


class _NNXBNDense(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.bn = nnx.BatchNorm(D // 2, momentum=0.5, axis_name="data", rngs=rngs)
        self.dense = nnx.Linear(D // 2, D // 2, kernel_init=nnx.initializers.normal(0.4), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.dense(self.bn(x)))


def _nnx_run(graphdef: Any) -> Callable[..., Any]:
    """An NNX model's case function: the model merged from ``params`` and ``stats``, its loss and
    its BatchNorm averages after the forward pass."""

    def f(params: Any, stats: Any, x: jax.Array) -> tuple[jax.Array, Any]:
        model = nnx.merge(graphdef, params, stats, copy=True)
        out = model(x)
        return jnp.sum(jnp.sin(out) + out**2), nnx.state(model, nnx.BatchStat)

    return f


def _nnx_reversible() -> Case:
    def make(reversible: bool) -> rnnx.ReversibleSequence:
        coupling = lambda r: rnnx.AdditiveCoupling(_NNXBNDense(r), _NNXBNDense(r))  # noqa: E731
        return rnnx.ReversibleSequence(coupling, 3, reversible=reversible, rngs=nnx.Rngs(0))

    graphdef, params, stats = nnx.split(make(True), nnx.Param, nnx.BatchStat)
    plain_def = nnx.graphdef(make(False))

    return Case(
        _nnx_run(graphdef), _nnx_run(plain_def), params, _normal(2, (B, D)), stats, axis=True
    )


class _NNXTiedNet(nnx.Module):
    """Two unrolled units, each under ``rnnx.tied_remat`` (a custom_vjp) or called plainly."""

    def __init__(self, tied: bool, rngs: nnx.Rngs) -> None:
        self.tied = tied
        self.units = nnx.List([_NNXBNDense(rngs), _NNXBNDense(rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for unit in self.units:
            x = x + (rnnx.tied_remat(unit, x, policy="full") if self.tied else unit(x))
        return x


def _nnx_tied_remat() -> Case:
    graphdef, params, stats = nnx.split(_NNXTiedNet(True, nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
    plain_def = nnx.graphdef(_NNXTiedNet(False, nnx.Rngs(0)))

    x = _normal(2, (B, D // 2))
    return Case(_nnx_run(graphdef), _nnx_run(plain_def), params, x, stats, axis=True)


def _coupling(p: Any, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    y1 = x1 + jnp.tanh(x2 @ p["f"])
    return y1, x2 + jnp.tanh(y1 @ p["g"])


def _coupling_loss(fn: Callable[..., Any]) -> Callable[..., Any]:
    def f(p: Any, x: jax.Array) -> jax.Array:
        y1, y2 = fn(p, x, 0.5 * x)
        return jnp.sum(y1**2) + jnp.sum(jnp.sin(y2))

    return _no_stats(f)


def _pair_params() -> dict[str, jax.Array]:
    return {"f": _normal(0, (D, D), 0.4), "g": _normal(1, (D, D), 0.4)}


def _invertible() -> Case:
    def two(p: Any, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _coupling(p, *_coupling(p, x1, x2))

    return Case(
        _coupling_loss(rn.invertible(two)), _coupling_loss(two), _pair_params(), _normal(2, (B, D))
    )


def _invertible_scan_recomputed() -> Case:
    """rn.invertible over a scan of couplings with fallback="recompute", every derivative check
    failing: each iteration recomputed from the scan's first carry (_scan_recompute)."""

    def run(scan: Callable[..., Any]) -> Callable[..., Any]:
        def f(p: Any, x: jax.Array) -> jax.Array:
            y1, y2 = scan(p, (x, 0.5 * x))
            return jnp.sum(y1**2) + jnp.sum(jnp.sin(y2))

        return _no_stats(f)

    def stack(p: Any, x: Any) -> Any:
        return rn.plain_scan(_BLOCK, p, x)[0]

    params = {"f": _normal(0, (4, D, D), 0.4), "g": _normal(1, (4, D, D), 0.4)}
    checked = _inv_errors.derivative_excess  # fails wherever it checks something

    def fails(*a: Any, **k: Any) -> Any:
        return None if checked(*a, **k) is None else jnp.bool_(False)

    failing = (_inv_errors, "derivative_excess", fails)
    inv = rn.invertible(stack, known_argnums=0, fallback="recompute")
    return Case(run(inv), run(stack), params, _normal(2, (B, D)), patches=(failing,))


def _custom_ivjp() -> Case:
    g = rn.custom_ivjp(_coupling, known_argnums=(0,))

    def ivjp(xs: Any, ys: Any, dys: Any) -> Any:
        p, (y1, y2), (dy1, dy2) = xs[0], ys, dys
        x2 = y2 - jnp.tanh(y1 @ p["g"])
        x1 = y1 - jnp.tanh(x2 @ p["f"])
        _, vjp = jax.vjp(_coupling, p, x1, x2)
        return (p, x1, x2), vjp((dy1, dy2))

    g.defivjp(ivjp)
    return Case(_coupling_loss(g), _coupling_loss(_coupling), _pair_params(), _normal(2, (B, D)))


def _revnet() -> Case:
    # The registry's RevNet: downsampling units rematerialized by rnn.tied_remat's custom_vjp.
    arch = rv.Arch((2, 1, 1), (8, 16, 16), 8, bottleneck=False)
    rev = rv.RevNet(arch, num_classes=3, remat=rn.plan({"default": "recompute"}))
    x = _normal(2, (B, 8, 8, 3))
    v = random_variables(jax.eval_shape(rev.init, jax.random.key(0), x))
    run = _linen(rev, x, train=True)
    plain = rev.clone(reversible=False, remat=None)
    return Case(run(rev), run(plain), v["params"], x, v["batch_stats"], floor=1e-2)


def _nnx_revnet() -> Case:
    x = _normal(2, (B, 8, 8, 1))
    rev = models.build("nnx_revnet", width=4, depth=1, num_classes=3)
    init = functools.partial(rev.init, train=False)
    v = random_variables(jax.eval_shape(init, jax.random.key(0), x))
    run = _linen(rev, x, train=True)
    plain = models.build("nnx_revnet", width=4, depth=1, num_classes=3, reversible=False)
    return Case(run(rev), run(plain), v["params"], x, v["batch_stats"], floor=1e-2)


def _transformer() -> Case:
    kw = dict(vocab_size=16, d_model=8, n_heads=2, n_layers=2, max_len=8)
    rev = models.build("transformer", **kw, reversible=True)
    tokens = jax.random.randint(jax.random.key(1), (B, 8), 0, 16)
    params = random_variables(jax.eval_shape(rev.init, jax.random.key(0), tokens))["params"]

    def run(m: fnn.Module) -> Callable[..., Any]:
        def f(params: Any, stats: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
            logits = m.apply({"params": params}, tokens)
            return jnp.sum(jax.nn.log_softmax(logits)[..., 0]), stats

        return f

    return Case(run(rev), run(rev.clone(reconstruct=False)), params, tokens, floor=1e-2)


PATHS: dict[str, Callable[[], Case]] = {
    "checkpoint_policy": lambda: _checkpoint("dots_with_no_batch_dims_saveable"),
    "checkpoint_plan": lambda: _checkpoint(rn.plan({"save": ["hidden"], "default": "recompute"})),
    "remat_scan_1": lambda: _remat_scan(1),
    "remat_scan_2": lambda: _remat_scan(2),
    "remat_scan_3": lambda: _remat_scan(3),
    "reversible_rolled": lambda: _reversible(unroll=1),
    "reversible_unrolled": lambda: _reversible(unroll=True),
    "reversible_anchored": lambda: _reversible(anchor_every=2),
    # every layer's rebuilt input fails the drift check: the recompute branch on every layer
    "reversible_recomputed": lambda: _reversible(
        anchor_every=2, drift_rtol=1e-30, fallback="recompute"
    ),
    "reversible_recomputed_unrolled": lambda: _reversible(
        unroll=True, drift_rtol=1e-30, fallback="recompute"
    ),
    "nn_reversible_bn": _nn_reversible,
    "nnx_reversible_bn": _nnx_reversible,
    "nnx_tied_remat": _nnx_tied_remat,
    "invertible": _invertible,
    "invertible_scan_recomputed": _invertible_scan_recomputed,
    "custom_ivjp": _custom_ivjp,
    "revnet": _revnet,
    "nnx_revnet": _nnx_revnet,
    "transformer_reversible": _transformer,
}


@functools.cache
def _case(path: str) -> Case:
    return PATHS[path]()


# --- contexts -------------------------------------------------------------------------------------
# A context maps ``fn`` and the case's ``(params, stats, x)`` to ``((dparams, dx), new_stats)``;
# each is traced inside one jit that holds the path and its twin (one compile per cell).


def _grads(fn: Callable[..., Any], x: Any) -> Callable[..., Any]:
    """``(params, stats, x) -> ((dparams, dx), new_stats)``; dx is None for integer inputs."""
    float_x = jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    argnums = (0, 2) if float_x else (0,)

    def g(params: Any, stats: Any, x: Any) -> Any:
        grads, new_stats = jax.grad(fn, argnums=argnums, has_aux=True)(params, stats, x)
        return (grads[0], grads[1] if float_x else None), new_stats

    return g


def _per_example(x: Any) -> Any:
    return jax.tree.map(lambda a: a[:, None], x)  # (B, 1, ...): one example per vmapped index


@functools.cache
def _mesh() -> jax.sharding.Mesh:
    """One 2 x 2 mesh for both shard_map contexts (the data-parallel one leaves ``model``
    unused: every value is replicated over it)."""
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _jit(fn: Callable[..., Any], c: Case, params: Any, stats: Any, x: Any) -> Any:
    return _grads(fn, c.x)(params, stats, x)


def _shard_map(fn: Callable[..., Any], c: Case, params: Any, stats: Any, x: Any) -> Any:
    def local(params: Any, stats: Any, x: Any) -> Any:
        def loss(p: Any, s: Any, x: Any) -> Any:
            value, new = fn(p, s, x)
            return jax.lax.psum(value, "data"), new

        (dp, dx), new = _grads(loss, c.x)(params, stats, x)
        return (dp, dx), jax.tree.map(lambda a: jax.lax.pmean(a, "data"), new)

    specs = (P(), P(), P("data"))
    out = ((P(), P("data")), P())
    return jax.shard_map(local, mesh=_mesh(), in_specs=specs, out_specs=out)(params, stats, x)


def _shard_map_2d(fn: Callable[..., Any], c: Case, params: Any, stats: Any, x: Any) -> Any:
    """Parameters stacked over ``model`` (each model index its own copy), batch over ``data``:
    a parameter cotangent is summed over ``data`` only, the input's over ``model`` only."""
    copies = jax.tree.map(lambda a: jnp.stack([a, 0.9 * a]), params)  # (2, ...)

    def local(params: Any, stats: Any, x: Any) -> Any:
        def loss(p: Any, s: Any, x: Any) -> Any:
            p = jax.tree.map(lambda a: a[0], p)  # this model index's copy
            value, new = fn(p, s, x)
            return jax.lax.psum(value, ("data", "model")), new

        (dp, dx), new = _grads(loss, c.x)(params, stats, x)
        new = jax.tree.map(lambda a: jax.lax.pmean(a, "data")[None], new)  # (1, ...) per model
        return (dp, dx), new

    specs = (P("model"), P(), P("data"))
    out = ((P("model"), P("data")), P("model"))
    return jax.shard_map(local, mesh=_mesh(), in_specs=specs, out_specs=out)(copies, stats, x)


def _vmap(fn: Callable[..., Any], c: Case, params: Any, stats: Any, x: Any) -> Any:
    per_example = jax.vmap(_grads(fn, c.x), in_axes=(None, None, 0), axis_name="data")
    grads, new = per_example(params, stats, _per_example(x))
    return grads, jax.tree.map(lambda a: jnp.mean(a, axis=0), new)


def _vmap_sum(fn: Callable[..., Any], c: Case, params: Any, stats: Any, x: Any) -> Any:
    def total(params: Any, stats: Any, x: Any) -> Any:
        values, new = jax.vmap(fn, in_axes=(None, None, 0), axis_name="data")(params, stats, x)
        return jnp.sum(values), jax.tree.map(lambda a: jnp.mean(a, axis=0), new)

    # The input's cotangent of a per-example batch (B, 1, ...) compared as is.
    return _grads(total, c.x)(params, stats, _per_example(x))


def _grad_of_grad(fn: Callable[..., Any], c: Case, params: Any, stats: Any, x: Any) -> Any:
    tangent = jax.tree.map(jnp.cos, params)  # a fixed direction

    def hvp(params: Any) -> Any:
        (dp, _), _ = _grads(fn, c.x)(params, stats, x)
        pairs = zip(jax.tree.leaves(dp), jax.tree.leaves(tangent), strict=True)
        return sum(jnp.vdot(a, t) for a, t in pairs)

    return (jax.grad(hvp)(params), None), stats


# "plain" runs op by op and is compared with the jit cell's reference (the same function).
CONTEXTS: dict[str, Callable[..., Any]] = {
    "plain": _jit,
    "jit": _jit,
    "vmap": _vmap,
    "vmap_sum": _vmap_sum,
    "shard_map": _shard_map,
    "shard_map_2d": _shard_map_2d,
    "grad_of_grad": _grad_of_grad,
}

# Second derivatives: a reversible backward is not itself reconstructed (jax.custom_vjp
# differentiates the backward by plain autodiff, which holds its activations), and a model
# with BatchNorm in training mode has no second-order use here.
SECOND_ORDER = {
    "checkpoint_policy",
    "checkpoint_plan",
    "remat_scan_1",
    "remat_scan_2",
    "remat_scan_3",
    "reversible_rolled",
    "reversible_unrolled",
    "reversible_anchored",
    "reversible_recomputed",
    "reversible_recomputed_unrolled",
    "invertible",
    "invertible_scan_recomputed",
    "custom_ivjp",
}


def not_applicable(path: str, context: str) -> str | None:
    """Why a cell of the matrix has no meaning, or None: the cells that are not run."""
    if _case(path).axis and context in ("plain", "jit", "grad_of_grad"):
        return "BatchNorm(axis_name='data') needs the axis 'data' bound (vmap or shard_map)"
    if context == "grad_of_grad" and path not in SECOND_ORDER:
        return "no second derivative: a custom_vjp backward or BatchNorm in training mode"
    return None


# The suite runs every path in the contexts that change its carries' and cotangents' types, the
# models in shard_map only; REMAT_NN_FULL_MATRIX=1 runs every applicable cell. The whole matrix
# exceeds this file's share of the suite's time: a model cell traces and compiles a flax model
# and its twin, and the variants of a path repeat its base path's cells.
FULL_MATRIX = os.environ.get("REMAT_NN_FULL_MATRIX") == "1"
SUITE = {
    "revnet": {"shard_map"},
    "nnx_revnet": {"shard_map"},
    "transformer_reversible": {"shard_map"},
    "checkpoint_plan": {"jit", "shard_map", "shard_map_2d"},
    "remat_scan_3": {"jit", "shard_map", "shard_map_2d"},
    "reversible_unrolled": {"jit", "shard_map", "shard_map_2d"},
    "reversible_anchored": {"jit", "shard_map", "shard_map_2d", "vmap_sum"},
    "reversible_recomputed": {"jit", "vmap", "shard_map", "grad_of_grad"},
    "reversible_recomputed_unrolled": {"jit", "vmap_sum", "shard_map_2d", "grad_of_grad"},
    "invertible_scan_recomputed": {"jit", "vmap", "shard_map", "grad_of_grad"},
}


@functools.cache
def _reference(path: str) -> Any:
    """The jit cell's plain-autodiff twin, shared with the plain cell."""
    c = _case(path)
    return jax.jit(functools.partial(_jit, c.ref, c))(c.params, c.stats, c.x)


def _run(path: str, context: str) -> tuple[Any, Any]:
    """(the path's result, its twin's) in ``context``."""
    c, run = _case(path), CONTEXTS[context]
    if context == "plain":
        return run(c.fn, c, c.params, c.stats, c.x), _reference(path)
    if context == "jit":
        return jax.jit(functools.partial(run, c.fn, c))(c.params, c.stats, c.x), _reference(path)

    def both(params: Any, stats: Any, x: Any) -> Any:
        return run(c.fn, c, params, stats, x), run(c.ref, c, params, stats, x)

    return jax.jit(both)(c.params, c.stats, c.x)


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("path", list(PATHS))
def test_gradient_equals_plain_autodiff(path: str, context: str) -> None:
    if (reason := not_applicable(path, context)) is not None:
        pytest.skip(reason)
    if not FULL_MATRIX and context not in SUITE.get(path, CONTEXTS):
        pytest.skip(f"{path} in {context}: run with REMAT_NN_FULL_MATRIX=1 (suite time)")
    c = _case(path)
    with contextlib.ExitStack() as patched:
        for target, name, value in c.patches:
            patched.enter_context(mock.patch.object(target, name, value))
        ((got, got_dx), got_stats), ((want, want_dx), want_stats) = _run(path, context)
    assert rel_err(got, want, floor=c.floor) < TOL, (path, context)
    if want_dx is not None:
        assert rel_err(got_dx, want_dx, floor=c.floor) < TOL, (path, context)
    if c.stats is not None:
        # BatchNorm in training mode: the running averages move, and as plain autodiff's do.
        assert rel_err(got_stats, want_stats) < TOL, (path, context)
        moved = jax.tree.map(
            lambda new, old: bool(jnp.any(new != jnp.broadcast_to(old, new.shape))),
            got_stats,
            c.stats,
        )
        assert all(jax.tree.leaves(moved)), (path, context)


def test_readme_shard_map_example_runs() -> None:
    """The README's "Data parallel with shard_map" example, read from README.md and run."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Data parallel with shard_map", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "rn.reversible_scan" in code and "assert rn.relative_error" in code
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102  (the README's own example)


def _scan_loss(data_parallel: bool) -> Callable[..., Any]:
    """``loss(ws, x, policy=...)``: a checkpointed scan over layers, in shard_map or not."""

    def loss(ws: jax.Array, x: jax.Array, policy: Any = "none") -> jax.Array:
        def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
            a = rn.name(jnp.tanh(h @ w), "a")
            return rn.name(jnp.sin(a) * a, "b"), None

        def local(ws: jax.Array, x: jax.Array) -> jax.Array:
            body = layer if policy == "none" else rn.checkpoint(layer, policy=policy)
            total = jnp.sum(_named_axes.scan(body, x, ws)[0] ** 2)
            return jax.lax.psum(total, "data") if data_parallel else total

        if not data_parallel:
            return local(ws, x)
        specs = (P(), P("data"))
        return jax.shard_map(local, mesh=_mesh(), in_specs=specs, out_specs=P())(ws, x)

    return loss


def test_memory_tools_on_a_shard_map_step() -> None:
    """rn.memory_report names the residuals inside a shard_map (global shapes: the named ones
    as without it), and rn.plan_for_budget / rn.explain_peak plan and explain the per-device
    program of a step whose arguments are uncommitted arrays."""
    ws, x = _normal(0, (4, 16, 16), 0.3), _normal(1, (32, 16))
    sharded, single = _scan_loss(True), _scan_loss(False)
    named = lambda f: {  # noqa: E731
        r.name: r.nbytes for r in rn.memory_report(f, ws, x).residuals if r.kind == "named"
    }
    assert named(sharded) == named(single) and "a" in named(single)

    report = rn.plan_for_budget(sharded, ws, x, budget=0.5, measure=False)
    assert report.compiled_temp_bytes <= report.budget_bytes < report.no_remat_temp_bytes
    peak = report.peak()  # the chosen plan's step compiled again from the arguments' shapes
    assert peak is not None and peak.difference == 0
    assert "largest temp buffers" in str(report)


def test_optimization_barrier_keeps_each_leafs_manual_axis_type() -> None:
    """One barrier per set of varying axes: a single barrier over a varying and an unvarying
    leaf would cast the unvarying one up (JAX requires one barrier's operands to vary alike),
    and a cotangent typed so no longer matches its primal."""
    seen = {}

    def local(w: jax.Array, x: jax.Array) -> jax.Array:
        w2, (x2, x3) = _named_axes.optimization_barrier((w, (x, 2 * x)))
        seen.update(
            w=_named_axes.varying(w2), x=_named_axes.varying(x2), x3=_named_axes.varying(x3)
        )
        return jax.lax.psum(jnp.sum(x2 * x3), "data") + jnp.sum(w2)

    w, x = jnp.ones((3,)), _normal(0, (4, 3))
    got = jax.shard_map(local, mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P())(w, x)
    assert seen == {"w": frozenset(), "x": frozenset({"data"}), "x3": frozenset({"data"})}
    assert float(rel_err(got, 2 * jnp.sum(x * x) + 3.0)) <= 1e-6
