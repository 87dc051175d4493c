"""``train.update_in_backward``: the train step with the optimizer update inside the backward.

For a model whose blocks are one stack (``models.ModelSpec.layer_stack``), the step is
:func:`remat_nn.fused_update_step`: each block's slice of the parameters and optimizer state is
updated as soon as its gradient is known, so the full gradient never exists. The train state is
the same pytree as the two-phase step's (:func:`train.state.make_train_step`), so checkpoints of
either step resume with the other. :func:`refusal` lists the options it cannot run with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import models
import remat_nn as rn
from train import losses as losses_lib
from train.config import Config
from train.errors import SetupError
from train.state import STEP_METRICS, TrainState

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
    if spec.layer_stack is None:
        why.append(f"model {cfg.model.label!r} has no layer stack (a scan of layers)")
    else:
        try:
            spec.layer_stack(model)
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
    assert spec.layer_stack is not None  # refusal() checked it
    return make_fused_train_step(
        spec.layer_stack(model),
        tx,
        schedule,
        compute_dtype=compute_dtype,
        loss=loss,
        clip_norm=cfg.optim.clip_norm,
    )


def cast_floats(tree: Any, dtype: Any) -> Any:
    """The float leaves of ``tree`` in ``dtype`` (the compute dtype), the others as they are."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def make_fused_train_step(
    parts: models.LayerStack,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    compute_dtype: Any,
    loss: losses_lib.LossFn = losses_lib.cross_entropy,
    clip_norm: float | None = None,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """``step(state, batch) -> (new_state, metrics)`` like :func:`train.state.make_train_step`.

    Same state and metrics; the parameters are cast to ``compute_dtype`` inside each part, as
    the two-phase step casts them before ``model.apply``. Jit it with ``donate_argnums=0``.

    Raises:
      SetupError: (on the first trace) the optimizer is not element-wise.
    """

    def embed(rest: Any, batch: dict[str, jax.Array]) -> jax.Array:
        x = batch["x"]
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(compute_dtype)
        return parts.embed(cast_floats(rest, compute_dtype), x)

    def layer(params: Any, h: jax.Array) -> jax.Array:
        return parts.layer(cast_floats(params, compute_dtype), h)

    def head(rest: Any, h: jax.Array, batch: dict[str, jax.Array]) -> Any:
        outputs = parts.head(cast_floats(rest, compute_dtype), h)
        per_example, metrics = loss(outputs.astype(jnp.float32), batch["y"])
        return jnp.mean(per_example), {
            k: jnp.mean(v.astype(jnp.float32)) for k, v in metrics.items()
        }

    def backward(params: Any, y: Any, dy: Any) -> tuple[Any, Any, Any]:
        assert parts.backward is not None
        cast, cast_vjp = jax.vjp(lambda p: cast_floats(p, compute_dtype), params)
        h, d_cast, dh = parts.backward(cast, y, dy)
        return h, cast_vjp(d_cast)[0], dh

    fused = rn.fused_update_step(
        embed,
        layer,
        head,
        tx,
        stack_key=parts.key,
        has_aux=True,
        norms=True,
        backward_fn=None if parts.backward is None else backward,
        save_every=parts.save_every,
        clip_norm=clip_norm,
    )

    def step(state: TrainState, batch: dict[str, jax.Array]):
        rng, _ = jax.random.split(jax.random.wrap_key_data(state.rng))  # as the two-phase step
        try:
            params, opt_state, (value, loss_metrics), norms = fused(
                state.params, state.opt_state, batch
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
            batch_stats=state.batch_stats,
            rng=jax.random.key_data(rng),
        )
        metrics = {
            "loss": value,
            **loss_metrics,
            "grad_norm": norms["grad_norm"],
            "lr": jnp.asarray(schedule(state.step), jnp.float32),
            "finite": finite & jnp.isfinite(norms["update_norm"]),
        }
        return new_state, metrics

    return step
