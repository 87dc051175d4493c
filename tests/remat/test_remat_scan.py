"""rn.remat_scan and nn.remat_scan: the values and gradients of lax.scan (plain autodiff) at every
nesting, with remainders, plans, kept or recomputed carries, pytrees and reversed scans; the
memory and FLOPs the nesting promises; parameters interchangeable with flax.linen.scan; and
errors that name the argument, the value and the fix."""

from __future__ import annotations

import functools
import math
import random

import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import remat_nn as rn
from remat_nn import nn
from remat_nn import nnx as rnnx
from tests.gradients import rel_err

TOL = 1e-5  # float32, max-scaled (tests/gradients.py)
W = 8  # width of the carry in the small stacks


def layer(h, w):
    """One layer: a carry (B, W) and a weight (W, W); y is the carry's mean (one per step)."""
    h = jnp.tanh(h @ w) + 0.5 * h
    return h, jnp.mean(h)


def weights(n, seed=0):
    return jax.random.normal(jax.random.key(seed), (n, W, W)) / W**0.5


H0 = jnp.linspace(-1.0, 1.0, 2 * W).reshape(2, W)  # (B=2, W)


def loss_of(scan):
    """A loss of the final carry and of every y, so both cotangents reach the backward pass."""

    def loss(ws, h0):
        h, ys = scan(ws, h0)
        return jnp.sum(h**2) + jnp.sum(jnp.sin(ys))

    return loss


def check_against_lax(kw, n, *, reverse=False, seed=0):
    ws = weights(n, seed)

    def values_and_grads(scan):
        loss = loss_of(scan)
        return jax.jit(lambda ws, h: (scan(ws, h), jax.grad(loss, argnums=(0, 1))(ws, h)))

    ours = lambda ws, h: rn.remat_scan(layer, h, ws, reverse=reverse, **kw)
    plain = lambda ws, h: jax.lax.scan(layer, h, ws, reverse=reverse)
    got, want = values_and_grads(ours)(ws, H0), values_and_grads(plain)(ws, H0)
    assert rel_err(got, want) <= TOL, (kw, n, reverse)


# --- gradients equal plain autodiff -------------------------------------------------------------


@pytest.mark.parametrize("levels", [1, 2, 3])
@pytest.mark.parametrize("reverse", [False, True])
def test_levels_match_lax_scan(levels, reverse):
    check_against_lax({"levels": levels}, 27, reverse=reverse)


@pytest.mark.parametrize(
    "n, lengths",
    [(10, (4, 3)), (10, (2, 5)), (11, (3, 2, 2)), (23, (2, 3, 4)), (7, (1, 7)), (7, (7, 1))],
)
@pytest.mark.parametrize("reverse", [False, True])
def test_lengths_that_do_not_divide(n, lengths, reverse):
    check_against_lax({"lengths": lengths}, n, reverse=reverse)


@pytest.mark.parametrize(
    "carry_policy", ["recompute", "save", ("save", "recompute"), ("recompute", "save")]
)
def test_carry_policy_both_ways(carry_policy):
    levels = 2 if isinstance(carry_policy, str) else 3
    check_against_lax({"levels": levels, "carry_policy": carry_policy}, 29)


@pytest.mark.parametrize("unroll", [2, True])
def test_unroll_passed_through(unroll):
    check_against_lax({"lengths": (3, 4), "unroll": unroll}, 11, reverse=True)


def test_random_lengths_seeded():
    rng = random.Random(16)
    for _ in range(6):
        n = rng.randint(1, 40)
        levels = rng.randint(1, 4)
        inner = [rng.randint(1, 5) for _ in range(levels - 1)]
        lengths = (math.ceil(n / math.prod(inner)), *inner)
        actions = tuple(rng.choice(rn._remat_scan.CARRY_ACTIONS) for _ in range(levels - 1))
        kw = {"lengths": lengths, "carry_policy": actions}
        check_against_lax(kw, n, reverse=rng.random() < 0.5, seed=rng.randint(0, 99))


def test_plan_with_names_inside_the_body(jax_upgrade_flags):
    def named(h, w):
        hidden = rn.name(jnp.tanh(h @ w), "mlp_hidden")
        return hidden + 0.5 * h, rn.name(jnp.mean(hidden), "mlp_out")

    ws = weights(13)
    plan = rn.plan(save=["mlp_hidden"], recompute=["mlp_out"])
    ours = lambda ws, h: rn.remat_scan(named, h, ws, levels=2, policy=plan)
    plain = lambda ws, h: jax.lax.scan(named, h, ws)
    g1 = jax.grad(loss_of(ours), argnums=(0, 1))(ws, H0)
    g0 = jax.grad(loss_of(plain), argnums=(0, 1))(ws, H0)
    assert rel_err(g1, g0) <= TOL
    typo = rn.plan(save=["mlp_hiden"])
    with pytest.raises(rn.PlanError, match=r"mlp_hiden.*mlp_hidden"):
        rn.remat_scan(named, H0, ws, levels=2, policy=typo)


def test_xs_none_with_length():
    w = weights(1)[0]
    ours = lambda w, h: rn.remat_scan(lambda c, _: layer(c, w), h, None, 17, levels=2)
    plain = lambda w, h: jax.lax.scan(lambda c, _: layer(c, w), h, None, 17)
    assert rel_err(ours(w, H0), plain(w, H0)) <= TOL
    g1 = jax.grad(loss_of(ours), argnums=(0, 1))(w, H0)
    g0 = jax.grad(loss_of(plain), argnums=(0, 1))(w, H0)
    assert rel_err(g1, g0) <= TOL


def test_pytree_carry_and_xs_with_integer_leaves():
    # Carry: a dict with a float pair and an int step counter; xs: a tuple (weights, int ids);
    # ys: a dict. The body closes over a differentiated scale (hoisted, then differentiated).
    def run(scan, scale, ws, ids):
        def body(carry, x):
            (a, b), count = carry["h"], carry["count"]
            w, i = x
            a, b = b, a + scale * jnp.tanh(b @ w) * (i % 3)
            return {"h": (a, b), "count": count + 1}, {"a": jnp.sum(a), "i": i}

        init = {"h": (H0, 0.5 * H0), "count": jnp.int32(0)}
        carry, ys = scan(body, init, (ws, ids))
        return jnp.sum(carry["h"][0] ** 2) + jnp.sum(carry["h"][1]) + jnp.sum(ys["a"] ** 2), (
            carry["count"],
            ys["i"],
        )

    ws, ids = weights(11), jnp.arange(11, dtype=jnp.int32)
    ours = lambda b, i, s: rn.remat_scan(b, i, s, lengths=(3, 2, 2))
    grads = [
        jax.grad(run, argnums=(1, 2), has_aux=True)(scan, 0.7, ws, ids)
        for scan in (ours, jax.lax.scan)
    ]
    (g1, (count1, i1)), (g0, (count0, i0)) = grads
    assert rel_err(g1, g0) <= TOL
    assert int(count1) == int(count0) == 11 and bool(jnp.all(i1 == i0))


def test_vmap_and_jit():
    ws = jnp.stack([weights(9, 1), weights(9, 2)])  # (2, 9, W, W)
    loss = loss_of(lambda ws, h: rn.remat_scan(layer, h, ws, levels=2))
    plain = loss_of(lambda ws, h: jax.lax.scan(layer, h, ws))
    g1 = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(ws, H0)
    g0 = jax.vmap(jax.grad(plain), in_axes=(0, None))(ws, H0)
    assert rel_err(g1, g0) <= TOL


def test_custom_vjp_upgrade_flags(jax_upgrade_flags):
    check_against_lax({"lengths": (3, 4), "carry_policy": "save"}, 10, reverse=True)


def test_zero_and_one_steps():
    for n in (0, 1):
        ws = weights(max(n, 1))[:n]
        h, ys = rn.remat_scan(layer, H0, ws, levels=3)
        h0, ys0 = jax.lax.scan(layer, H0, ws)
        assert h.shape == h0.shape and ys.shape == ys0.shape and rel_err(h, h0) <= TOL


# --- what the nesting promises: memory down, FLOPs up by one forward per level ---------------


def _stack(depth, batch=32, width=64):
    ws = jax.random.normal(jax.random.key(0), (depth, width, width)) / width**0.5
    h = jnp.ones((batch, width))  # carry (32, 64) float32: 8 KiB
    step = lambda c, w: (jnp.tanh(c @ w) + c, None)

    def loss(kw):
        return jax.grad(lambda ws, h: jnp.sum(rn.remat_scan(step, h, ws, **kw)[0] ** 2))

    return loss, ws, h


def test_two_levels_hold_sqrt_n_carries():
    loss, ws, h = _stack(64)
    carry = 32 * 64 * 4
    temp = {
        name: rn.compiled_memory(loss(kw), ws, h).temp_size_in_bytes
        for name, kw in {
            "single": {"levels": 1},
            "two": {"lengths": (8, 8)},
            "two, carries saved": {"lengths": (8, 8), "carry_policy": "save"},
            "three": {"lengths": (4, 4, 4)},
        }.items()
    }
    # One level holds the 64 carries; two hold 8 + 8 and the step's working set.
    assert temp["single"] >= 64 * carry
    assert temp["two"] <= temp["single"] / 3, temp
    assert temp["three"] <= temp["two"], temp
    # Saving the inner carries holds all 64 again.
    assert temp["two, carries saved"] >= 64 * carry, temp


def test_flops_one_more_forward_per_level():
    loss, ws, h = _stack(64)
    flops = {lv: rn.count_flops(loss({"levels": lv}), ws, h) for lv in (1, 2, 3)}
    saved = rn.count_flops(loss({"levels": 2, "carry_policy": "save"}), ws, h)
    # matmul FLOPs of one forward F: single-level remat 4F, each level below the top +1F.
    assert 1.2 <= flops[2] / flops[1] <= 1.3, flops
    assert 1.45 <= flops[3] / flops[1] <= 1.55, flops
    assert saved / flops[1] <= 1.02, (saved, flops)


def test_remat_scan_lengths_are_least_carries():
    for n in (1, 2, 10, 97, 512, 1000, 4096):
        for levels in (1, 2, 3):
            lengths = rn.remat_scan_lengths(n, levels)
            assert len(lengths) == levels
            assert lengths[0] == math.ceil(n / math.prod(lengths[1:]))
            best = min(b + math.ceil(n / b) for b in range(1, n + 1))
            if levels == 2:
                assert sum(lengths) <= 1.05 * best, (n, lengths)
    assert rn.remat_scan_lengths(4096, 2) == (64, 64)


# --- nn.remat_scan: parameters as flax.linen.scan stacks them ----------------------------------


class Block(fnn.Module):
    features: int = W

    @fnn.compact
    def __call__(self, h, x):
        hidden = rn.name(jnp.tanh(fnn.Dense(self.features)(h)), "mlp_hidden")
        return h + fnn.Dense(h.shape[-1], use_bias=False)(hidden) * x, jnp.sum(hidden)


def _scanned(n):
    return fnn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=n)


@pytest.mark.parametrize("kw", [{"levels": 2}, {"lengths": (3, 2, 2)}, {"levels": 1}])
def test_nn_remat_scan_params_move_both_ways(kw):
    n, xs = 11, jnp.linspace(0.5, 1.5, 11)
    ours, theirs = nn.remat_scan(Block, length=n, policy="save=mlp_hidden", **kw)(), _scanned(n)()
    from_theirs = theirs.init(jax.random.key(0), H0, xs)
    from_ours = ours.init(jax.random.key(0), H0, xs)
    # Same tree, same shapes, same initial values: nn.scan's own init.
    assert jax.tree.structure(from_ours) == jax.tree.structure(from_theirs)
    assert rel_err(from_ours, from_theirs) == 0.0

    def loss(module, v):
        h, ys = module.apply(v, H0, xs)
        return jnp.sum(h**2) + jnp.sum(ys)

    # Compiled once, run on both variable sets.
    apply_ours, apply_theirs = jax.jit(ours.apply), jax.jit(theirs.apply)
    grad_ours = jax.jit(jax.grad(functools.partial(loss, ours)))
    grad_theirs = jax.jit(jax.grad(functools.partial(loss, theirs)))
    for variables in (from_theirs, from_ours):
        assert rel_err(apply_ours(variables, H0, xs), apply_theirs(variables, H0, xs)) <= TOL
        assert rel_err(grad_ours(variables), grad_theirs(variables)) <= TOL


def test_nn_remat_scan_inside_a_model_with_length_only():
    class Model(fnn.Module):
        stack: type

        @fnn.compact
        def __call__(self, h):
            class Step(fnn.Module):
                @fnn.compact
                def __call__(self, c):
                    return jnp.tanh(fnn.Dense(W)(c)), None

            h, _ = self.stack(Step)()(h)
            return fnn.Dense(3)(h)

    def remat_stack(step):
        return nn.remat_scan(step, length=9, levels=2, reverse=True)

    def flax_stack(step):
        scanned = fnn.scan(
            step, variable_axes={"params": 0}, split_rngs={"params": True}, length=9, reverse=True
        )
        return scanned

    ours, theirs = Model(remat_stack), Model(flax_stack)
    variables = theirs.init(jax.random.key(1), H0)
    assert rel_err(ours.apply(variables, H0), theirs.apply(variables, H0)) <= TOL
    g1 = jax.grad(lambda v: jnp.sum(ours.apply(v, H0) ** 2))(variables)
    g0 = jax.grad(lambda v: jnp.sum(theirs.apply(v, H0) ** 2))(variables)
    assert rel_err(g1, g0) <= TOL


def test_nn_remat_scan_refuses_state():
    Stack = nn.remat_scan(Block, length=3)
    xs = jnp.ones(3)
    variables = Stack().init(jax.random.key(0), H0, xs)
    with_stats = {**variables, "batch_stats": {"mean": jnp.zeros(3)}}
    with pytest.raises(ValueError, match=r"nn.remat_scan\(Block\).*\['batch_stats'\].*Fix"):
        Stack().apply(with_stats, H0, xs)


# --- errors: the argument, the value and the fix --------------------------------------------------

WS = weights(10)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"levels": 0}, ValueError, r"`levels` must be an int >= 1.*got int 0.*Fix"),
        ({"levels": True}, ValueError, r"`levels` must be an int >= 1.*got bool True"),
        ({"levels": "2"}, ValueError, r"`levels`.*got str '2'"),
        ({"levels": 2, "lengths": (5, 2)}, TypeError, r"give `levels` or `lengths`, not both"),
        ({"lengths": 5}, TypeError, r"`lengths` must be a non-empty tuple.*got int 5.*Fix"),
        ({"lengths": ()}, TypeError, r"`lengths` must be a non-empty tuple"),
        ({"lengths": (2, 0)}, ValueError, r"`lengths` must hold ints >= 1, got \(2, 0\)"),
        ({"lengths": (2, 3)}, ValueError, r"\(2, 3\) cover only 6 steps.*of 10 steps.*\(4, 3\)"),
        (
            {"lengths": (6, 3)},
            ValueError,
            r"leave 2 outermost chunk\(s\) of 3 steps empty.*\(4, 3\)",
        ),
        ({"carry_policy": "keep"}, ValueError, r"`carry_policy` 'keep' holds 'keep'.*Fix"),
        ({"carry_policy": ("save",) * 2}, TypeError, r"`carry_policy`.*one per inner level \(1"),
        ({"carry_policy": 3}, TypeError, r"`carry_policy` must be one of"),
        ({"reverse": 1}, TypeError, r"`reverse` must be True or False, got int 1"),
        ({"unroll": 0}, TypeError, r"`unroll` must be an int >= 1 or a bool.*got int 0"),
        ({"policy": ["mlp_hidden"]}, TypeError, r"`policy`.*A list is not a plan"),
        ({"policy": "dots_saveabel"}, rn.PolicyError, r"dots_saveable"),
        ({"length": 9}, ValueError, r"`length` is 9 but `xs` has 10 steps.*length=10"),
        ({"length": -1}, TypeError, r"`length` must be a non-negative int"),
    ],
)
def test_bad_arguments(kwargs, error, pattern):
    prefix = "" if error is rn.PolicyError else r"rn.remat_scan: .*"
    with pytest.raises(error, match=prefix + pattern):
        rn.remat_scan(layer, H0, WS, **kwargs)


def test_bad_f_xs_and_carry():
    with pytest.raises(TypeError, match=r"rn.remat_scan: argument `f` must be a callable.*Fix"):
        rn.remat_scan("layer", H0, WS)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`xs` is None \(no arrays\).*length=8"):
        rn.remat_scan(layer, H0, None)
    with pytest.raises(
        ValueError, match=r"`xs` leaves have different leading axis sizes \[3, 10\]"
    ):
        rn.remat_scan(layer, H0, (WS, jnp.ones(3)))
    with pytest.raises(ValueError, match=r"`xs` has a scalar leaf"):
        rn.remat_scan(layer, H0, (WS, jnp.float32(1.0)))
    widen = lambda h, w: (jnp.concatenate([h, h], axis=-1), None)
    with pytest.raises(TypeError, match=r"`f` must return a carry of the same structure.*Fix"):
        rn.remat_scan(widen, H0, WS, levels=2)


def test_nn_remat_scan_bad_arguments():
    with pytest.raises(TypeError, match=r"nn.remat_scan: argument `target` must be a flax"):
        nn.remat_scan(Block(), length=3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"nn.remat_scan: argument `length` must be an int"):
        nn.remat_scan(Block, length="3")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"nn.remat_scan: argument `policy`"):
        nn.remat_scan(Block, length=3, policy=["mlp_hidden"])
    Stack = nn.remat_scan(Block, length=10, lengths=(2, 3))
    variables = _scanned(10)().init(jax.random.key(0), H0, jnp.ones(10))
    with pytest.raises(ValueError, match=r"rn.remat_scan: argument `lengths` \(2, 3\)"):
        Stack().apply(variables, H0, jnp.ones(10))


# --- rnnx.remat_scan: NNX layers stacked by nnx.vmap ----------------------------------------------


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(W, W, rngs=rngs)
        self.down = nnx.Linear(W, W, use_bias=False, rngs=rngs)

    def __call__(self, h, x):
        hidden = rn.name(jnp.tanh(self.up(h)), "mlp_hidden")
        return h + self.down(hidden) * x, jnp.sum(hidden)


def _nnx_layers(n: int) -> NNXBlock:
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return NNXBlock(rngs)

    return create(nnx.Rngs(0))


def _nnx_step(layer, h, x):
    return layer(h, x)


def _nnx_loss(run, layers, h, xs):
    h, ys = run(layers, h, xs)
    return jnp.sum(h**2) + jnp.sum(ys)


def _nnx_scan(layers, h, xs):  # the NNX idiom: every layer's input kept
    body = nnx.scan(nnx.remat(_nnx_step), in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    return body(layers, h, xs)


@pytest.mark.parametrize("kw", [{"levels": 2}, {"lengths": (3, 2, 2)}, {"levels": 1}])
def test_nnx_remat_scan_values_and_gradients_are_nnx_scans(kw):
    n, xs = 11, jnp.linspace(0.5, 1.5, 11)
    layers = _nnx_layers(n)
    ours = functools.partial(rnnx.remat_scan, _nnx_step, policy="save=mlp_hidden", **kw)
    assert rel_err(jax.jit(ours)(layers, H0, xs), _nnx_scan(layers, H0, xs)) <= TOL
    grad = lambda run: nnx.grad(functools.partial(_nnx_loss, run), argnums=(0, 1))  # noqa: E731
    (g_layers, g_h), (w_layers, w_h) = (
        nnx.jit(grad(ours))(layers, H0, xs),
        grad(_nnx_scan)(layers, H0, xs),
    )
    assert rel_err(nnx.state(g_layers), nnx.state(w_layers)) <= TOL
    assert rel_err(g_h, w_h) <= TOL


def test_nnx_remat_scan_holds_fewer_carries_than_nnx_scan():
    n, xs = 64, jnp.ones(64)
    layers = _nnx_layers(n)
    h = jnp.ones((8, W))
    graphdef, params = nnx.split(layers)

    def temp(run):
        loss = lambda p, h: _nnx_loss(run, nnx.merge(graphdef, p), h, xs)  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, h).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    ours = temp(functools.partial(rnnx.remat_scan, _nnx_step, levels=2, policy="full"))
    theirs = temp(_nnx_scan)
    carries = n * h.size * 4  # nnx.scan keeps every layer's input
    print(f"temp: rnnx.remat_scan levels=2 {ours:,} B, nnx.scan(nnx.remat) {theirs:,} B")
    assert ours < theirs - carries // 2, (ours, theirs)


def test_nnx_remat_scan_checks_the_plan_and_refuses_state():
    layers, xs = _nnx_layers(3), jnp.ones(3)
    with pytest.raises(rn.PlanError, match=r"\['mlp_hiden'\] never occur"):
        rnnx.remat_scan(_nnx_step, layers, H0, xs, policy={"save": ["mlp_hiden"]})

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def with_stats(rngs):
        return nnx.BatchNorm(W, rngs=rngs)

    with pytest.raises(ValueError, match=r"state besides nnx.Param \(BatchStat\).*Fix: nnx.scan"):
        rnnx.remat_scan(lambda m, h, _: (m(h), None), with_stats(nnx.Rngs(0)), H0, xs)
    with pytest.raises(TypeError, match=r"`layers` must be an nnx.Module.*got dict"):
        rnnx.remat_scan(_nnx_step, {"w": 1}, H0, xs)
    with pytest.raises(TypeError, match=r"`f` must be a function f\(layer, carry, x\)"):
        rnnx.remat_scan(layers, layers, H0, xs)
