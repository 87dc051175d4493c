"""models.resnet.stage_stacks: a ResNet with scan_units as stem, stages of unit stacks and head.

Composed, the parts equal ``module.apply(..., train=True, mutable=["batch_stats"])`` (logits and
new batch statistics); the fused step over them (``rn.fused_update_stages``) equals the
two-phase step (``jax.grad`` through ``module.apply``, then ``optimizer.update``) on a tiny
float64 ResNet-32: parameters, optimizer state and batch statistics after 3 steps. Layouts
without stacks are refused, naming the option.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import remat_nn as rn
from models.resnet import ARCHS, ResNet, stage_stacks

B, HW, CLASSES, STEPS = 4, 8, 3, 3


def rel_err(got, want):
    """max|a - b| / max|b| per leaf, in float64 (``rn.relative_error`` compares in float32)."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.max(np.abs(b), initial=0.0)
        diff = np.max(np.abs(a - b), initial=0.0)
        worst = max(worst, float(diff / scale if scale else diff))
    return worst


def make(**kwargs):
    """A float64 ResNet-32 at a quarter width with scanned units, its variables and a batch
    (call under x64)."""
    m = ResNet(
        ARCHS["resnet32"].scaled(0.25),
        num_classes=CLASSES,
        dtype=jnp.float64,
        scan_units=True,
        **kwargs,
    )
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (B, HW, HW, 3), jnp.float64)
    y = jax.random.randint(k[1], (B,), 0, CLASSES)
    v = jax.tree.map(lambda a: a.astype(jnp.float64), m.init(k[2], x))
    return m, v, {"x": x, "y": y}


def xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def two_phase(m, tx):
    def loss_fn(params, stats, batch):
        logits, new = m.apply(
            {"params": params, "batch_stats": stats},
            batch["x"],
            train=True,
            mutable=["batch_stats"],
        )
        return xent(logits, batch["y"]), new["batch_stats"]

    def step(params, opt_state, stats, batch):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats, loss

    return step


def fused(m, tx):
    parts = stage_stacks(m)

    def head(rest, stats, h, batch):
        logits, stats = parts.head(rest, stats, h)
        return xent(logits, batch["y"]), stats

    return rn.fused_update_stages(
        lambda rest, stats, batch: parts.embed(rest, stats, batch["x"]), parts.stages, head, tx
    )


def run(step, v, tx, batch):
    step = jax.jit(step)
    params, opt_state, stats = v["params"], tx.init(v["params"]), v["batch_stats"]
    for _ in range(STEPS):
        params, opt_state, stats, loss = step(params, opt_state, stats, batch)
    return params, opt_state, stats, loss


def test_composed_parts_equal_module_apply_float64():
    with jax.enable_x64(True):
        m, v, batch = make()
        parts = stage_stacks(m)
        keys = [s.key for s in parts.stages]
        rest = {k: p for k, p in v["params"].items() if k not in keys}
        h, stats = parts.embed(rest, v["batch_stats"], batch["x"])
        new = {}
        for s in parts.stages:
            if s.before is not None:
                h, stats = s.before(rest, stats, h)
            layers = (v["params"][s.key], v["batch_stats"][s.key])
            h, new[s.key] = jax.lax.scan(lambda h, pc, s=s: s.layer(*pc, h), h, layers)
        logits, stats = parts.head(rest, stats, h)
        want, want_stats = m.apply(v, batch["x"], train=True, mutable=["batch_stats"])
        errs = rel_err(logits, want), rel_err({**stats, **new}, want_stats["batch_stats"])
    assert jax.tree.structure({**stats, **new}) == jax.tree.structure(want_stats["batch_stats"])
    assert max(errs) <= 1e-12, errs


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        # every unit recomputed in the backward (the first units by rn.checkpoint)
        ("adamw", {"remat": rn.plan({"default": "recompute"})}),
        # no remat: the first units' activations stored, the stacked units' inputs saved
        ("sgd_momentum", {}),
    ],
    ids=["adamw-remat_full", "sgd_momentum-no_remat"],
)
def test_fused_step_equals_two_phase_step_float64(name, kwargs):
    tx = {
        "sgd_momentum": optax.sgd(0.1, momentum=0.9),
        "adamw": optax.adamw(1e-2, weight_decay=5e-4),
    }[name]
    with jax.enable_x64(True):
        m, v, batch = make(**kwargs)
        got = run(fused(m, tx), v, tx, batch)
        want = run(two_phase(m, tx), v, tx, batch)
        errs = [rel_err(a, b) for a, b in zip(got, want, strict=True)]
    shown = ", ".join(f"{e:.2g}" for e in errs)
    print(f"resnet32/4 {name} {kwargs}: params/opt_state/batch_stats/loss rel err {shown}")
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert max(errs) <= 1e-6


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"scan_units": False}, "scan_units=false"),
        ({"scan_units": True, "scan_levels": 2}, "scan_levels=2"),
    ],
)
def test_layouts_without_stacks_are_refused_naming_the_option(kwargs, named):
    m = ResNet(ARCHS["resnet32"], **kwargs)
    with pytest.raises(ValueError, match=named) as e:
        stage_stacks(m)
    assert "Fix: model.options.scan_units=true" in str(e.value)
