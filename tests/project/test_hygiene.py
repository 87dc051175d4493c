"""Memory hygiene: remat wrappers, models and jitted train steps built and dropped in a loop are
collected (no cache in remat_nn keeps them alive), and the train state donates cleanly: aliased
leaves are caught before a step, and the trainer's step never leaves a donated buffer unused."""

from __future__ import annotations

import gc
import subprocess
import sys
import warnings
import weakref
from pathlib import Path

import flax.linen as fnn
import jax
import jax.numpy as jnp
import optax
import pytest

import remat_nn as rn
from remat_nn import nn
from train import donation
from train import state as state_lib
from train.errors import DonationError

X = jnp.linspace(-1.0, 1.0, 24).reshape(4, 6)
Y = jnp.array([0, 1, 2, 1], jnp.int32)


class MLP(fnn.Module):
    @fnn.compact
    def __call__(self, x, train: bool = False):
        h = rn.name(jnp.tanh(fnn.Dense(8)(x)), "mlp_hidden")
        return fnn.Dense(3)(rn.name(h * 2.0, "mlp_out"))


class Net(fnn.Module):
    plan: dict

    @fnn.compact
    def __call__(self, x, train: bool = False):
        return nn.remat(MLP, policy=self.plan)()(x)


def _build_and_drop(i: int) -> list[weakref.ref]:
    # One model, remat wrappers (class and function) and a jitted, donated train step.
    plan = {"save": ["mlp_hidden"], "offload": [], "recompute": ["mlp_out"]}
    block_cls = nn.remat(MLP, policy=plan)
    model = Net(plan=plan)
    tx = optax.sgd(0.1)
    init = state_lib.make_init(model, tx, X, seed=i)
    step = state_lib.make_train_step(model, tx, optax.constant_schedule(0.1), has_batch_stats=False)
    jitted = jax.jit(step, donate_argnums=0)
    state = jax.jit(init)()
    state, metrics = jitted(state, {"x": X, "y": Y})
    fn = rn.checkpoint(lambda x: rn.name(jnp.sin(x), "h").sum(), policy="save=h")
    jax.grad(fn)(X)
    assert bool(metrics["finite"])
    return [weakref.ref(o) for o in (block_cls, model, step, jitted, fn)]


def _live_device_bytes() -> int:
    # What a leaked build would hold on to besides Python objects: its device buffers. A count
    # of JAX's own live arrays, exact on any machine (the process RSS also moves with the
    # allocator's pools and XLA's caches, by more than a leak of these small arrays).
    return sum(x.nbytes for x in jax.live_arrays())


def test_wrappers_models_and_steps_are_collected():
    refs = _build_and_drop(0)
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"still referenced after del + gc.collect(): {alive}"


def _build_wrappers_and_drop(i: int) -> list[weakref.ref]:
    # The cheap part of a build, 40 times: remat wrappers with plans, a model init, a jitted grad.
    block_cls = nn.remat(MLP, policy={"save": ["mlp_hidden"], "recompute": ["mlp_out"]})
    block = block_cls()
    variables = block.init(jax.random.key(i), X)
    fn = rn.checkpoint(lambda x: rn.name(jnp.sin(x), "h").sum(), policy="save=h")
    grad = jax.jit(jax.grad(fn))
    grad(X).block_until_ready()
    del variables
    return [weakref.ref(o) for o in (block_cls, block, fn, grad)]


def test_building_in_a_loop_does_not_grow_memory():
    for i in range(5):  # warm-up: jax/flax/XLA one-time state, allocator pools
        _build_wrappers_and_drop(i)
    gc.collect()
    objects, arrays = len(gc.get_objects()), _live_device_bytes()
    refs = []
    for i in range(40):
        refs += _build_wrappers_and_drop(100 + i)
    gc.collect()
    assert all(r() is None for r in refs), "a built function or module outlived its loop"
    grown_objects = len(gc.get_objects()) - objects
    # Each build holds thousands of objects while alive; a leaked build per iteration would
    # add >100k over 40 iterations. A small per-iteration residue in JAX's own caches remains.
    assert grown_objects < 5_000, grown_objects
    assert _live_device_bytes() == arrays, "device arrays outlived their build"


def test_remat_nn_keeps_no_module_level_function_cache():
    # The one cache in remat_nn's modules is the planner's rate measurement (no arguments).
    import remat_nn.planner._measure as planner

    cached = [
        name
        for mod in (rn._checkpoint, rn._plan, rn._policies, nn._remat, rn.names)
        for name, obj in vars(mod).items()
        if hasattr(obj, "cache_info")
    ]
    assert cached == []
    assert planner._measured_rates.__wrapped__.__code__.co_argcount == 0


# --- layers ---------------------------------------------------------------------------------------


def test_core_imports_no_flax():
    # The core (`import remat_nn`, rn.checkpoint included) is pure JAX; `remat_nn.nn` (linen) and
    # `remat_nn.nnx` (NNX) are where flax comes in. In a fresh interpreter: this process has
    # imported flax already.
    code = (
        "import sys, remat_nn\n"
        "loaded = lambda p: sorted(m for m in sys.modules if m == p or m.startswith(p + '.'))\n"
        "assert not loaded('flax') and not loaded('remat_nn.nn') and not loaded('remat_nn.nnx'), "
        "(loaded('flax'), loaded('remat_nn.nn'), loaded('remat_nn.nnx'))\n"
        "import remat_nn as rn, jax.numpy as jnp\n"
        "rn.checkpoint(jnp.sin, policy='dots')(jnp.ones(2))\n"
        "assert not loaded('flax'), loaded('flax')\n"
        "from remat_nn import nn\n"
        "assert loaded('flax') and nn.checkpoint is nn.remat\n"
        "from remat_nn import nnx as rnnx\n"
        "assert rnnx.checkpoint is rnnx.remat\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# --- donation -------------------------------------------------------------------------------------


def _state(model, seed=0):
    tx = optax.adamw(1e-2)
    return model, tx, jax.jit(state_lib.make_init(model, tx, X, seed=seed))()


def test_tied_leaves_are_named_before_the_first_step():
    model, tx, state = _state(MLP())
    params = state.params
    tied = {**params, "Dense_1": {**params["Dense_1"], "bias": params["Dense_0"]["bias"][:3]}}
    tied["Dense_1"]["kernel"] = params["Dense_0"]["kernel"]  # the same array at two leaves
    bad = state._replace(params=tied)
    with pytest.raises(DonationError) as info:
        donation.check_distinct_buffers(bad)
    msg = str(info.value)
    assert ".params['Dense_0']['kernel']" in msg and ".params['Dense_1']['kernel']" in msg
    assert "Fix: share the parameter inside the model" in msg and "jnp.copy" in msg
    # What happens without the check: XLA refuses, naming no leaf.
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    with pytest.raises(Exception, match="donate the same buffer twice"):
        step(bad.params)
    # The fix named in the message: a copy makes the leaves distinct.
    fixed = {**tied, "Dense_1": {**tied["Dense_1"], "kernel": jnp.copy(tied["Dense_1"]["kernel"])}}
    donation.check_distinct_buffers(state._replace(params=fixed))
    donation.check_distinct_buffers(jax.eval_shape(lambda: state))  # abstract: nothing to check


def test_trainer_step_uses_every_donated_buffer():
    # "Some donated buffers were not usable" is an error here (and suite-wide via pyproject).
    model, tx, state = _state(MLP())
    step = state_lib.make_train_step(
        model, tx, optax.constant_schedule(1e-2), has_batch_stats=False
    )
    jitted = jax.jit(step, donate_argnums=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            old = jax.tree_util.tree_leaves_with_path(state)
            state, _ = jitted(state, {"x": X, "y": Y})
            donation.verify_donated_inputs_deleted(old)
    compiled = jitted.lower(state, {"x": X, "y": Y}).compile()
    assert donation.verify_donation(compiled, state) > 0


def test_unusable_donation_is_an_error_in_tests():
    # The negative control: a step whose output cannot reuse its input buffer warns, and the
    # suite's `filterwarnings = error` turns that into a failure.
    bad_step = jax.jit(lambda s: s[:2], donate_argnums=0)
    with pytest.raises(UserWarning, match="Some donated buffers were not usable"):
        bad_step(jnp.ones(3))
