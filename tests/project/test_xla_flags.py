"""The suite's XLA flags (``TEST_XLA_FLAGS``: -O0, classic fusion emitters, code generated in
one piece) make compiles cheaper without changing what the suite measures: on the kinds of
program it asserts compiled memory of, the temp bytes stay within 1% of what a process with no
XLA flags compiles. If a new flag or an XLA upgrade makes the two part ways, this fails, and the
suite's memory assertions would no longer speak for a user's default build."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

import models
import remat_nn as rn
from models import revnet as R
from tests.trainer_cli import ROOT, TEST_XLA_FLAGS


def _lm_grad():
    # The planner's kind of program: a scanned transformer's gradient under a per-name plan.
    plan = rn.Plan(save=("mlp_in",), default="recompute")
    module = models.build(
        "transformer", vocab_size=64, d_model=32, n_heads=2, n_layers=2, max_len=32, remat=plan
    )
    tokens = jax.ShapeDtypeStruct((2, 33), jnp.int32)  # (B, T + 1)
    inputs = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    params = jax.eval_shape(module.init, jax.random.key(0), inputs)["params"]

    def loss(params, tokens):
        logits = module.apply({"params": params}, tokens[:, :-1])  # (B, T, V)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    return jax.grad(loss), (params, tokens)


def _revnet_grad():
    # Reversible stages (custom VJP, unrolled convolutions tied to the cotangent) with BatchNorm.
    module = R.RevNet(R.Arch((1, 1, 1), (8, 16, 16), 8, bottleneck=False))
    images = jax.ShapeDtypeStruct((8, 8, 8, 3), jnp.float32)
    variables = jax.eval_shape(module.init, jax.random.key(0), images)

    def loss(params, batch_stats, images):
        variables = {"params": params, "batch_stats": batch_stats}
        logits, _ = module.apply(variables, images, train=True, mutable=["batch_stats"])
        return jnp.mean(logits**2)

    return jax.grad(loss), (variables["params"], variables["batch_stats"], images)


def temps() -> dict[str, int]:
    """Compiled temp bytes of each program, under this process's XLA flags."""
    programs = {"transformer": _lm_grad, "revnet": _revnet_grad}
    out = {}
    for name, program in programs.items():
        fn, args = program()
        out[name] = jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
    return out


def test_compiled_temp_within_one_percent_of_a_process_without_xla_flags():
    assert TEST_XLA_FLAGS in os.environ["XLA_FLAGS"]  # conftest.py: this process has them
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    code = "import json, tests.project.test_xla_flags as t; print(json.dumps(t.temps()))"
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-4000:]
    default = json.loads(child.stdout.splitlines()[-1])
    suite = temps()
    for name, want in default.items():
        assert abs(suite[name] - want) <= 0.01 * want, (name, suite[name], want)
