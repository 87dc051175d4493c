"""Your own Flax NNX model (``model.module``): an ``nnx.Module`` class, or a function taking
``rngs``, is trained through ``flax.nnx.bridge.to_linen`` (#46).

The model here has what makes NNX state awkward to carry: BatchNorm averages (the bridge's
``batch_stats``), dropout (the step's ``dropout`` key reaches ``nnx.Rngs``) and a block under
``rnnx.remat`` with a named activation, so the config's ``remat:`` reaches it and a misspelled
plan name is refused as for linen models. A builder returning an ``nnx.Module`` it built with its
own keys is refused with the fix (the trainer's seed would not reach its parameters).
"""

from __future__ import annotations

import textwrap

import pytest

import models
from tests.trainer_cli import run_in_process

MODEL = textwrap.dedent(
    """
    import jax
    from flax import nnx

    import remat_nn as rn
    from remat_nn import nnx as rnnx


    class Block(nnx.Module):
        def __init__(self, width, *, rngs):
            self.dense = nnx.Linear(width, width, rngs=rngs)
            self.bn = nnx.BatchNorm(width, rngs=rngs)

        def __call__(self, x, train):
            h = rn.name(self.dense(x), "block_hidden")
            return x + jax.nn.relu(self.bn(h, use_running_average=not train))


    class Net(nnx.Module):
        def __init__(self, num_classes, width=16, remat="none", *, rngs):
            self.stem = nnx.Linear(64, width, rngs=rngs)
            self.block = rnnx.remat(Block, policy=remat, static_argnums=(2,))(width, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.head = nnx.Linear(width, num_classes, rngs=rngs)

        def __call__(self, x, train: bool = False):
            h = self.stem(x.reshape(x.shape[0], -1))  # digits: (B, 8, 8, 1) -> (B, 64)
            h = self.drop(self.block(h, train), deterministic=not train)
            return self.head(h)


    def build(num_classes, width=16, remat="none", *, rngs):
        return Net(num_classes, width, remat=remat, rngs=rngs)


    def own_keys(num_classes):
        return Net(num_classes, rngs=nnx.Rngs(0))
    """
)


@pytest.fixture
def base(user_model):
    return user_model("nnx_model", MODEL)


@pytest.mark.parametrize("ref", ["nnx_model:Net", "nnx_model:build"])
def test_an_nnx_class_or_builder_trains_and_resumes(base, ref):
    spec = models.from_module(ref)
    assert set(spec.options.model_fields) == {"num_classes", "width", "remat"}  # not rngs
    code, out = run_in_process([f"model.module={ref}", *base, "remat=full"])
    assert code == 0 and "step      2/2" in out and "remat plan: full" in out, out
    # Resumed without remat: the bridge's state tree is the same whatever remat is.
    more = ["train.steps=4", "optim.schedule_steps=2", "--allow-config-change"]
    code, out = run_in_process([f"model.module={ref}", *base, "remat=none", *more])
    assert code == 0 and "resumed from" in out and "step      4/4" in out, out


def test_the_remat_plan_reaches_the_nnx_block_and_is_checked(base):
    module = "model.module=nnx_model:build"
    code, out = run_in_process([module, *base, "remat={save: [block_hidden]}", "--dry-run"])
    assert code == 0 and "block_hidden" in out, out
    code, out = run_in_process([module, *base, "remat={save: [block_hiden]}", "--dry-run"])
    assert code == 2 and "plan names ['block_hiden'] never occur" in out, out
    assert "Traceback" not in out, out


def test_a_builder_that_makes_its_own_keys_is_refused_with_the_fix(base):
    code, out = run_in_process(["model.module=nnx_model:own_keys", *base])
    assert code == 2 and "returned a flax.nnx.Module (Net) built without" in out, out
    assert "give own_keys a parameter `rngs`" in out and "Traceback" not in out, out
