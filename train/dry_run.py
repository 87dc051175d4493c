"""``python -m train --dry-run``: what a run would train, printed before it trains.

Parameters per module, which of them get weight decay, the dtypes the gradient's matmuls read
(so ``train.compute_dtype=bfloat16`` is seen to take effect), the remat plan's saved residuals,
XLA's compiled memory of the donated train step, the largest buffers live at its peak and the
memory timeline (``RUN_DIR/memory_timeline.png`` and ``.json``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from models.summary import count_params
from train import sharding as sharding_lib
from train import state as state_lib
from train.experiment import Experiment

__all__ = ["dry_run_report"]


def dry_run_report(exp: Experiment) -> None:
    """Prints what a run would train, before it does: parameters, weight decay, matmul dtypes,
    the remat plan's residuals and XLA's compiled memory of the step."""
    import remat_nn as rn
    from train.dtypes import matmul_operand_dtypes

    say, cfg = exp.say, exp.cfg
    # Shapes only: nothing here reads a parameter's value, so none is made (no init compile,
    # no memory taken). BatchNorm statistics are arrays, as the loss closes over them.
    state = exp.abstract
    batch_stats = jax.tree.map(
        lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), state.batch_stats
    )
    say("parameters:")
    for path, n in _param_groups(state.params):
        say(f"  {path:<40} {n:>12,}")
    say(f"  {'total':<40} {count_params(state.params):>12,}")
    if cfg.optim.weight_decay:
        say(state_lib.decay_summary(state.params, cfg.optim.decay_exclude))
    else:
        say("weight decay: off (optim.weight_decay=0)")
    n_train = exp.dataset.num_examples("train")
    batch = sharding_lib.global_batch(
        exp.dataset.examples(np.arange(exp.global_batch) % n_train), exp.batch_sharding
    )
    # The loss's own reports see what one backward pass holds: one micro-batch (train.grad_accum).
    micro_bs = exp.global_batch // cfg.train.grad_accum
    micro = sharding_lib.global_batch(
        exp.dataset.examples(np.arange(micro_bs) % n_train), exp.batch_sharding
    )
    loss_fn = state_lib.make_loss_fn(
        exp.model,
        compute_dtype=exp.compute_dtype,
        has_batch_stats=exp.has_batch_stats,
        loss=exp.loss,
    )
    key = jax.random.key(0)

    def loss_of_params(params):
        return loss_fn(params, batch_stats, micro, key)[0]

    counts = matmul_operand_dtypes(jax.grad(loss_of_params), state.params)
    say("matmul operand dtypes: {" + ", ".join(f"{k}: {v}" for k, v in counts.items()) + "}")
    say("memory report (residuals saved for the backward pass):")
    say(str(rn.memory_report(loss_of_params, state.params)))
    k = cfg.train.grad_accum
    accum = f", {k} micro-batches of {micro_bs}" if k > 1 else ""
    if exp.step_fn.__module__ == "train.fused":  # said of the step compiled, not of the config
        accum += ", optimizer update inside the backward: train.update_in_backward"
    say(f"XLA compiled memory of the train step (per device, state donated{accum}):")
    _peak_report(exp, _abstract(batch))


def _peak_report(exp: Experiment, batch: Any) -> None:
    """XLA's memory analysis of the step, the buffers at its peak and the timeline; a report
    that fails stops no run: the totals are printed, and why."""
    import remat_nn as rn

    say = exp.say
    # One compile, with XLA's dump: its memory analysis and the buffers at its peak.
    args = (exp.step_fn, exp.abstract, batch)
    try:
        peak = rn.explain_peak(*args, jit_kwargs=exp.jit_kwargs)
    except Exception as e:
        say(str(rn.compiled_memory(*args, jit_kwargs=exp.jit_kwargs)))
        say(f"(no buffers at the peak: rn.explain_peak failed: {type(e).__name__}: {e})")
        return
    say(str(peak.compiled))
    say(f"largest buffers at XLA's peak (rn.explain_peak, {peak.difference:+d} B from the peak):")
    say(peak.top(10))
    if not exp.is_main:
        return
    png = exp.run_dir / "memory_timeline.png"
    try:
        data = peak.save_timeline(png, title=str(exp.run_dir))
    except Exception as e:  # e.g. a full disk or no matplotlib: the tables are printed
        say(f"(memory timeline not written to {png}: {type(e).__name__}: {e})")
        return
    say(f"memory timeline: {data.with_suffix('.png')} (data: {data.name})")


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _param_groups(params: Any) -> Iterator[tuple[str, int]]:
    # Parameter counts per top-level module.
    if isinstance(params, dict):
        for k, v in params.items():
            yield str(k), count_params(v)
