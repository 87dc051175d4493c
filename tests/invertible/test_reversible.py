"""Reversible couplings and ReversibleSequence: exact inverses, gradients equal plain autodiff,
activation memory flat in depth, 4/3 matmul FLOPs, dropout / BatchNorm / remat inside F and G,
drift control (anchors, fp32 reconstruction).

Run: python -m pytest tests/invertible/test_reversible.py -q -p no:xdist
"""

from __future__ import annotations

import functools
import logging
import math
import re
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn
from remat_nn import names, nn
from tests.gradients import rel_err
from tests.jaxprs import equations

WIDTH = 16  # features of x; halves of 8
BATCH = 16


class MLP(fnn.Module):
    """A residual function with O(1) outputs: Dense -> tanh (named) -> Dense."""

    hidden: int = 16
    out: int | None = None
    scale: float = 0.1
    dtype: Any = jnp.float32

    @fnn.compact
    def __call__(self, x):
        init = fnn.initializers.normal(self.scale)
        h = jnp.tanh(fnn.Dense(self.hidden, kernel_init=init, dtype=self.dtype)(x))
        h = rn.name(h, names.MLP_HIDDEN)
        return fnn.Dense(self.out or x.shape[-1], kernel_init=init, dtype=self.dtype)(h)


class DropMLP(fnn.Module):
    rate: float = 0.5

    @fnn.compact
    def __call__(self, x):
        h = MLP()(x)
        return fnn.Dropout(self.rate, deterministic=False)(h)


class ConvBN(fnn.Module):
    """RevNet-style residual function: BatchNorm -> relu -> 3x3 conv."""

    @fnn.compact
    def __call__(self, x, train: bool):
        h = fnn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        h = fnn.relu(h)
        return fnn.Conv(x.shape[-1], (3, 3), kernel_init=fnn.initializers.normal(0.1))(h)


class TinyRevNet(fnn.Module):
    """How a RevNet uses the stack: couplings built inline in a compact method."""

    depth: int = 3
    reversible: bool = True

    @fnn.compact
    def __call__(self, x, *, train: bool):
        x = fnn.Conv(8, (3, 3))(x)  # (B, H, W, 8): halves of 4 channels
        x = nn.ReversibleSequence(
            nn.AdditiveCoupling(ConvBN(), ConvBN()), depth=self.depth, reversible=self.reversible
        )(x, train=train)
        return jnp.mean(x, axis=(1, 2))  # (B, 8)


# --- helpers --------------------------------------------------------------------------------------

# These programs are tiny and the machine is shared: compile time dominates, so compile with
# LLVM's optimizations off (HLO passes, and so numerics and memory layout, are unaffected) and
# put the programs a test compares into one executable.
_FAST = {"xla_backend_optimization_level": 0}


def run(fn: Any, *args: Any) -> Any:
    """``jax.jit(fn)(*args)``, compiled with :data:`_FAST`."""
    return jax.jit(fn).lower(*args).compile(_FAST)(*args)


def stack(depth: int, coupling: Any = None, **kwargs: Any) -> nn.ReversibleSequence:
    coupling = coupling or nn.AdditiveCoupling(MLP(), MLP())
    return nn.ReversibleSequence(coupling, depth=depth, **kwargs)


def loss_fn(module: fnn.Module, **apply_kwargs: Any):
    def loss(params, x):
        y = module.apply({"params": params}, x, **apply_kwargs)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    return loss


def grads(modules: list[fnn.Module], params: Any, x: Any, argnums: Any = (0, 1), **kw: Any):
    """Gradients of :func:`loss_fn` for each module, in one compiled program."""
    return run(lambda p, x: [jax.grad(loss_fn(m, **kw), argnums)(p, x) for m in modules], params, x)


@functools.cache
def mlp_case(depth: int) -> tuple[Any, jax.Array]:
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    variables = run(stack(depth).init, jax.random.key(0), x)
    return variables["params"], x


@functools.cache
def depth64_grads() -> tuple[Any, Any, Any]:
    """(reversible, plain autodiff, reversible with anchor_every=16) gradients at depth 64."""
    params, x = mlp_case(64)
    modules = [stack(64), stack(64, reversible=False), stack(64, anchor_every=16)]
    return tuple(grads(modules, params, x))


def layer(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda a: a[i], tree)


_SUBJAXPR_MULTIPLIER = {"scan": lambda params: params["length"]}


def matmul_flops(jaxpr: jax.extend.core.Jaxpr) -> int:
    """dot_general FLOPs of a jaxpr, recursing into sub-jaxprs; scan bodies x their length."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = math.prod(lhs[d] for d in lhs_contract)
            total += 2 * k * math.prod(eqn.outvars[0].aval.shape)
        if eqn.primitive.name in ("while", "cond"):
            raise AssertionError(f"cannot count FLOPs through {eqn.primitive.name}")
        mult = _SUBJAXPR_MULTIPLIER.get(eqn.primitive.name, lambda params: 1)(eqn.params)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    total += mult * matmul_flops(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    total += mult * matmul_flops(sub)
    return total


# --- couplings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls, out", [(nn.AdditiveCoupling, 8), (nn.AffineCoupling, 16)])
def test_coupling_inverse_exact_for_pair_and_array(cls, out):
    layer_ = cls(MLP(out=out, scale=0.5), MLP(out=out, scale=0.5))
    x = jax.random.normal(jax.random.key(2), (4, WIDTH))
    variables = run(layer_.init, jax.random.key(0), x)

    def forward_inverse(variables, x):
        y = layer_.apply(variables, x)
        y_pair = layer_.apply(variables, nn.split_halves(x)[0], method="forward")
        return y, y_pair, layer_.apply(variables, y_pair, method="inverse")

    y, y_pair, x_rec = run(forward_inverse, variables, x)
    assert y.shape == x.shape
    assert float(jnp.max(jnp.abs(y - x))) > 1e-2  # not the identity
    assert float(rn.check_invertible(layer_, variables, x)) < 1e-5
    assert isinstance(y_pair, tuple) and len(y_pair) == 2
    np.testing.assert_allclose(nn.merge_halves(y_pair, True), y, rtol=1e-6)
    np.testing.assert_allclose(nn.merge_halves(x_rec, True), x, atol=1e-5)


def test_coupling_tags_f_and_g_outputs():
    layer_ = nn.AdditiveCoupling(MLP(), MLP())
    x = jnp.ones((2, WIDTH))
    variables = jax.eval_shape(layer_.init, jax.random.key(0), x)
    jaxpr = jax.make_jaxpr(lambda v: layer_.apply(v, x))(variables)
    tagged = {e.params["name"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "name"}
    assert {names.COUPLING_F, names.COUPLING_G} <= tagged


def test_affine_scale_is_positive_and_bounded():
    h = jnp.concatenate([jnp.array([-100.0, 0.0, 100.0]), jnp.zeros(3)])
    y = rn.affine_combine(jnp.ones(3), h)
    np.testing.assert_allclose(y, jnp.exp(jnp.array([-1.0, 0.0, 1.0])), rtol=1e-6)
    np.testing.assert_allclose(rn.affine_uncombine(y, h), jnp.ones(3), rtol=1e-6)


# --- gradients ------------------------------------------------------------------------------------


def test_grad_equals_plain_autodiff_depth64_under_jit():
    rev, plain, _ = depth64_grads()
    err = rel_err(rev, plain)
    print(f"depth 64 grad rel err (params and x): {err:.3g}")
    assert err < 1e-5
    params, x = mlp_case(64)
    assert float(rn.check_invertible(stack(64), {"params": params}, x)) < 1e-5


def test_plain_scan_and_reversible_match_an_independent_python_loop():
    # Checks the baseline itself: ReversibleSequence(reversible=False) is the same network as
    # applying the coupling layer by layer.
    params, x = mlp_case(4)
    template = nn.AdditiveCoupling(MLP(), MLP())

    def loop_loss(params, x):
        for i in range(4):
            x = template.apply({"params": layer(params["layers"], i)}, x)
        return jnp.sum(jnp.sin(x))

    def all_grads(params, x):
        g = lambda loss: jax.grad(loss, argnums=(0, 1))(params, x)
        return g(loop_loss), g(loss_fn(stack(4, reversible=False))), g(loss_fn(stack(4)))

    ref, plain, rev = run(all_grads, params, x)
    assert rel_err(plain, ref) < 1e-5
    assert rel_err(rev, ref) < 1e-5


def test_grad_under_vmap_per_example():
    params, x = mlp_case(16)
    xs = x.reshape(4, BATCH // 4, WIDTH)  # (examples, B, D)

    def per_example(params, xs):
        g = lambda m: jax.vmap(jax.grad(loss_fn(m), argnums=(0, 1)), in_axes=(None, 0))
        return g(stack(16))(params, xs), g(stack(16, reversible=False))(params, xs)

    rev, plain = run(per_example, params, xs)
    assert jax.tree.leaves(rev[0])[0].shape[:2] == (4, 16)  # (examples, depth, ...)
    assert rel_err(rev, plain) < 1e-5


def test_affine_sequence_grad_equals_plain():
    coupling = nn.AffineCoupling(MLP(out=16), MLP(out=16))
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    params = run(stack(16, coupling).init, jax.random.key(0), x)["params"]
    rev, plain = grads([stack(16, coupling), stack(16, coupling, reversible=False)], params, x)
    assert rel_err(rev, plain) < 1e-5


def test_remat_policy_and_names_inside_f():
    policy = jax.checkpoint_policies.save_only_these_names(names.MLP_HIDDEN)
    remat_mlp = fnn.remat(MLP, policy=policy)
    coupling = nn.AdditiveCoupling(remat_mlp(), remat_mlp())
    params, x = mlp_case(8)  # same variable tree: remat keeps parameter names
    rev, plain = grads([stack(8, coupling), stack(8, reversible=False)], params, x)
    assert rel_err(rev, plain) < 1e-5


def test_generic_block_without_fused_backward():
    # ReversibleBlock(forward, inverse): backward = inverse, then jax.vjp(forward).
    f = lambda p, c, x: (jnp.tanh(x @ p["w"]), c)
    fused = rn.coupling_block(f, f)
    generic = rn.ReversibleBlock(fused.forward, fused.inverse)
    params = {"w": 0.3 * jax.random.normal(jax.random.key(0), (8, 4, 4))}
    x = tuple(jax.random.normal(k, (3, 4)) for k in jax.random.split(jax.random.key(1)))

    def all_grads(params, x):
        def g(scan, block):
            loss = lambda p, x: jnp.sum(jnp.sin(scan(block, p, x)[0][1]))
            return jax.grad(loss, argnums=(0, 1))(params, x)

        return (
            g(rn.plain_scan, fused),
            g(rn.reversible_scan, generic),
            g(rn.reversible_scan, fused),
        )

    ref, generic_grads, fused_grads = run(all_grads, params, x)
    assert rel_err(generic_grads, ref) < 1e-5
    assert rel_err(fused_grads, ref) < 1e-5


# --- memory and FLOPs -----------------------------------------------------------------------------


@pytest.mark.parametrize("unroll", [1, True])
def test_memory_flat_in_depth_while_plain_grows_linearly(unroll):
    # A batch whose activations (8 KiB per half) outweigh one layer's parameters (2.2 KiB).
    x = jax.random.normal(jax.random.key(1), (256, WIDTH))
    # Unrolled, compile time grows with depth: 8 -> 32 layers (24 more) instead of 8 -> 64.
    shallow, deep = (8, 32) if unroll is True else (8, 64)
    added = deep - shallow
    temp, param_bytes = {}, {}
    for depth in (shallow, deep):
        params, _ = mlp_case(depth)
        param_bytes[depth] = sum(a.nbytes for a in jax.tree.leaves(params))
        for reversible in (True, False):
            module = stack(depth, reversible=reversible, unroll=unroll)
            grad = jax.jit(jax.grad(loss_fn(module), argnums=(0, 1)))
            compiled = grad.lower(params, x).compile()  # default options: real memory figures
            temp[reversible, depth] = compiled.memory_analysis().temp_size_in_bytes
    print(f"unroll={unroll} temp bytes (reversible, depth): {temp}")
    activation = x.nbytes  # both halves of one layer's input
    if unroll is True:
        # Unrolled, XLA keeps per-layer slices of the stacked parameters (a parameter-sized
        # copy, documented), but no activation per layer: the backward's reconstruction of each
        # block waits for the block above (remat_nn._tie), or it would all run first.
        growth = temp[True, deep] - temp[True, shallow]
        assert growth <= param_bytes[deep] - param_bytes[shallow]
        assert growth < added * activation / 4
    else:
        assert temp[True, deep] <= 1.1 * temp[True, shallow]
    # plain autodiff stores per-layer activations: ~linear in depth (at least half of it)
    assert temp[False, deep] >= (deep / shallow) / 2 * temp[False, shallow]
    assert temp[False, deep] - temp[False, shallow] >= added * activation  # >= one x per layer
    assert temp[True, deep] < temp[False, shallow]


def _iotas(jaxpr) -> int:
    return sum(eqn.primitive.name == "iota" for eqn, _ in equations(jaxpr))


def test_the_drift_checks_sign_matrices_are_constants_not_computed_and_held():
    """The sketches' sign matrices are numpy constants: hashed in the program (an ``iota`` and
    integer arithmetic per matrix), XLA computed each once and held it from the forward pass to
    the end of the backward (RevNet-38's peak held four of them, 128 KiB: a third of what the
    check added). (Catches the signs hashed in the program again.)"""
    params, x = mlp_case(4)
    counts = {}
    for fallback in ("none", "error"):
        grad = jax.grad(loss_fn(stack(4, fallback=fallback)), argnums=(0, 1))
        counts[fallback] = _iotas(jax.make_jaxpr(grad)(params, x).jaxpr)
    print(f"iota equations by fallback: {counts}")
    assert counts["error"] == counts["none"]


def _conv_block() -> rn.ReversibleBlock:
    def fn(p, c, x):
        h = jax.lax.conv_general_dilated(
            jax.nn.relu(x), p, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return h, c

    return rn.coupling_block(fn, fn)


def _convolves_in_loops_only(hlo: str) -> bool:
    """Whether the program's entry computation runs no convolution itself (all are in loops)."""
    entry = hlo[hlo.index("\nENTRY ") :]
    return "convolution(" not in entry[: entry.index("\n}\n")]


def test_conv_stacks_unroll_on_cpu_by_default_and_stay_flat_in_depth():
    # Two stacks in series: without the backward's ordering (remat_nn._tie), XLA runs the first
    # stack's reconstruction while the second stack's backward runs, holding every layer
    # (measured: +2.1 MB from depth 4 to 12 here, 33 activations).
    block = _conv_block()
    x = (jnp.ones((8, 16, 16, 8)), jnp.ones((8, 16, 16, 8)))

    def loss(p, x, unroll, scan=rn.reversible_scan):
        y = scan(block, p[0], x, unroll=unroll)[0]
        return jnp.sum(jnp.sin(scan(block, p[1], y, unroll=unroll)[0][0]))

    temp, loops, params = {}, {}, {}
    for depth in (4, 12):
        keys = jax.random.split(jax.random.key(0))
        params[depth] = [jax.random.normal(k, (depth, 3, 3, 8, 8)) * 0.05 for k in keys]
        for unroll in (None, 1):
            grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
            compiled = grad.lower(params[depth], x, unroll).compile()
            temp[unroll, depth] = compiled.memory_analysis().temp_size_in_bytes
            loops[unroll, depth] = _convolves_in_loops_only(compiled.as_text())
    print(f"temp bytes (unroll, depth): {temp}")
    # (Unrolled, the drift check's fallback is a loop that runs only if a layer drifted.)
    assert loops == {(None, 4): False, (None, 12): False, (1, 4): True, (1, 12): True}
    # Unrolled: at most a parameter-sized copy more per layer, no activation per layer.
    param_growth = sum(p.nbytes for p in params[12]) - sum(p.nbytes for p in params[4])
    assert temp[None, 12] - temp[None, 4] <= param_growth
    assert temp[1, 12] <= 1.1 * temp[1, 4]
    # and the gradients of the default (unrolled) path are plain autodiff's
    plain = functools.partial(loss, scan=rn.plain_scan)
    got, want = run(
        lambda p, x: (jax.grad(loss, (0, 1))(p, x, None), jax.grad(plain, (0, 1))(p, x, 1)),
        params[4],
        x,
    )
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("anchor_every", [None, 2])
def test_every_unroll_gives_plain_autodiffs_gradient(anchor_every):
    params, x = mlp_case(6)
    unrolls = (1, 4, True)  # 4 does not divide the depth: lax.scan runs the remainder
    modules = [stack(6, reversible=False, unroll=1)]
    modules += [stack(6, anchor_every=anchor_every, unroll=u) for u in unrolls]
    ref, *results = grads(modules, params, x)
    errors = {f"unroll={u}": rel_err(g, ref) for u, g in zip(unrolls, results, strict=True)}
    print(f"grad rel err by unroll: {errors}")
    assert max(errors.values()) < 1e-5
    y = {u: stack(6, unroll=u).apply({"params": params}, x) for u in (1, True)}
    back = stack(6, unroll=True).apply({"params": params}, y[True], method="inverse")
    assert rel_err(y[True], y[1]) < 1e-6 and rel_err(back, x) < 1e-5


def test_matmul_flops_exactly_four_thirds_of_plain():
    params, x = mlp_case(8)
    flops = {}
    for reversible in (True, False):
        # (fallback="none": the drift check's branches are loops, which the FLOP count refuses;
        # its projections add 2 * 8 FLOPs per element of each layer's input per pass.)
        module = stack(8, reversible=reversible, fallback="none")
        grad = jax.grad(loss_fn(module), argnums=(0, 1))
        flops[reversible] = matmul_flops(jax.make_jaxpr(grad)(params, x).jaxpr)
    ratio = flops[True] / flops[False]
    print(f"matmul flops: {flops}, ratio {ratio:.4f}")
    # Per layer, in units of one forward pass of F or G: plain = forward 2 + VJPs 4 = 6. The
    # fused reversible backward runs F and G once more (reconstructing the input and
    # linearizing in the same pass), then their VJPs: 2 + 2 + 4 = 8, exactly 4/3.
    assert flops[False] > 0 and 3 * flops[True] == 4 * flops[False], flops


# --- dropout and BatchNorm inside F / G -----------------------------------------------------------


class _Key(fnn.Module):
    @fnn.compact
    def __call__(self):
        return self.make_rng("dropout")


def test_dropout_in_f_same_masks_in_reconstruction():
    coupling = nn.AdditiveCoupling(DropMLP(), MLP())
    _, x = mlp_case(8)
    params = run(stack(8, coupling).init, jax.random.key(0), x)["params"]
    key, other_key = jax.random.key(7), jax.random.key(8)

    def all_grads(params, x, key, other_key):
        rngs = {"dropout": key}
        # The per-layer key is the module's dropout key with the layer index folded in.
        base = _Key().apply({}, rngs=rngs)

        def loop_loss(p, x):
            for i in range(8):
                layer_rngs = {"dropout": jax.random.fold_in(base, i)}
                x = coupling.apply({"params": layer(p["layers"], i)}, x, rngs=layer_rngs)
            return jnp.sum(jnp.sin(x))

        g = lambda loss: jax.grad(loss, argnums=(0, 1))(params, x)
        other = stack(8, coupling).apply({"params": params}, x, rngs={"dropout": other_key})
        return (
            g(loss_fn(stack(8, coupling), rngs=rngs)),
            g(loss_fn(stack(8, coupling, reversible=False), rngs=rngs)),
            g(loop_loss),
            stack(8, coupling).apply({"params": params}, x, rngs=rngs) - other,
        )

    rev, plain, ref, diff = run(all_grads, params, x, key, other_key)
    assert rel_err(plain, ref) < 1e-5
    assert rel_err(rev, ref) < 1e-5
    assert float(jnp.max(jnp.abs(diff))) > 1e-3  # dropout is active: keys matter


def test_batchnorm_in_f_train_mode_grads_and_single_stats_update():
    x = jax.random.normal(jax.random.key(3), (4, 6, 6, 3))  # (B, H, W, C)
    variables = run(functools.partial(TinyRevNet().init, train=True), jax.random.key(0), x)
    stats = variables["batch_stats"]["ReversibleSequence_0"]["layers"]
    assert jax.tree.leaves(stats)[0].shape[0] == 3  # stacked per layer
    # flax semantics: BatchNorm does not update its running averages during init
    assert float(jnp.max(jnp.abs(stats["f"]["BatchNorm_0"]["mean"]))) == 0
    template = nn.AdditiveCoupling(ConvBN(), ConvBN())

    def train_step(variables, x):
        def step(model):
            def loss(params):
                logits, updates = model.apply(
                    {"params": params, "batch_stats": variables["batch_stats"]},
                    x,
                    train=True,
                    mutable=["batch_stats"],
                )
                return jnp.sum(jnp.sin(logits)), updates["batch_stats"]

            return jax.grad(loss, has_aux=True)(variables["params"])

        # the stack's BatchNorm updates when each layer is applied once
        params = variables["params"]
        h = fnn.Conv(8, (3, 3)).apply({"params": params["Conv_0"]}, x)
        expected = []
        for i in range(3):
            v = {
                "params": layer(params["ReversibleSequence_0"]["layers"], i),
                "batch_stats": layer(stats, i),
            }
            h, upd = template.apply(v, h, train=True, mutable=["batch_stats"])
            expected.append(upd["batch_stats"])
        expected = jax.tree.map(lambda *a: jnp.stack(a), *expected)
        return step(TinyRevNet()), step(TinyRevNet(reversible=False)), expected

    (grads_rev, stats_rev), (grads_plain, stats_plain), expected = run(train_step, variables, x)
    assert rel_err(grads_rev, grads_plain) < 1e-4
    # Exactly one update per step: equal to the plain network's, and to applying each layer once.
    assert rel_err(stats_rev, stats_plain) < 1e-5
    got = stats_rev["ReversibleSequence_0"]["layers"]
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    assert rel_err(got, expected) < 1e-5
    changed = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got, stats)
    assert min(jax.tree.leaves(changed)) > 0  # every BatchNorm updated its averages

    # Eval: running averages, nothing mutable; differentiable.
    def evaluate(params, batch_stats, x):
        def value_and_grad(model):
            def loss(params):
                out = model.apply({"params": params, "batch_stats": batch_stats}, x, train=False)
                return jnp.sum(jnp.sin(out))

            return jax.value_and_grad(loss)(params)

        return value_and_grad(TinyRevNet()), value_and_grad(TinyRevNet(reversible=False))

    (out_rev, g_rev), (out_plain, g_plain) = run(evaluate, variables["params"], stats_rev, x)
    np.testing.assert_allclose(out_rev, out_plain, rtol=1e-5)
    assert rel_err(g_rev, g_plain) < 1e-4


# --- drift control --------------------------------------------------------------------------------


def test_anchors_bound_drift_on_an_ill_conditioned_stack():
    coupling = nn.AdditiveCoupling(MLP(scale=0.8), MLP(scale=0.8))
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    params = run(stack(32, coupling).init, jax.random.key(0), x)["params"]
    drift = float(rn.check_invertible(stack(32, coupling), {"params": params}, x))
    anchors = (None, 8, 2)
    modules = [stack(32, coupling, reversible=False)]
    # fallback="none": reconstruction alone, as before the drift check
    modules += [stack(32, coupling, anchor_every=a, fallback="none") for a in anchors]
    modules += [stack(32, coupling, fallback="recompute")]  # drifted layers are recomputed
    rn.drift_recomputes(reset=True)
    ref, *results, checked = grads(modules, params, x)
    err = {a: rel_err(g, ref) for a, g in zip(anchors, results, strict=True)}
    print(f"reconstruction drift {drift:.3g}; grad rel err by anchor_every: {err}")
    assert drift > 1e-2  # the stack really is ill-conditioned
    assert err[None] > 1e-2
    assert err[8] < err[None] / 10
    assert err[2] < 1e-4
    # fallback="recompute" measures the drift and recomputes the layers past it. This stack
    # amplifies float32 rounding in the forward pass as much (plain autodiff's own error against
    # float64 is about 0.1 here): the checked gradient is as close to float64 as plain's.
    with jax.enable_x64(True):
        f64 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float64), t)
        exact = jax.grad(loss_fn(modules[0]), argnums=(0, 1))(f64(params), f64(x))
    own = rel_err(ref, exact)
    print(
        f"vs float64: plain {own:.3g}, checked {rel_err(checked, exact):.3g}, "
        f"unchecked {rel_err(results[0], exact):.3g}; recomputed {rn.drift_recomputes()}"
    )
    assert rel_err(checked, exact) < 2 * own
    assert 0 < sum(rn.drift_recomputes().values()) < 32


@pytest.mark.parametrize("depth", [16, 32])
def test_a_growing_stack_no_longer_diverges_silently(depth, caplog):
    # The stack of docs/invertible.md with unnormalized linear branches: the forward grows
    # (to 1e6 at depth 32) and reconstruction alone gave gradients off by 2e-2 (depth 16) and
    # 1e4 (depth 32) without a word. The drift check refuses it by default, and with a tight
    # tolerance, fallback="recompute" recomputes the layers that drifted.
    coupling = nn.AdditiveCoupling(fnn.Dense(16), fnn.Dense(16))
    x = jax.random.normal(jax.random.key(1), (64, 32))
    params = run(stack(depth, coupling).init, jax.random.key(0), x)["params"]
    unchecked = stack(depth, coupling, fallback="none")
    recomputing = stack(depth, coupling, fallback="recompute", drift_rtol=2.4e-5)
    plain = stack(depth, coupling, reversible=False)
    loss = lambda m: lambda p, x: jnp.mean(m.apply({"params": p}, x))  # noqa: E731
    rn.drift_recomputes(reset=True)
    unchecked, checked, ref = run(
        lambda p, x: [jax.grad(loss(m))(p, x) for m in (unchecked, recomputing, plain)], params, x
    )
    recomputed = rn.drift_recomputes()
    with jax.enable_x64(True):
        f64 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float64), t)  # noqa: E731
        exact = jax.grad(loss(plain))(f64(params), f64(x))
    own = rel_err(ref, exact)  # plain autodiff's own float32 error
    print(
        f"depth {depth}: own {own:.3g}, unchecked {rel_err(unchecked, exact):.3g}, checked "
        f"{rel_err(checked, exact):.3g}, recomputed {recomputed}"
    )
    assert rel_err(unchecked, exact) > 1000 * own
    assert rel_err(checked, exact) < 100 * own
    assert 0 < len(recomputed) < depth // 2  # a few layers, not every one
    # The default, fallback="error": under jit the refusal is in the error's first lines, and
    # JAX does not log it first.
    with caplog.at_level(logging.DEBUG), pytest.raises(jax.errors.JaxRuntimeError) as e:
        jax.block_until_ready(jax.jit(jax.grad(loss(stack(depth, coupling))))(params, x))
    head = "\n".join(str(e.value).splitlines()[:4])
    assert "NotInvertibleError: reversible stack: the input of layer" in head, str(e.value)
    assert "(tolerance " in head and "drift_rtol" in head and "Fix:" in head
    assert not [r for r in caplog.records if "callback failed" in r.getMessage()]


def _scaling_block(off: float, dtype: Any) -> rn.ReversibleBlock:
    """``y = x * exp(p)``, its factor computed in ``dtype``, and an inverse whose rebuilt
    input is off by ``off`` of its norm."""
    factor = lambda p: jnp.exp(p.astype(dtype)).astype(jnp.float32)  # noqa: E731
    return rn.ReversibleBlock(
        lambda p, c, x: (x * factor(p), c),
        lambda p, c, y: y / factor(p) * (1 + off),
    )


@pytest.mark.parametrize(
    ("off", "dtype", "refused"),
    [
        (1e-4, jnp.float32, False),
        # 5e-4: between the default (2048 float32 epsilons, 2.4e-4) and the 9.8e-4 that let two
        # affine stacks of the canonical matrix through with 119x and 146x plain autodiff's
        # error (benchmarks/results/invertible.md).
        (5e-4, jnp.float32, True),
        (2e-2, jnp.float32, True),
        # A block that computes in bfloat16 rebuilds its input to that precision only (a
        # branch's output off by one bfloat16 rounding, 4e-3), and plain autodiff's gradient
        # is no more precise: checked against 0.1, raised to 30 bfloat16 epsilons times the
        # stack's condition number where that is more (a scaling's is 1: 0.234).
        (2e-2, jnp.bfloat16, False),
        (0.5, jnp.bfloat16, True),
    ],
)
def test_the_default_tolerance_reads_the_precision_the_blocks_compute_in(off, dtype, refused):
    block = _scaling_block(off, dtype)
    p = jnp.full((1,), 0.3)  # depth 1: the rebuilt input is off by `off`, not compounded
    x = jax.random.normal(jax.random.key(0), (8, 16))
    loss = lambda p, x: jnp.sum(jnp.sin(rn.reversible_scan(block, p, x)[0]))  # noqa: E731
    grad = jax.jit(jax.grad(loss))
    if not refused:
        jax.block_until_ready(grad(p, x))
        return
    with pytest.raises(jax.errors.JaxRuntimeError, match="NotInvertibleError") as e:
        jax.block_until_ready(grad(p, x))
    want = 30 * 2.0**-7 if dtype == jnp.bfloat16 else 2048 * 2.0**-23
    got = re.search(r"\(tolerance ([0-9.e+-]+): drift_rtol", str(e.value))
    assert got is not None and float(got.group(1)) == pytest.approx(want, rel=1e-3)


def test_anchors_keep_gradients_exact_on_a_well_conditioned_stack():
    _, plain, anchored = depth64_grads()
    assert rel_err(anchored, plain) < 1e-5


def test_recon_dtype_float32_under_bfloat16_compute():
    bf16 = nn.AdditiveCoupling(MLP(dtype=jnp.bfloat16), MLP(dtype=jnp.bfloat16))
    params, x = mlp_case(16)
    xb = x.astype(jnp.bfloat16)

    def all_grads(params, x, xb):
        g = lambda m, x: jax.grad(loss_fn(m))(params, x)
        return (
            g(stack(16, reversible=False), x),  # float32 reference
            g(stack(16, bf16, recon_dtype=jnp.float32), xb),
            g(stack(16, bf16, recon_dtype=jnp.float32, reversible=False), xb),
            g(stack(16, bf16), xb),
        )

    ref, recon32, plain_recon32, rev_bf16 = run(all_grads, params, x, xb)
    y = jax.eval_shape(stack(16, bf16, recon_dtype=jnp.float32).apply, {"params": params}, xb)
    assert y.dtype == jnp.bfloat16
    err32, err16 = rel_err(recon32, ref), rel_err(rev_bf16, ref)
    print(f"grad rel err vs float32: recon float32 {err32:.3g}, bfloat16 stream {err16:.3g}")
    assert err32 < 3e-2
    assert err32 <= err16
    # reconstructing in float32 is as exact as storing the bfloat16 network's activations
    assert rel_err(recon32, plain_recon32) < 1e-4


# --- errors ---------------------------------------------------------------------------------------


def test_errors_name_the_argument_and_the_fix():
    params, x = mlp_case(8)
    with pytest.raises(ValueError, match=r"anchor_every.*must divide the depth 8.*\[1, 2, 4, 8\]"):
        stack(8, anchor_every=3).apply({"params": params}, x)
    with pytest.raises(ValueError, match="depth"):
        stack(0).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="depth=4"):
        stack(4).apply({"params": params}, x)
    with pytest.raises(TypeError, match="train= must be a static Python value"):
        stack(8).apply({"params": params}, x, train=jnp.array(True))
    with pytest.raises(ValueError, match="even size"):
        stack(8).init(jax.random.key(0), jnp.ones((2, 5)))
    with pytest.raises(TypeError, match="recon_dtype"):
        stack(8, recon_dtype=jnp.int32).apply({"params": params}, x)
    with pytest.raises(TypeError, match="forward"):
        stack(8, fnn.Dense(3)).init(jax.random.key(0), x)
    for bad in (0, -2, 1.5, "all"):
        with pytest.raises(ValueError, match=rf"`unroll` must be a positive int.*got {bad!r}"):
            stack(8, unroll=bad).apply({"params": params}, x)


@pytest.mark.parametrize(
    "coupling, f_width, want",
    [
        (nn.AdditiveCoupling, 3, r"additive coupling: .* returned shape \(2, 3\) .* \(2, 2\)"),
        (nn.AffineCoupling, 6, r"affine coupling: .* returned shape \(2, 6\) .* \(2, 4\)"),
    ],
)
def test_a_branch_that_changes_the_shape_is_named_with_the_fix(coupling, f_width, want):
    # F must map x2 to x1's shape (affine: twice its width, log-scale and shift); otherwise the
    # sum broadcasts into a block that is not invertible, or fails inside XLA.
    layer = coupling(fnn.Dense(f_width), fnn.Dense(f_width))
    with pytest.raises(ValueError, match=want + r".*Fix: make the branch's output width"):
        layer.init(jax.random.key(0), jnp.ones((2, 4)))
    stack = nn.ReversibleSequence(coupling(fnn.Dense(f_width), fnn.Dense(f_width)), depth=2)
    with pytest.raises(ValueError, match=want):
        stack.init(jax.random.key(0), jnp.ones((2, 4)))


def test_coupling_layer_runs_one_layer_as_the_sequence_does():
    # nn.coupling_layer: a ReversibleSequence's layer for a caller that scans the layers itself.
    # A scan of it over the sequence's stacked parameters gives the sequence's output bit for
    # bit; its inverse and its fused backward give the input back and plain autodiff's VJP.
    dense = lambda: fnn.Dense(4, kernel_init=fnn.initializers.normal(0.3))  # noqa: E731
    coupling = nn.AdditiveCoupling(dense(), dense())
    x = (jnp.linspace(-1.0, 1.0, 8).reshape(2, 4), jnp.linspace(0.5, -0.5, 8).reshape(2, 4))
    seq = nn.ReversibleSequence(coupling, depth=3)
    params = seq.init(jax.random.key(0), x)["params"]["layers"]
    layer = nn.coupling_layer(coupling)
    y, _ = jax.lax.scan(lambda h, p: (layer.forward(p, None, h)[0], None), x, params)
    want = seq.apply({"params": {"layers": params}}, x)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(y, want, strict=True))
    p0 = jax.tree.map(lambda a: a[0], params)
    y0 = layer.forward(p0, None, x)[0]
    assert rel_err(layer.inverse(p0, None, y0), x) <= 1e-6
    dy = (jnp.ones((2, 4)), -jnp.ones((2, 4)))
    h, dp, dx = layer.backward(p0, None, y0, dy)
    want_dp, want_dx = jax.vjp(lambda p, h: layer.forward(p, None, h)[0], p0, x)[1](dy)
    assert rel_err(h, x) <= 1e-6
    assert rel_err((dp, dx), (want_dp, want_dx)) <= 1e-6
    with pytest.raises(TypeError, match="must be a coupling module"):
        nn.coupling_layer(dense())
