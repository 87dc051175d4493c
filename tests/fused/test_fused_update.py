"""rn.fused_update_step: the optimizer update inside the backward scan over a layer stack.

Checked against the two-phase step (jax.grad of the same model, then optimizer.update): equal
parameters and optimizer state after 10 steps, in float64 (so the comparison sees the update
order, not float32 round-off amplified by adam's normalisation), and after one step in float32;
whole-gradient optimizers refused; the compiled donated step's temp without the gradient stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import remat_nn as rn
from tests.gradients import counts_agree

L, D, B = 6, 16, 4


def embed(rest, x):
    return x * rest["scale"][None, :]


def layer(w, h):
    return jnp.tanh(h @ w["w"] + w["b"][None, :]) + h


def head(rest, h, x):
    return jnp.mean((h * rest["out"][None, :] - x) ** 2)


def loss_fn(params, x):
    stack, rest = params
    h, _ = jax.lax.scan(lambda h, w: (layer(w, h), None), embed(rest, x), stack)
    return head(rest, h, x)


def two_phase(tx):
    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make(dtype, length=L, width=D, batch=B):
    k = jax.random.split(jax.random.key(0), 4)
    stack = {
        "w": jax.random.normal(k[0], (length, width, width), dtype) / width**0.5,
        "b": jax.random.normal(k[1], (length, width), dtype) * 0.1,
    }
    rest = {"scale": jnp.ones((width,), dtype), "out": jnp.ones((width,), dtype)}
    return (stack, rest), jax.random.normal(k[2], (batch, width), dtype)


OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw_schedule": lambda: optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
}


def run(step, params, opt_state, x, n):
    step = jax.jit(step)
    for _ in range(n):
        params, opt_state, loss = step(params, opt_state, x)
    return params, opt_state, loss


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equals_two_phase_step_float64(name):
    tx = OPTIMIZERS[name]()
    with jax.enable_x64(True):
        params, x = make(jnp.float64)
        fused = run(rn.fused_update_step(embed, layer, head, tx), params, tx.init(params), x, 10)
        ref = run(two_phase(tx), params, tx.init(params), x, 10)
    err = float(rn.relative_error(fused[:2], ref[:2]))
    print(f"{name}: 10 steps float64, max-scaled rel err {err:.3g}")
    assert err <= 1e-6
    assert jax.tree.structure(fused[1]) == jax.tree.structure(ref[1])
    counts = [int(c) for c in jax.tree.leaves(fused[1]) if jnp.issubdtype(c.dtype, jnp.integer)]
    assert all(c == 10 for c in counts) and (counts or name == "sgd_momentum")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equals_two_phase_step_float32_one_step(name):
    tx = OPTIMIZERS[name]()
    params, x = make(jnp.float32)
    fused = run(rn.fused_update_step(embed, layer, head, tx), params, tx.init(params), x, 1)
    ref = run(two_phase(tx), params, tx.init(params), x, 1)
    err = float(rn.relative_error(fused, ref))
    print(f"{name}: 1 step float32, max-scaled rel err {err:.3g}")
    assert err <= 1e-6


@pytest.mark.parametrize(
    ("tx", "named"),
    [
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "clip_by_global_norm"),
        (optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation(), "MultiSteps"),
    ],
)
def test_whole_gradient_transformations_are_refused_by_name(tx, named):
    params, x = make(jnp.float32)
    step = rn.fused_update_step(embed, layer, head, tx)
    with pytest.raises(rn.FusedUpdateError, match=f"optax.{named}.*Alternative"):
        step(params, tx.init(params), x)


def scale_by_global_norm() -> optax.GradientTransformation:
    """Not in the deny-list: only the numerical probe can tell it reads the whole gradient."""

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda g: g / optax.tree.norm(updates), updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def test_unlisted_non_element_wise_transformation_is_refused_by_the_probe():
    tx = optax.chain(scale_by_global_norm(), optax.sgd(1e-2))
    params, x = make(jnp.float32)
    with pytest.raises(rn.FusedUpdateError, match="not element-wise.*relative error"):
        rn.fused_update_step(embed, layer, head, tx)(params, tx.init(params), x)


def test_params_must_be_a_stack_and_rest_pair():
    params, x = make(jnp.float32)
    tx = optax.sgd(1e-2)
    step = rn.fused_update_step(embed, layer, head, tx)
    with pytest.raises(TypeError, match=r"pair \(stack, rest\), got dict"):
        step({"stack": params[0]}, tx.init(params), x)


def test_donated_step_has_no_gradient_stack_in_temp():
    """The two-phase donated step's temp holds the gradient stack; the fused one's cannot."""
    tx = optax.adam(1e-3)
    params, x = make(jnp.float32, length=16, width=64, batch=8)
    state = tx.init(params)
    donate = {"donate_argnums": (0, 1)}
    fused = rn.fused_update_step(embed, layer, head, tx)
    temp = {
        label: jax.jit(f, **donate).lower(params, state, x).compile().memory_analysis()
        for label, f in (("fused", fused), ("two_phase", two_phase(tx)))
    }
    grad_stack = sum(a.nbytes for a in jax.tree.leaves(params[0]))
    fused_temp = temp["fused"].temp_size_in_bytes
    two_temp = temp["two_phase"].temp_size_in_bytes
    print(f"temp fused {fused_temp} B, two-phase {two_temp} B, gradient stack {grad_stack} B")
    assert temp["fused"].alias_size_in_bytes == sum(
        a.nbytes for a in jax.tree.leaves((params, state))
    )
    assert two_temp >= grad_stack > fused_temp


def test_optimizer_state_slices_are_not_live_during_the_layers_backward():
    """Adam's moments cost the donated step no temp over stateless sgd.

    The peak is the layer's backward (activations 8x the layer's weights); the update runs after
    it. Reading the moments' slices before the backward (as XLA scheduled them when they were
    read outside the update's branch) put 2 slices more at that peak.
    """
    params, x = make(jnp.float32, length=4, width=256, batch=2048)
    temp = {}
    for name, tx in (("sgd", optax.sgd(1e-3)), ("adam", optax.adam(1e-3))):
        step = jax.jit(rn.fused_update_step(embed, layer, head, tx), donate_argnums=(0, 1))
        compiled = step.lower(params, tx.init(params), x).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    layer_bytes = sum(a[0].nbytes for a in jax.tree.leaves(params[0]))
    print(f"temp sgd {temp['sgd']} B, adam {temp['adam']} B, one layer {layer_bytes} B")
    assert temp["adam"] - temp["sgd"] < layer_bytes / 2


def test_layer_slice_the_vjp_read_is_not_live_during_the_update():
    """The update reads the layer's parameters itself, once the gradient exists.

    A layer of two (256, 512) matrices on a batch of 16: its activations are small, so the
    donated sgd step's peak is the update, with the layer's gradient (2 matrices) and its new
    parameters (2) in temp: 4 matrices' bytes and some activations. Handed the slice the VJP
    read, the update kept that materialized slice live too (2 more: 6.16 matrices' bytes).
    """
    width, length, batch = 256, 4, 16
    k = jax.random.split(jax.random.key(0), 3)
    stack = {
        "a": jax.random.normal(k[0], (length, width, 2 * width)) / width**0.5,
        "b": jax.random.normal(k[1], (length, 2 * width, width)) / (2 * width) ** 0.5,
    }
    params = (stack, {"scale": jnp.ones((width,)), "out": jnp.ones((width,))})
    x = jax.random.normal(k[2], (batch, width))

    def two_matrices(w, h):  # (B, D) -> (B, 2D) -> (B, D)
        return jnp.tanh(jnp.tanh(h @ w["a"]) @ w["b"]) + h

    tx = optax.sgd(1e-3)
    step = jax.jit(rn.fused_update_step(embed, two_matrices, head, tx), donate_argnums=(0, 1))
    temp = step.lower(params, tx.init(params), x).compile().memory_analysis().temp_size_in_bytes
    matrix_bytes = stack["a"][0].nbytes
    print(f"temp {temp} B = {temp / matrix_bytes:.2f} x one matrix ({matrix_bytes} B)")
    assert temp < 5 * matrix_bytes


def test_stack_key_params_dict_with_aux_and_norms_equal_two_phase():
    """Params as flax holds them (stack at a key); a mask by path sees the same paths."""
    in_stack = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: path[0].key == "w", p)
    tx = optax.adamw(1e-2, weight_decay=0.5, mask=in_stack)  # decays only what is under "w"
    (stack, rest), x = make(jnp.float32)
    params = {"w": stack, **rest}

    def head_aux(rest, h, x):
        return head(rest, h, x), {"h_mean": jnp.mean(h)}

    def dict_loss(p, x):
        return loss_fn((p["w"], {k: v for k, v in p.items() if k != "w"}), x)

    step = rn.fused_update_step(embed, layer, head_aux, tx, stack_key="w", has_aux=True, norms=True)
    new, state, (loss, aux), norms = jax.jit(step)(params, tx.init(params), x)
    value, grads = jax.value_and_grad(dict_loss)(params, x)
    updates, ref_state = tx.update(grads, tx.init(params), params)
    ref = optax.apply_updates(params, updates)
    err = float(rn.relative_error((new, state), (ref, ref_state)))
    print(f"stack_key, 1 step float32: max-scaled rel err {err:.3g}")
    assert err <= 1e-6 and float(rn.relative_error(loss, value)) <= 1e-6
    assert set(aux) == {"h_mean"}
    for got, want in ((norms["grad_norm"], grads), (norms["update_norm"], updates)):
        assert float(rn.relative_error(got, optax.tree.norm(want))) <= 1e-6


def test_stack_key_must_name_a_key_of_the_params():
    (stack, rest), x = make(jnp.float32)
    params = {"w": stack, **rest}
    tx = optax.sgd(1e-2)
    step = rn.fused_update_step(embed, layer, head, tx, stack_key="layers")
    with pytest.raises(TypeError, match=r"stack_key='layers'.*got \['out', 'scale', 'w'\]"):
        step(params, tx.init(params), x)


# --- a reversible stack: the backward rebuilds each layer's input (inverse_fn) --------------------


def coupling(w, h):
    x1, x2 = h
    y1 = x1 + jnp.tanh(x2 @ w["f"])
    return y1, x2 + jnp.tanh(y1 @ w["g"])


def uncoupling(w, y):
    y1, y2 = y
    x2 = y2 - jnp.tanh(y1 @ w["g"])
    return y1 - jnp.tanh(x2 @ w["f"]), x2


_BLOCK = rn.coupling_block(
    lambda p, c, x2: (jnp.tanh(x2 @ p["f"]), c), lambda p, c, y1: (jnp.tanh(y1 @ p["g"]), c)
)


def coupling_backward(w, y, dy):  # the inverse fused with the VJP, one branch at a time
    return _BLOCK.backward(w, None, y, dy)


REBUILT = {"inverse_fn": uncoupling, "backward_fn": coupling_backward}


def split_embed(rest, x):
    h = x * rest["scale"][None, :]
    return h[:, : h.shape[1] // 2], h[:, h.shape[1] // 2 :]


def merged_head(rest, h, x):
    return head(rest, jnp.concatenate(h, axis=1), x)


def reversible_loss(params, x):
    stack, rest = params
    h, _ = jax.lax.scan(lambda h, w: (coupling(w, h), None), split_embed(rest, x), stack)
    return merged_head(rest, h, x)


def make_reversible(dtype, length=L, width=D, batch=B):
    k = jax.random.split(jax.random.key(3), 3)
    half = width // 2
    stack = {
        "f": jax.random.normal(k[0], (length, half, half), dtype) / half**0.5,
        "g": jax.random.normal(k[1], (length, half, half), dtype) / half**0.5,
    }
    rest = {"scale": jnp.ones((width,), dtype), "out": jnp.ones((width,), dtype)}
    return (stack, rest), jax.random.normal(k[2], (batch, width), dtype)


@pytest.mark.parametrize("rebuilt", sorted(REBUILT))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_reversible_stack_equals_two_phase_step_float64(name, rebuilt):
    with jax.enable_x64(True):
        tx = OPTIMIZERS[name]()
        params, x = make_reversible(jnp.float64)
        fused = rn.fused_update_step(
            split_embed, coupling, merged_head, tx, **{rebuilt: REBUILT[rebuilt]}
        )

        def two(params, opt_state, x):
            loss, grads = jax.value_and_grad(reversible_loss)(params, x)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        got = run(fused, params, tx.init(params), x, 10)
        want = run(two, params, tx.init(params), x, 10)
        err = float(rn.relative_error(got, want))  # params, optimizer state, the last loss
        print(f"{name}, {rebuilt}: fused vs two-phase, 10 float64 steps: rel err {err:.3g}")
        assert err <= 1e-6


@pytest.mark.parametrize("rebuilt", sorted(REBUILT))
def test_every_rebuilt_input_recomputed_equals_two_phase_step_float64(rebuilt):
    # drift_rtol=1e-30: every layer's rebuilt input fails the drift check and is recomputed from
    # the stack's input, so every step runs the recompute branch.
    with jax.enable_x64(True):
        tx = optax.adam(1e-2)
        params, x = make_reversible(jnp.float64)
        kw = {rebuilt: REBUILT[rebuilt], "drift_rtol": 1e-30, "fallback": "recompute"}
        fused = rn.fused_update_step(split_embed, coupling, merged_head, tx, **kw)

        def two(params, opt_state, x):
            loss, grads = jax.value_and_grad(reversible_loss)(params, x)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        rn.drift_recomputes(reset=True)
        got = run(fused, params, tx.init(params), x, 3)
        want = run(two, params, tx.init(params), x, 3)
        assert float(rn.relative_error(got, want)) <= 1e-6
        # (a layer whose input happens to be rebuilt bit for bit passes even 1e-30)
        assert len(rn.drift_recomputes()) >= L // 2


def linear_coupling(w, h):  # no tanh: the activations grow layer after layer
    x1, x2 = h
    y1 = x1 + x2 @ w["f"]
    return y1, x2 + y1 @ w["g"]


def linear_uncoupling(w, y):
    y1, y2 = y
    x2 = y2 - y1 @ w["g"]
    return y1 - x2 @ w["f"], x2


def test_a_growing_rebuilt_stack_is_recomputed_not_silently_wrong():
    tx = optax.sgd(1.0)  # the update is the gradient
    params, x = make_reversible(jnp.float32, length=24)
    params = (jax.tree.map(lambda w: 2.0 * w, params[0]), params[1])

    def loss(params, x):
        stack, rest = params
        h, _ = jax.lax.scan(lambda h, w: (linear_coupling(w, h), None), split_embed(rest, x), stack)
        return merged_head(rest, h, x)

    def update(**kw):
        fn = rn.fused_update_step(split_embed, linear_coupling, merged_head, tx, **kw)
        new = jax.jit(fn)(params, tx.init(params), x)[0]
        return jax.tree.map(jnp.subtract, params, new)

    kw = {"inverse_fn": linear_uncoupling, "drift_rtol": 2.4e-5}  # a tight check
    rn.drift_recomputes(reset=True)
    grads = {f: update(**kw, fallback=f) for f in ("none", "recompute")}
    with pytest.raises(jax.errors.JaxRuntimeError, match="NotInvertibleError: fused_update_step"):
        update(inverse_fn=linear_uncoupling)  # the default, fallback="error"
    with jax.enable_x64(True):
        f64 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float64), t)  # noqa: E731
        exact = jax.grad(loss)(f64(params), f64(x))
    own = float(rn.relative_error(jax.grad(loss)(params, x), exact))
    err = {f: float(rn.relative_error(g, exact)) for f, g in grads.items()}
    print(f"float32 vs float64: plain autodiff {own:.3g}, rebuilt {err}")
    # Reconstruction alone ("none") is printed, not asserted: how far it drifts is XLA's
    # rounding, which differs by CPU model (1e-1 and more on most; on an AMD EPYC the program
    # without the check rebuilt every input bit for bit). The check measured the drift above
    # (fallback="error" refused), and the recomputed gradient is as close as autodiff's.
    assert err["recompute"] < 100 * own
    assert rn.drift_recomputes()


@pytest.mark.parametrize("fallback", ["error", "recompute"])
def test_report_drift_counts_in_the_norms_what_the_host_callbacks_report(fallback):
    # The growing stack above: with report_drift, a failed check raises nothing and calls
    # nothing on the host (so JAX's persistent cache can keep the step); the norms' dict
    # counts the failed checks (per layer) and the recomputed layers.
    tx = optax.sgd(1.0)
    params, x = make_reversible(jnp.float32, length=24)
    params = (jax.tree.map(lambda w: 2.0 * w, params[0]), params[1])
    kw = dict(inverse_fn=linear_uncoupling, drift_rtol=2.4e-5, fallback=fallback, norms=True)
    host = rn.fused_update_step(split_embed, linear_coupling, merged_head, tx, **kw)
    reporting = rn.fused_update_step(
        split_embed, linear_coupling, merged_head, tx, **kw, report_drift=True
    )
    args = (params, tx.init(params), x)
    assert "callback" in jax.jit(host).lower(*args).as_text()
    assert "callback" not in jax.jit(reporting).lower(*args).as_text()
    new = jax.jit(reporting)(*args)
    norms = {k: float(new[3][k]) for k in rn.DRIFT_REPORT_FIELDS}
    rn.drift_recomputes(reset=True)
    if fallback == "error":
        with pytest.raises(jax.errors.JaxRuntimeError, match="NotInvertibleError"):
            jax.block_until_ready(jax.jit(host)(*args))
        assert norms["drift_failed"] >= 1 and norms["drift_recomputed"] == 0
        return
    want = jax.jit(host)(*args)
    recomputed = sum(rn.drift_recomputes().values())
    print(f"host: {recomputed} recomputed; reported {norms}")
    assert recomputed > 0 and norms["drift_failed"] == 0
    assert counts_agree(norms["drift_recomputed"], recomputed)
    assert float(rn.relative_error(new[0], want[0])) < 1e-3
    with pytest.raises(ValueError, match="norms=True with report_drift=True"):
        rn.fused_update_step(split_embed, linear_coupling, merged_head, tx, report_drift=True)


@pytest.mark.parametrize(
    ("off", "dtype", "refused"),
    [(1e-4, jnp.float32, False), (5e-4, jnp.float32, True), (2e-2, jnp.bfloat16, False)],
)
def test_the_default_drift_tolerance_reads_the_dtypes_the_layers_compute_in(off, dtype, refused):
    # As rn.reversible_scan's (tests/invertible/test_reversible.py): 2048 epsilons of the
    # narrowest float a layer computes in, float32 2.4e-4, bfloat16 branches 0.1.
    factor = lambda w: jnp.exp(w["s"].astype(dtype)).astype(jnp.float32)  # noqa: E731
    step = rn.fused_update_step(
        lambda rest, x: x * rest["a"],
        lambda w, h: h * factor(w),
        lambda rest, h, x: jnp.sum(jnp.sin(h)),
        optax.sgd(0.1),
        inverse_fn=lambda w, y: y / factor(w) * (1 + off),  # off by `off` of its norm
    )
    params = ({"s": jnp.full((1,), 0.3)}, {"a": jnp.ones(())})  # depth 1: off is the drift
    x = jax.random.normal(jax.random.key(0), (8, 16))
    run = lambda: jax.block_until_ready(jax.jit(step)(params, optax.sgd(0.1).init(params), x))  # noqa: E731
    if not refused:
        run()
        return
    with pytest.raises(jax.errors.JaxRuntimeError, match="drift_rtol=0.000244141"):
        run()


def test_reversible_stack_temp_does_not_grow_with_depth():
    """Saved inputs cost one activation per layer; rebuilt inputs cost nothing per layer."""
    tx = optax.adam(1e-3)
    temp = {}
    for rebuilt in ("saved", *sorted(REBUILT)):
        for length in (4, 32):
            params, x = make_reversible(jnp.float32, length=length, width=64, batch=512)
            kw = {} if rebuilt == "saved" else {rebuilt: REBUILT[rebuilt]}
            step = rn.fused_update_step(split_embed, coupling, merged_head, tx, **kw)
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), x)
            temp[rebuilt, length] = compiled.compile().memory_analysis().temp_size_in_bytes
    h_bytes = 512 * 64 * 4  # one layer's input (both halves)
    print(f"temp by (inputs, depth): {temp}; one layer's input {h_bytes} B")
    assert temp["saved", 32] - temp["saved", 4] >= 28 * h_bytes  # the saved inputs grow
    for rebuilt in REBUILT:
        assert temp[rebuilt, 32] - temp[rebuilt, 4] < h_bytes / 4


def test_inverse_and_fused_backward_are_exclusive():
    with pytest.raises(ValueError, match="inverse_fn or backward_fn, not both"):
        rn.fused_update_step(split_embed, coupling, merged_head, optax.sgd(1e-2), **REBUILT)


# --- save_every: inputs saved every k layers, a segment's recomputed in the backward -------------


@pytest.mark.parametrize(("length", "k"), [(6, 4), (7, 3), (6, 1), (6, 10), (8, 2)])
def test_save_every_equals_two_phase_step_float64(length, k):
    # Segments [0, k), [k, 2k), ..., the last one shorter when k does not divide the length.
    tx = optax.adam(1e-2)
    with jax.enable_x64(True):
        params, x = make(jnp.float64, length=length)
        fused = rn.fused_update_step(embed, layer, head, tx, save_every=k)
        got = run(fused, params, tx.init(params), x, 5)
        want = run(two_phase(tx), params, tx.init(params), x, 5)
    err = float(rn.relative_error(got, want))
    print(f"length {length}, save_every={k}: 5 float64 steps, rel err {err:.3g}")
    assert err <= 1e-6


def test_save_every_holds_a_segments_inputs_and_the_saved_ones():
    """Layer inputs held: ceil(L / k) saved + k recomputed, instead of L."""
    tx = optax.adam(1e-3)
    params, x = make(jnp.float32, length=32, width=64, batch=512)
    temp = {}
    for k in (None, 4, 8):
        step = jax.jit(
            rn.fused_update_step(embed, layer, head, tx, save_every=k), donate_argnums=(0, 1)
        )
        compiled = step.lower(params, tx.init(params), x).compile()
        temp[k] = compiled.memory_analysis().temp_size_in_bytes
    h_bytes = 512 * 64 * 4
    print(f"temp by save_every: {temp}; one layer's input {h_bytes} B")
    assert temp[None] - temp[4] >= (32 - 12) * h_bytes * 0.95  # 8 + 4 inputs instead of 32
    assert abs(temp[8] - temp[4]) < h_bytes / 4  # 4 + 8: as many


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"save_every": 0}, "save_every must be a positive int"),
        ({"save_every": True}, "save_every must be a positive int"),
        ({"save_every": 2, "inverse_fn": uncoupling}, "rebuilds its inputs and saves none"),
    ],
)
def test_save_every_bad_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rn.fused_update_step(embed, layer, head, optax.sgd(1e-2), **kwargs)


# --- under shard_map and vmap ---------------------------------------------------------------------


@pytest.mark.parametrize("form", ["saved", "save_every", "backward_fn"])
def test_under_shard_map_equals_the_unsharded_step(form):
    # Data parallel over 4 devices: parameters and optimizer state replicated (unvarying), the
    # batch split; the loss is the mean over all devices (pmean). The per-layer gradient must be
    # reduced over the axis before the layer's update, and the scans' carries (the segment
    # buffers included) must keep their manual-axis types.
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((4,), ("data",))
    if form == "backward_fn":
        (e, f, h), (params, x) = (
            (split_embed, coupling, merged_head),
            make_reversible(jnp.float32, batch=8),
        )
        kw = {"backward_fn": coupling_backward}
    else:
        (e, f, h), (params, x) = (embed, layer, head), make(jnp.float32, batch=8)
        kw = {"save_every": 4} if form == "save_every" else {}

    def local_head(rest, hh, xx):
        return jax.lax.pmean(h(rest, hh, xx), "data")

    sharded = jax.shard_map(
        rn.fused_update_step(e, f, local_head, tx, **kw),
        mesh=mesh,
        in_specs=(P(), P(), P("data")),
        out_specs=(P(), P(), P()),
    )
    put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
    got = run(sharded, put(params, P()), put(tx.init(params), P()), put(x, P("data")), 3)
    want = run(rn.fused_update_step(e, f, h, tx, **kw), params, tx.init(params), x, 3)
    err = float(rn.relative_error(got, want))
    print(f"{form}: shard_map over 4 devices vs one, 3 steps: rel err {err:.3g}")
    assert err <= 1e-5


def test_under_vmap_equals_each_model_on_its_own():
    # Two independent models (parameters, optimizer states and batches stacked on a new axis).
    tx = optax.adam(1e-2)
    (p0, x0), (p1, x1) = make(jnp.float32, batch=4), make(jnp.float32, batch=4)
    p1 = jax.tree.map(lambda a: a * 0.5, p1)
    step = rn.fused_update_step(embed, layer, head, tx, save_every=4)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), (p0, x0), (p1, x1 + 1.0))
    params, x = stacked
    got = run(jax.vmap(step), params, jax.vmap(tx.init)(params), x, 3)
    for i, (p, xx) in enumerate(((p0, x0), (p1, x1 + 1.0))):
        want = run(step, p, tx.init(p), xx, 3)
        err = float(rn.relative_error(jax.tree.map(lambda a, i=i: a[i], got), want))
        print(f"model {i}: vmapped vs alone, 3 steps: rel err {err:.3g}")
        assert err <= 1e-6


# --- clip_norm: the global-norm clip by a second backward pass ------------------------------------


@pytest.mark.parametrize("form", ["saved", "save_every", "backward_fn"])
@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipping active (norms 0.6-6), inactive
def test_clip_norm_equals_clip_by_global_norm_in_the_two_phase_step(max_norm, form):
    with jax.enable_x64(True):
        tx = optax.adam(1e-2)
        clipped = optax.chain(optax.clip_by_global_norm(max_norm), tx)
        if form == "backward_fn":
            fns, (params, x) = (split_embed, coupling, merged_head), make_reversible(jnp.float64)
            loss, kw = reversible_loss, {"backward_fn": coupling_backward}
        else:
            fns, (params, x) = (embed, layer, head), make(jnp.float64)
            loss, kw = loss_fn, ({"save_every": 4} if form == "save_every" else {})
        fused = jax.jit(rn.fused_update_step(*fns, tx, clip_norm=max_norm, norms=True, **kw))

        @jax.jit
        def two_phase_clipped(params, opt_state, x):
            _, grads = jax.value_and_grad(loss)(params, x)
            updates, opt_state = clipped.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

        (p1, s1), (p2, s2) = (params, tx.init(params)), (params, clipped.init(params))
        norms_seen = []
        for _ in range(10):
            p1, s1, _, norms = fused(p1, s1, x)
            p2, s2, g_norm = two_phase_clipped(p2, s2, x)
            norms_seen.append(float(g_norm))
            assert abs(float(norms["grad_norm"]) - float(g_norm)) <= 1e-6 * float(g_norm)
        err = float(rn.relative_error((p1, s1), (p2, s2[1])))  # s2: (clip's empty state, adam's)
    print(
        f"clip_norm={max_norm}, {form}: gradient norms {min(norms_seen):.3g}-"
        f"{max(norms_seen):.3g}; 10 float64 steps, rel err {err:.3g}"
    )
    assert err <= 1e-6
    assert (max(norms_seen) > max_norm) == (max_norm < 1)  # the clip acts when it should


def test_clip_norm_bad_values_are_refused():
    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="clip_norm must be a positive finite number"):
            rn.fused_update_step(embed, layer, head, optax.sgd(1e-2), clip_norm=bad)
