"""rn.fused_update_stages: the update inside the backward pass over several stacks with state.

A small model of two stages with BatchNorm-like layers (normalized by the batch's own mean and
variance, a running average of the mean as state) and a non-stacked function between them,
checked against the two-phase step (``jax.value_and_grad`` with the new state as aux, then
``optimizer.update``): parameters, optimizer state and running averages equal after several
float64 steps, with the second stack's inputs saved, rebuilt by an inverse, or by a fused
backward; with ``save_every`` (inputs saved every k layers, layers whose outputs read their
state), and the memory it saves. Under data-parallel ``jax.shard_map`` (4 devices, BatchNorm's
statistics averaged over them) and under ``jax.vmap`` the step equals the unmapped one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import remat_nn as rn
from tests.gradients import rel_err

LA, LB, D, B = 3, 2, 8, 6
STEPS = 5


def norm(h, avg):
    """Training-mode BatchNorm without scale: the batch's statistics; a new running mean."""
    mean = jnp.mean(h, axis=0, keepdims=True)  # (1, D)
    var = jnp.mean((h - mean) ** 2, axis=0, keepdims=True)
    return (h - mean) / jnp.sqrt(var + 1e-5), 0.9 * avg + 0.1 * mean[0]


def embed(rest, s, x):
    return x @ rest["embed"], s


def layer_a(p, c, h):
    y, avg = norm(h, c["avg"])
    return h + jnp.tanh(y @ p["w"]) * p["g"][None, :], {"avg": avg}


def down(rest, s, h):
    y, avg = norm(h @ rest["down"], s["down_avg"])
    return (y[:, : D // 2], y[:, D // 2 :]), {**s, "down_avg": avg}


def branch(name):
    def fn(p, c, x):
        y, avg = norm(x, c[name])
        return jnp.tanh(y @ p["w" + name]), {**c, name: avg}

    return fn


COUPLING = rn.coupling_block(branch("f"), branch("g"))


def layer_b(p, c, h):
    return COUPLING.forward(p, c, h)


def head(rest, s, h, x):
    y, avg = norm(jnp.concatenate(h, axis=-1), s["head_avg"])
    loss = jnp.mean((y @ rest["out"] - x[:, :1]) ** 2)
    return (loss, {"y_mean": jnp.mean(y)}), {**s, "head_avg": avg}


def stages(form):
    rebuild = {
        "saved": {},
        "inverse": {"inverse": lambda p, c, y: COUPLING.inverse(p, c, y)},
        "backward": {"backward": COUPLING.backward},
    }[form]
    return [
        rn.FusedStage("a", layer_a),
        rn.FusedStage("b", layer_b, before=jax.checkpoint(down), **rebuild),
    ]


def loss_fn(params, state, x, first=layer_a):
    """The model written out, for jax.grad: (loss, (aux, new state)); ``first``: stage a's layer."""
    h, s = embed(params, state, x)
    new = {}
    for key, fn, before in (("a", first, None), ("b", layer_b, down)):
        if before is not None:
            h, s = before(params, s, h)

        def body(h, pc, fn=fn):
            h, c = fn(*pc, h)
            return h, c

        h, new[key] = jax.lax.scan(body, h, (params[key], state[key]))
    (loss, aux), s = head(params, s, h, x)
    return loss, (aux, {**s, **new})


def two_phase(tx, first=layer_a):
    def step(params, opt_state, state, x):
        (loss, (aux, state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, state, x, first
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, (loss, aux)

    return step


def make(dtype, la=LA):
    k = jax.random.split(jax.random.key(0), 8)
    n = lambda i, *shape: jax.random.normal(k[i], shape, dtype) / shape[-1] ** 0.5  # noqa: E731
    params = {
        "embed": n(0, 4, D),
        "a": {"w": n(1, la, D, D), "g": jnp.ones((la, D), dtype)},
        "down": n(2, D, D),
        "b": {"wf": n(3, LB, D // 2, D // 2), "wg": n(4, LB, D // 2, D // 2)},
        "out": n(5, D, 1),
    }
    state = {
        "a": {"avg": jnp.zeros((la, D), dtype)},
        "b": {"f": jnp.zeros((LB, D // 2), dtype), "g": jnp.zeros((LB, D // 2), dtype)},
        "down_avg": jnp.zeros((D,), dtype),
        "head_avg": jnp.zeros((D,), dtype),
    }
    return params, state, jax.random.normal(k[6], (B, 4), dtype)


OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(optax.linear_schedule(1e-2, 1e-3, STEPS), weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
}


def run(step, params, opt_state, state, x, n=STEPS):
    step = jax.jit(step)
    for _ in range(n):
        params, opt_state, state, loss = step(params, opt_state, state, x)
    return params, opt_state, state, loss


@pytest.mark.parametrize("form", ["saved", "inverse", "backward"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equals_two_phase_step_float64(name, form):
    tx = OPTIMIZERS[name]()
    with jax.enable_x64(True):
        params, state, x = make(jnp.float64)
        step = rn.fused_update_stages(embed, stages(form), head, tx, has_aux=True)
        fused = run(step, params, tx.init(params), state, x)
        ref = run(two_phase(tx), params, tx.init(params), state, x)
        errs = [rel_err(a, b) for a, b in zip(fused[:3], ref[:3], strict=True)]
        moved = float(jnp.max(jnp.abs(fused[2]["b"]["g"])))
    shown = ", ".join(f"{e:.2g}" for e in errs)
    print(f"{name} {form}: {STEPS} steps float64, params/opt_state/batch_stats rel err {shown}")
    assert max(errs) <= 1e-6
    assert jax.tree.structure(fused[:3]) == jax.tree.structure(ref[:3])
    assert moved > 0  # the running averages moved


def test_clip_norm_and_norms_equal_the_two_phase_step_float64():
    tx = optax.adam(1e-2)
    clipped = optax.chain(optax.clip_by_global_norm(0.05), tx)
    with jax.enable_x64(True):
        params, state, x = make(jnp.float64)
        step = rn.fused_update_stages(
            embed, stages("backward"), head, tx, has_aux=True, norms=True, clip_norm=0.05
        )
        *fused, got = jax.jit(step)(params, tx.init(params), state, x)
        ref = two_phase(clipped)(params, clipped.init(params), state, x)
        grads = jax.grad(lambda p: loss_fn(p, state, x)[0])(params)
        err = rel_err(fused[:3], (ref[0], ref[1][1], ref[2]))  # adam's part
        norm_err = abs(float(got["grad_norm"]) / float(optax.tree.norm(grads)) - 1)
    assert err <= 1e-6
    assert norm_err <= 1e-9
    assert float(got["grad_norm"]) > 0.05  # the clip was active


# --- save_every: a stage's inputs saved every k layers, a segment's recomputed in the backward ---


def layer_s(p, c, h):
    """``layer_a`` whose output also reads its state (as eval-mode BatchNorm's does): recomputed
    with another layer's state, or with the state it moved to, it gives other gradients."""
    y, avg = norm(h, c["avg"])
    return h + jnp.tanh((y + c["avg"][None, :]) @ p["w"]) * p["g"][None, :], {"avg": avg}


@pytest.mark.parametrize("k", [1, 2, 3])
def test_save_every_equals_two_phase_step_float64(k):
    # Stage a: 5 layers whose outputs read their state (segments of k layers, the last one
    # shorter for k = 2, 3), each with its own state from the start; stage b: 2 couplings
    # (k = 3: one segment shorter than k). Each recomputed layer must run with the state the
    # forward gave it, and the state must move once per step.
    tx = optax.adam(1e-2)
    with jax.enable_x64(True):
        params, state, x = make(jnp.float64, la=5)
        state["a"]["avg"] = jax.random.normal(jax.random.key(7), (5, D), jnp.float64)
        parts = [
            rn.FusedStage("a", layer_s, save_every=k),
            rn.FusedStage("b", layer_b, before=jax.checkpoint(down), save_every=k),
        ]
        step = rn.fused_update_stages(embed, parts, head, tx, has_aux=True)
        fused = run(step, params, tx.init(params), state, x)
        ref = run(two_phase(tx, layer_s), params, tx.init(params), state, x)
        errs = [rel_err(a, b) for a, b in zip(fused[:3], ref[:3], strict=True)]
    shown = ", ".join(f"{e:.2g}" for e in errs)
    print(f"save_every={k}: {STEPS} steps float64, params/opt_state/state rel err {shown}")
    assert jax.tree.structure(fused[:3]) == jax.tree.structure(ref[:3])
    assert max(errs) <= 1e-6


def test_save_every_holds_a_segments_inputs_and_the_saved_ones():
    """A stage's layer inputs held: ceil(L / k) saved + k recomputed, instead of L."""
    depth, width, batch = 32, 64, 512
    tx = optax.adam(1e-3)
    params = {"a": {"w": jnp.zeros((depth, width, width)), "g": jnp.ones((depth, width))}}
    state = {"a": {"avg": jnp.zeros((depth, width))}}
    x = jnp.zeros((batch, width))
    temp = {}
    for k in (None, 4):
        step = rn.fused_update_stages(
            lambda r, s, x: (x, s),
            [rn.FusedStage("a", layer_a, save_every=k)],
            lambda r, s, h, x: (jnp.mean(h**2), s),
            tx,
        )
        lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, tx.init(params), state, x)
        temp[k] = lowered.compile().memory_analysis().temp_size_in_bytes
    h_bytes = batch * width * 4
    print(f"temp by save_every: {temp}; one layer's input {h_bytes} B")
    assert temp[None] - temp[4] >= (32 - 12) * h_bytes * 0.95  # 8 + 4 inputs instead of 32


def test_state_without_a_stages_key_and_empty_state():
    def plain(p, c, h):
        return jnp.tanh(h @ p), c

    tx = optax.sgd(0.1)
    step = rn.fused_update_stages(
        lambda r, s, x: (x, s),
        [rn.FusedStage("a", plain), rn.FusedStage("b", plain)],
        lambda r, s, h, x: (jnp.mean(h**2), s),
        tx,
    )
    params = {"a": jnp.ones((2, 3, 3)) / 3, "b": jnp.ones((1, 3, 3)) / 3}
    new, _, state, _ = step(params, tx.init(params), {}, jnp.ones((2, 3)))
    assert state == {}
    ref = jax.grad(
        lambda p: jnp.mean(
            jnp.tanh(jnp.tanh(jnp.tanh(jnp.ones((2, 3)) @ p["a"][0]) @ p["a"][1]) @ p["b"][0]) ** 2
        )
    )(params)
    assert float(rn.relative_error(new, jax.tree.map(lambda p, g: p - 0.1 * g, params, ref))) < 1e-6


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ({"stages": []}, TypeError, "non-empty sequence of rn.FusedStage"),
        ({"stages": [rn.FusedStage("a", layer_a)] * 2}, ValueError, "its own stack"),
        ({"clip_norm": 0.0}, ValueError, "clip_norm must be a positive"),
        (
            {"stages": [rn.FusedStage("a", layer_a, save_every=0)]},
            ValueError,
            r"fused_update_stages: stage 'a': save_every must be a positive int .* got 0\.",
        ),
        (
            {"stages": [rn.FusedStage("a", layer_a, save_every=True)]},
            ValueError,
            "save_every must be a positive int",
        ),
        (
            {"stages": [rn.FusedStage("b", layer_b, backward=COUPLING.backward, save_every=2)]},
            ValueError,
            r"stages \['b'\] give save_every with inverse or backward.*Fix: drop save_every",
        ),
    ],
)
def test_bad_stages_and_options_are_refused(args, error, match):
    kwargs = {"stages": stages("saved"), **args}
    with pytest.raises(error, match=match):
        rn.fused_update_stages(embed, kwargs.pop("stages"), head, optax.adam(1e-2), **kwargs)


def test_params_without_a_stack_and_whole_gradient_optimizers_are_refused():
    params, state, x = make(jnp.float32)
    tx = optax.adam(1e-2)
    step = rn.fused_update_stages(embed, stages("saved"), head, tx, has_aux=True)
    with pytest.raises(TypeError, match=r"holding each stage's stack at its key \['a', 'b'\]"):
        step({k: v for k, v in params.items() if k != "b"}, tx.init(params), state, x)
    with pytest.raises(TypeError, match="state must be a dict"):
        step(params, tx.init(params), None, x)
    tx = optax.chain(optax.clip_by_global_norm(1.0), tx)
    step = rn.fused_update_stages(embed, stages("saved"), head, tx, has_aux=True)
    with pytest.raises(rn.FusedUpdateError, match="fused_update_stages: .*clip_by_global_norm"):
        step(params, tx.init(params), state, x)


def test_a_rematerialized_before_unit_recomputes_in_the_backward():
    # A `before` under jax.checkpoint keeps only its input until its VJP: its recomputation is
    # tied to the incoming cotangent, so XLA:CPU (whose scheduler ignores prevent_cse) does not
    # run it at the start of the backward pass or keep the forward's activations instead.
    width, batch = 256, 64

    def before(rest, s, h):
        for w in rest["mlp"]:  # 4 activations of (batch, width) each
            h = jnp.tanh(h @ w)
        return h, s

    def plain(p, c, h):
        return jnp.tanh(h @ p), c

    def temp(before_fn):
        tx = optax.sgd(0.1)
        step = rn.fused_update_stages(
            lambda r, s, x: (x, s),
            [rn.FusedStage("a", plain), rn.FusedStage("b", plain, before=before_fn)],
            lambda r, s, h, x: (jnp.mean(h**2), s),
            tx,
        )
        params = {
            "a": jnp.zeros((2, width, width)),
            "b": jnp.zeros((2, width, width)),
            "mlp": [jnp.zeros((width, width))] * 4,
        }
        x = jnp.zeros((batch, width))
        state = tx.init(params)
        lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, {}, x)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    stored, recomputed = temp(before), temp(jax.checkpoint(before))
    activation = batch * width * 4
    print(f"temp: before stored {stored} B, rematerialized {recomputed} B")
    assert stored - recomputed >= 2 * activation


# --- under shard_map and vmap ---------------------------------------------------------------------


def synced(axis):
    """The model above (stages "a" saved, "b" by its fused backward) with BatchNorm's statistics
    averaged over the mapped ``axis`` (synchronized BatchNorm; None: the local batch's), so that
    under data-parallel shard_map it is the unsharded model: embed, stages, head."""

    def stat(v):
        return v if axis is None else jax.lax.pmean(v, axis)

    def snorm(h, avg):
        mean = stat(jnp.mean(h, axis=0, keepdims=True))  # (1, D)
        var = stat(jnp.mean((h - mean) ** 2, axis=0, keepdims=True))
        return (h - mean) / jnp.sqrt(var + 1e-5), 0.9 * avg + 0.1 * mean[0]

    def layer(p, c, h):
        y, avg = snorm(h, c["avg"])
        return h + jnp.tanh(y @ p["w"]) * p["g"][None, :], {"avg": avg}

    def before(rest, s, h):
        y, avg = snorm(h @ rest["down"], s["down_avg"])
        return (y[:, : D // 2], y[:, D // 2 :]), {**s, "down_avg": avg}

    def branch(name):
        def fn(p, c, x):
            y, avg = snorm(x, c[name])
            return jnp.tanh(y @ p["w" + name]), {**c, name: avg}

        return fn

    coupling = rn.coupling_block(branch("f"), branch("g"))

    def head_fn(rest, s, h, x):
        y, avg = snorm(jnp.concatenate(h, axis=-1), s["head_avg"])
        return stat(jnp.mean((y @ rest["out"] - x[:, :1]) ** 2)), {**s, "head_avg": avg}

    parts = [
        rn.FusedStage("a", layer),
        rn.FusedStage(
            "b", coupling.forward, before=jax.checkpoint(before), backward=coupling.backward
        ),
    ]
    return embed, parts, head_fn


def test_under_shard_map_equals_the_unsharded_step():
    # Data parallel over 4 devices: parameters, optimizer state and BatchNorm state replicated
    # (unvarying), the batch split; the loss and the batch statistics averaged over the devices.
    # float64: the comparison sees the order of the reductions, not float32 round-off.
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((4,), ("data",))
    put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
    with jax.enable_x64(True):
        params, state, _ = make(jnp.float64)
        x = jax.random.normal(jax.random.key(3), (16, 4), jnp.float64)
        sharded = jax.shard_map(
            rn.fused_update_stages(*synced("data"), tx),
            mesh=mesh,
            in_specs=(P(), P(), P(), P("data")),
            out_specs=(P(), P(), P(), P()),
        )
        replicated = (put(t, P()) for t in (params, tx.init(params), state))
        got = run(sharded, *replicated, put(x, P("data")))
        want = run(rn.fused_update_stages(*synced(None), tx), params, tx.init(params), state, x)
        errs = [rel_err(a, b) for a, b in zip(got, want, strict=True)]
    shown = ", ".join(f"{e:.2g}" for e in errs)
    print(f"shard_map over 4 devices vs one, {STEPS} steps: params/opt_state/state/loss {shown}")
    assert max(errs) <= 1e-6


def test_under_vmap_equals_each_model_on_its_own():
    # Two independent models (parameters, optimizer and BatchNorm states, batches stacked).
    tx = optax.adam(1e-2)
    step = rn.fused_update_stages(*synced(None), tx)
    with jax.enable_x64(True):
        (p0, s0, x0), (p1, s1, x1) = make(jnp.float64), make(jnp.float64)
        one = (jax.tree.map(lambda a: a * 0.5, p1), jax.tree.map(lambda a: a + 0.1, s1), x1 + 1)
        params, state, x = jax.tree.map(lambda a, b: jnp.stack([a, b]), (p0, s0, x0), one)
        got = run(jax.vmap(step), params, jax.vmap(tx.init)(params), state, x)
        errs = [
            rel_err(jax.tree.map(lambda a, i=i: a[i], got), run(step, p, tx.init(p), s, xx))
            for i, (p, s, xx) in enumerate(((p0, s0, x0), one))
        ]
    print(f"vmapped vs each model alone, {STEPS} steps: rel err {errs}")
    assert max(errs) <= 1e-6
