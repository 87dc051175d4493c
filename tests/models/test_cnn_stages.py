"""models.revnet.stage_stacks, models.resnet.stage_stacks and models.nnx_revnet.stage_stacks: a
RevNet, a ResNet with scan_units and the Flax NNX RevNet (through nnx.bridge.to_linen), as stem,
stages of stacks (couplings, or scanned units) and head.

Composed, the parts equal ``module.apply(..., train=True, mutable=["batch_stats"])`` (logits and
new batch statistics); the fused step over them (``rn.fused_update_stages``) equals the
two-phase step (``jax.grad`` through ``module.apply``, then ``optimizer.update``) on a tiny
float64 RevNet-38, ResNet-32 (also with ``scan_levels: 2``, which the fused step runs as each
stage's ``save_every``) and NNX RevNet: parameters, optimizer state and batch statistics after
3 steps. ResNet layouts without stacks are refused, naming the option.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import remat_nn as rn
from models import nnx_revnet, resnet, revnet
from tests.gradients import rel_err

B, HW, CLASSES, STEPS = 4, 8, 3, 3

#: Each family at a quarter width, as a float64 module of the given options.
FAMILIES = {
    "revnet": (
        revnet,
        lambda **kw: revnet.RevNet(
            revnet.ARCHS["revnet38"].scaled(0.25),
            num_classes=CLASSES,
            dtype=jnp.float64,
            recon_dtype=jnp.float64,
            **kw,
        ),
    ),
    "resnet": (
        resnet,
        lambda **kw: resnet.ResNet(
            resnet.ARCHS["resnet32"].scaled(0.25),
            num_classes=CLASSES,
            dtype=jnp.float64,
            scan_units=True,
            **kw,
        ),
    ),
    # width 4, two couplings per stage: stage 2 (8 channels) after the downsampling unit
    "nnx_revnet": (
        nnx_revnet,
        lambda **kw: nnx_revnet.build(
            width=4, depth=2, num_classes=CLASSES, in_channels=3, dtype="float64", **kw
        ),
    ),
}

#: ``rn.relative_error``'s ``floor`` per family: the NNX RevNet's convolutions have biases
#: (nnx.Conv's default; the linen models' have none), and those a training-mode BatchNorm
#: follows (the downsampling unit's, the last stage's couplings' before the head's norm) have
#: an exact gradient of 0: they hold round-off only, which the two steps sum in other orders.
FLOOR = {"nnx_revnet": 1e-2}


def make(family, **kwargs):
    """A float64 module of ``family``, its variables and a batch (call under x64)."""
    m = FAMILIES[family][1](**kwargs)
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


def fused(family, m, tx):
    parts = FAMILIES[family][0].stage_stacks(m)

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


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [("revnet", {}), ("resnet", {}), ("resnet", {"scan_levels": 2})],
    ids=["revnet", "resnet", "resnet-scan_levels_2"],
)
def test_composed_parts_equal_module_apply_float64(family, kwargs):
    with jax.enable_x64(True):
        m, v, batch = make(family, **kwargs)
        parts = FAMILIES[family][0].stage_stacks(m)
        logits, stats = parts.apply(v["params"], v["batch_stats"], batch["x"])
        want, want_stats = m.apply(v, batch["x"], train=True, mutable=["batch_stats"])
        errs = rel_err(logits, want), rel_err(stats, want_stats["batch_stats"])
    assert jax.tree.structure(stats) == jax.tree.structure(want_stats["batch_stats"])
    assert max(errs) <= 1e-12, errs


@pytest.mark.parametrize(
    ("family", "name", "kwargs"),
    [
        # the downsampling units recomputed, the couplings rebuilt from their outputs
        ("revnet", "adamw", {"remat": rn.plan({"default": "recompute"})}),
        # the downsampling units stored, the couplings' inputs saved (plain autodiff's network)
        ("revnet", "sgd_nesterov", {"reversible": False}),
        # every unit recomputed in the backward (the first units by rn.checkpoint)
        ("resnet", "adamw", {"remat": rn.plan({"default": "recompute"})}),
        # no remat: the first units' activations stored, the stacked units' inputs saved
        ("resnet", "sgd_momentum", {}),
        # the nested scan: the inputs of every k-th stacked unit saved (k = 3, 2, 2 for the
        # stacks of 5, 4, 4 units), a segment's recomputed with the statistics the forward saw
        ("resnet", "sgd_momentum", {"scan_levels": 2}),
        # the downsampling unit recomputed (the registry's default), the couplings rebuilt
        ("nnx_revnet", "adamw", {"remat": "full"}),
        # the downsampling unit stored, the couplings' inputs saved
        ("nnx_revnet", "sgd_nesterov", {"reversible": False, "remat": "none"}),
    ],
    ids=[
        "revnet-adamw-remat_full",
        "revnet-sgd_nesterov-reversible_false",
        "resnet-adamw-remat_full",
        "resnet-sgd_momentum-no_remat",
        "resnet-sgd_momentum-scan_levels_2",
        "nnx_revnet-adamw-remat_full",
        "nnx_revnet-sgd_nesterov-reversible_false",
    ],
)
def test_fused_step_equals_two_phase_step_float64(family, name, kwargs):
    tx = {
        "sgd_nesterov": optax.sgd(0.1, momentum=0.9, nesterov=True),
        "sgd_momentum": optax.sgd(0.1, momentum=0.9),
        "adamw": optax.adamw(1e-2, weight_decay=5e-4),
    }[name]
    with jax.enable_x64(True):
        m, v, batch = make(family, **kwargs)
        if family != "resnet":  # a reversible stack rebuilds its layers' inputs, else saves them
            stages = FAMILIES[family][0].stage_stacks(m).stages
            assert {s.backward is not None for s in stages} == {kwargs.get("reversible", True)}
        got = run(fused(family, m, tx), v, tx, batch)
        want = run(two_phase(m, tx), v, tx, batch)
        floor = FLOOR.get(family, 0.0)
        errs = [rel_err(a, b, floor=floor) for a, b in zip(got, want, strict=True)]
    shown = ", ".join(f"{e:.2g}" for e in errs)
    print(f"{family}/4 {name} {kwargs}: params/opt_state/batch_stats/loss rel err {shown}")
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert max(errs) <= 1e-6


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"scan_units": False}, "scan_units=false"),
        ({"scan_units": True, "scan_levels": 3}, r"scan_levels=3 \(the fused step nests two"),
    ],
)
def test_resnet_layouts_without_stacks_are_refused_naming_the_option(kwargs, named):
    m = resnet.ResNet(resnet.ARCHS["resnet32"], **kwargs)
    with pytest.raises(ValueError, match=named) as e:
        resnet.stage_stacks(m)
    assert "Fix: model.options.scan_units=true" in str(e.value)


@pytest.mark.parametrize(
    ("name", "levels", "save_every"),
    [
        ("resnet32", None, [None] * 3),
        ("resnet32", 1, [None] * 3),  # one checkpointed scan: every unit's input saved
        ("resnet32", 2, [3, 2, 2]),  # stacks of 5, 4, 4 units: lengths (2, 3), (2, 2), (2, 2)
        ("resnet110", 2, [6, 6, 6]),  # stacks of 18, 17, 17: (3, 6), (3, 6), (3, 6)
    ],
)
def test_resnet_scan_levels_map_to_each_stages_save_every(name, levels, save_every):
    # scan_levels=2's nesting as the fused step runs it: the input of every k-th unit of a
    # stage saved, k the inner length rn.remat_scan_lengths gives the stage's nested scan.
    m = resnet.ResNet(resnet.ARCHS[name], scan_units=True, scan_levels=levels)
    assert [s.save_every for s in resnet.stage_stacks(m).stages] == save_every


def test_nnx_revnet_stage_stacks_refuses_another_module_naming_the_fix():
    with pytest.raises(TypeError, match=r"must be the model nnx_revnet.build returns.*Fix"):
        nnx_revnet.stage_stacks(FAMILIES["revnet"][1]())
