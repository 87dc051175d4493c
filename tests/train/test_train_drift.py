"""The train step's drift report: a reversible model's checks reach the step's metrics.

The step traces the loss under ``rn.report_drift_to``: a stack whose check fails, or whose
layers were recomputed, says so in the step's metrics (``drift_failed``, ``drift_recomputed``)
instead of through a host callback, so the step holds none and JAX's persistent compilation
cache keeps it (a second run or a resume does not compile it again). The loop refuses a
failed check when it reads the metrics, before anything is saved.
"""

from __future__ import annotations

import os

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import remat_nn as rn
from remat_nn import nn
from tests.gradients import counts_agree
from tests.trainer_cli import ROOT, shared_compilation_cache
from train import loop
from train import state as state_lib
from train.config import load_config
from train.errors import DriftError

X = jax.random.normal(jax.random.key(1), (64, 32))
Y = jnp.arange(64) % 10


class GrowingNet(fnn.Module):
    """A classifier around the docs' growing stack (unnormalized linear couplings: a rebuilt
    input drifts more the deeper it is)."""

    fallback: str = "error"
    drift_rtol: float | None = None
    reversible: bool = True

    @fnn.compact
    def __call__(self, x, train: bool = False):
        coupling = nn.AdditiveCoupling(fnn.Dense(16), fnn.Dense(16))
        kw = dict(fallback=self.fallback, drift_rtol=self.drift_rtol, reversible=self.reversible)
        h = nn.ReversibleSequence(coupling, depth=24, **kw)(x)
        return fnn.Dense(10)(h)


def _step(model: fnn.Module):
    tx = optax.sgd(1e-3)
    state = jax.jit(state_lib.make_init(model, tx, X, seed=0))()
    schedule = optax.constant_schedule(1e-3)
    step = state_lib.make_train_step(model, tx, schedule, has_batch_stats=False)
    return jax.jit(step), state


def _host_recomputes(model: fnn.Module, params) -> int:
    """Layers the host callbacks count for the step's gradient (outside the step)."""

    def loss(p):
        logits = model.apply({"params": p}, X, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

    rn.drift_recomputes(reset=True)
    jax.block_until_ready(jax.jit(jax.grad(loss))(params))
    return sum(rn.drift_recomputes().values())


@pytest.mark.parametrize("fallback", ["error", "recompute", "none", "plain"])
def test_the_step_reports_its_stacks_drift_in_its_metrics(fallback):
    if fallback == "plain":
        model = GrowingNet(reversible=False)
    else:
        model = GrowingNet(fallback=fallback, drift_rtol=2.4e-5 if fallback != "error" else None)
    step, state = _step(model)
    text = step.lower(state, {"x": X, "y": Y}).as_text()
    assert "callback" not in text  # so JAX's persistent cache can keep it
    new, metrics = step(state, {"x": X, "y": Y})
    reported = {k: float(metrics[k]) for k in rn.DRIFT_REPORT_FIELDS if k in metrics}
    print(fallback, reported)
    if fallback == "plain":  # no checked stack: no drift metrics
        assert reported == {}
        return
    assert set(reported) == set(rn.DRIFT_REPORT_FIELDS)
    assert reported["drift_failed"] == (1.0 if fallback == "error" else 0.0)
    if fallback == "recompute":
        want = _host_recomputes(model, state.params)
        assert want > 0 and counts_agree(reported["drift_recomputed"], want)
    else:
        assert reported["drift_recomputed"] == 0.0
    assert int(new.step) == 1


def test_grad_accum_reports_the_counts_of_every_micro_batch():
    model = GrowingNet(fallback="error")
    tx = optax.sgd(1e-3)
    state = jax.jit(state_lib.make_init(model, tx, X, seed=0))()
    step = state_lib.make_train_step(
        model, tx, optax.constant_schedule(1e-3), has_batch_stats=False, grad_accum=2
    )
    _, metrics = jax.jit(step)(state, {"x": X, "y": Y})
    assert float(metrics["drift_failed"]) == 2.0  # one failed stack per micro-batch


def _metrics(**kw) -> dict[str, np.ndarray]:
    base = {"loss": 1.0, "grad_norm": 1.0, "lr": 0.1, "finite": True}
    return {k: np.asarray(v) for k, v in {**base, **kw}.items()}


def test_the_loop_halts_on_a_failed_check_naming_the_step_and_counts_recomputes():
    metrics = loop._StepMetrics(halt=False, max_consecutive_skips=10)
    metrics.pending = [_metrics(drift_failed=0.0, drift_recomputed=3.0), _metrics()]
    metrics.drain(11, last_good="step 10")
    assert metrics.recomputed == 3 and len(metrics.window) == 2
    metrics.pending = [_metrics(drift_failed=0.0, drift_recomputed=1.0)] * 2
    metrics.pending.append(_metrics(drift_failed=1.0, drift_recomputed=0.0))
    with pytest.raises(DriftError) as e:
        metrics.drain(14, last_good="step 10")
    text = str(e.value)
    assert text.startswith("step 14: 1 drift check(s) failed")
    assert "last good checkpoint is step 10" in text and "drift_fallback=recompute" in text
    assert DriftError.exit_code == 3


def test_a_revnet_run_stores_its_step_in_the_compilation_cache(tmp_path):
    # configs/revnet.yaml at a quarter width, 2 steps: the step (reversible stages with the
    # default drift check) is written to the persistent cache, as the init and eval steps are.
    cache = tmp_path / "cache"
    cfg = load_config(
        ROOT / "configs/revnet.yaml",
        [
            f"run_dir={tmp_path / 'run'}",
            "model.options.width=0.25",
            "data.batch_size=16",
            "train.steps=2",
            "train.plot=false",
            "train.tensorboard=false",
            "train.eval_every=0",
            "checkpoint.keep_best=0",
            "train.compile_cache=null",
        ],
    )
    with shared_compilation_cache(str(cache)):
        result = loop.run(cfg)
    assert result.step == 2
    entries = sorted(os.listdir(cache))
    assert any(e.startswith("jit_step-") for e in entries), entries
