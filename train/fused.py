"""``train.update_in_backward``: the train step with the optimizer update inside the backward.

For a model whose blocks are one stack (``models.ModelSpec.layer_stack``), the step is
:func:`remat_nn.fused_update_step`; for stages of stacks with BatchNorm (``stage_stacks``: the
RevNets, linen and NNX, and the ResNets with ``scan_units``),
:func:`remat_nn.fused_update_stages`. Each block's slice of the parameters and
optimizer state is updated as soon as its gradient is known, so the full gradient never exists.
The train state is the same pytree as the two-phase step's (:func:`train.state.make_train_step`),
so checkpoints of either step resume with the other. :func:`refusal` lists the options it
cannot run with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

import models
import remat_nn as rn
from train import losses as losses_lib
from train.config import Config
from train.errors import SetupError
from train.state import STEP_METRICS, TrainState, cast_floats

__all__ = ["make_fused_train_step", "refusal", "train_step"]

_OPTION = "train.update_in_backward=true"


def refusal(cfg: Config, spec: models.ModelSpec, model: Any) -> str | None:
    """Why ``cfg`` cannot update inside the backward (None: it can), naming the options."""
    why = []
    if cfg.train.grad_accum > 1:
        why.append(
            f"train.grad_accum={cfg.train.grad_accum} sums a full gradient over micro-batches, "
            "which is what the fused step removes (set train.grad_accum=1)"
        )
    if cfg.train.on_nonfinite == "skip":
        why.append(
            "train.on_nonfinite=skip would undo an update, but a layer's update is written "
            "before the later layers' gradients are known (use train.on_nonfinite=halt)"
        )
    if spec.layer_stack is None and spec.stage_stacks is None:
        why.append(f"model {cfg.model.label!r} has no layer stack (a scan of layers)")
    else:
        try:
            _parts(spec, model)
        except ValueError as e:
            why.append(str(e))
    if not why:
        return None
    return (
        f"{_OPTION} (the optimizer update inside the backward pass) cannot run with this "
        "config:\n  - " + "\n  - ".join(why) + "\nFix: the changes above, or "
        "train.update_in_backward=false (the two-phase step)."
    )


def train_step(
    cfg: Config,
    spec: models.ModelSpec,
    model: Any,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    compute_dtype: Any,
    loss: losses_lib.LossFn,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """The run's fused step, or :class:`SetupError` with every reason it cannot be used.

    ``tx`` is the optimizer without ``optim.clip_norm``'s clip (``make_optimizer(...,
    clip=False)``): the fused step clips by the global norm itself, by a second backward pass.
    """
    why = refusal(cfg, spec, model)
    if why is not None:
        raise SetupError(why)
    return make_fused_train_step(
        _parts(spec, model),
        tx,
        schedule,
        compute_dtype=compute_dtype,
        loss=loss,
        clip_norm=cfg.optim.clip_norm,
    )


def _parts(spec: models.ModelSpec, model: Any) -> models.LayerStack | models.StageStacks:
    """The model's stack (``layer_stack``) or stages of stacks (``stage_stacks``)."""
    if spec.layer_stack is not None:
        return spec.layer_stack(model)
    assert spec.stage_stacks is not None  # refusal() checked that the model has one
    return spec.stage_stacks(model)


def make_fused_train_step(
    parts: models.LayerStack | models.StageStacks,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    compute_dtype: Any,
    loss: losses_lib.LossFn = losses_lib.cross_entropy,
    clip_norm: float | None = None,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """``step(state, batch) -> (new_state, metrics)`` like :func:`train.state.make_train_step`.

    Same state and metrics; the parameters are cast to ``compute_dtype`` inside each part, as
    the two-phase step casts them before ``model.apply``. A model of several stacks
    (:class:`models.StageStacks`) also carries its BatchNorm statistics: the new
    ``batch_stats`` are the forward pass's, in the state's dtypes. Jit it with
    ``donate_argnums=0``.

    Raises:
      SetupError: (on the first trace) the optimizer is not element-wise.
    """
    make = _stages_step if isinstance(parts, models.StageStacks) else _stack_step
    fused = make(parts, tx, compute_dtype=compute_dtype, loss=loss, clip_norm=clip_norm)

    def step(state: TrainState, batch: dict[str, jax.Array]):
        rng, _ = jax.random.split(jax.random.wrap_key_data(state.rng))  # as the two-phase step
        try:
            params, opt_state, batch_stats, (value, loss_metrics), norms = fused(
                state.params, state.opt_state, state.batch_stats, batch
            )
        except rn.FusedUpdateError as e:
            raise SetupError(f"{_OPTION}: {e}") from None
        if clash := sorted(set(loss_metrics) & set(STEP_METRICS)):
            raise ValueError(
                f"the loss function's metrics {clash} have the names of the train step's own "
                f"{list(STEP_METRICS)}. Fix: rename them in the loss function (model.loss)."
            )
        finite = jnp.isfinite(value) & jnp.isfinite(norms["grad_norm"])
        new_state = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            batch_stats=jax.tree.map(_like, batch_stats, state.batch_stats),
            rng=jax.random.key_data(rng),
        )
        metrics = {
            "loss": value,
            **loss_metrics,
            "grad_norm": norms["grad_norm"],
            "lr": jnp.asarray(schedule(state.step), jnp.float32),
            "finite": finite & jnp.isfinite(norms["update_norm"]),
            # The drift checks' counts (zeros without a checked stack; the loop refuses a
            # failed check before anything of the step is saved).
            **{k: norms[k] for k in rn.DRIFT_REPORT_FIELDS},
        }
        return new_state, metrics

    return step


def _like(new: jax.Array, old: jax.Array) -> jax.Array:
    return new.astype(old.dtype)


def _loss_head(loss: losses_lib.LossFn, outputs: Any, batch: dict[str, jax.Array]) -> Any:
    """The batch-mean loss and metrics of the model's outputs, as the two-phase step's."""
    per_example, metrics = loss(losses_lib.at_least_float32(outputs), batch["y"])
    return jnp.mean(per_example), {k: jnp.mean(v.astype(jnp.float32)) for k, v in metrics.items()}


def _inputs(batch: dict[str, jax.Array], compute_dtype: Any) -> jax.Array:
    x = batch["x"]
    return x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _cast_backward(backward: Callable[..., Any], compute_dtype: Any) -> Callable[..., Any]:
    """A fused inverse-and-VJP of float32 parameters from one of compute-dtype parameters."""

    def cast_backward(params: Any, *args: Any) -> tuple[Any, Any, Any]:
        cast, cast_vjp = jax.vjp(lambda p: cast_floats(p, compute_dtype), params)
        h, d_cast, dh = backward(cast, *args)
        return h, cast_vjp(d_cast)[0], dh

    return cast_backward


def _stack_step(
    parts: models.LayerStack,
    tx: optax.GradientTransformation,
    *,
    compute_dtype: Any,
    loss: losses_lib.LossFn,
    clip_norm: float | None,
) -> Callable[..., tuple[Any, ...]]:
    """``(params, opt_state, batch_stats, batch) -> (params, opt_state, batch_stats, (loss,
    metrics), norms)`` over one stack (:func:`remat_nn.fused_update_step`); no batch stats."""

    def embed(rest: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return parts.embed(cast_floats(rest, compute_dtype), _inputs(batch, compute_dtype))

    def layer(params: Any, h: jax.Array) -> jax.Array:
        return parts.layer(cast_floats(params, compute_dtype), h)

    def head(rest: Any, h: jax.Array, batch: dict[str, jax.Array]) -> Any:
        return _loss_head(loss, parts.head(cast_floats(rest, compute_dtype), h), batch)

    fused = rn.fused_update_step(
        embed,
        layer,
        head,
        tx,
        stack_key=parts.key,
        has_aux=True,
        norms=True,
        report_drift=True,  # in the metrics: no host callback, the step is cached
        backward_fn=parts.backward and _cast_backward(parts.backward, compute_dtype),
        save_every=parts.save_every,
        fallback=parts.fallback,
        clip_norm=clip_norm,
    )

    def step(params: Any, opt_state: Any, batch_stats: Any, batch: Any) -> tuple[Any, ...]:
        params, opt_state, value, norms = fused(params, opt_state, batch)
        return params, opt_state, batch_stats, value, norms

    return step


def _stages_step(
    parts: models.StageStacks,
    tx: optax.GradientTransformation,
    *,
    compute_dtype: Any,
    loss: losses_lib.LossFn,
    clip_norm: float | None,
) -> Callable[..., tuple[Any, ...]]:
    """The same over several stacks with batch statistics (:func:`remat_nn.fused_update_stages`)."""
    cast = partial(cast_floats, dtype=compute_dtype)

    def embed(rest: Any, stats: Any, batch: dict[str, jax.Array]) -> Any:
        return parts.embed(cast(rest), stats, _inputs(batch, compute_dtype))

    def head(rest: Any, stats: Any, h: Any, batch: dict[str, jax.Array]) -> Any:
        outputs, stats = parts.head(cast(rest), stats, h)
        return _loss_head(loss, outputs, batch), stats

    def stage(s: rn.FusedStage) -> rn.FusedStage:
        before, inverse, backward = s.before, s.inverse, s.backward
        # The stage as the model gave it (its save_every, drift_rtol and fallback), computing
        # in compute_dtype.
        return dataclasses.replace(
            s,
            layer=lambda p, c, h: s.layer(cast(p), c, h),
            before=None if before is None else lambda r, c, h: before(cast(r), c, h),
            inverse=None if inverse is None else lambda p, c, y: inverse(cast(p), c, y),
            backward=None if backward is None else _cast_backward(backward, compute_dtype),
        )

    return rn.fused_update_stages(
        embed,
        [stage(s) for s in parts.stages],
        head,
        tx,
        has_aux=True,
        norms=True,
        report_drift=True,  # in the metrics: no host callback, the step is cached
        clip_norm=clip_norm,
    )
