"""The train state, the optimizer, and the donated train step.

The whole :class:`TrainState` is one pytree donated to the jitted step
(``jax.jit(step, donate_argnums=0)``): XLA writes the new state into the old state's buffers, so a
step holds one copy of params and optimizer state, not two (:mod:`train.donation` proves it).
"""

from __future__ import annotations

import collections
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import remat_nn as rn
from train import losses as losses_lib
from train.config import Optim

__all__ = [
    "TrainState",
    "accumulated_value_and_grad",
    "cast_floats",
    "decay_mask",
    "decay_summary",
    "decayed_paths",
    "eval_zeros",
    "make_eval_step",
    "make_init",
    "make_optimizer",
    "make_train_step",
    "STEP_METRICS",
    "micro_batch",
]


class TrainState(NamedTuple):
    """Everything a step reads and writes; donated whole to the jitted step."""

    step: jax.Array  # () int32: optimizer steps taken
    params: Any  # float32 master weights (pytree of arrays)
    opt_state: Any  # optax state, leaves shaped like params (plus scalar counts)
    batch_stats: Any  # BatchNorm running statistics ({} for models without BatchNorm)
    rng: jax.Array  # (2,) uint32 raw key data; split once per step


# --- optimizer ------------------------------------------------------------------------------------


def _path_names(path: tuple[Any, ...]) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def decay_mask(params: Any, exclude: Sequence[str]) -> Any:
    """Which parameters get weight decay: a bool pytree shaped like ``params``.

    A parameter is decayed unless an ``exclude`` glob (fnmatch) matches its path joined by "/"
    or its own name. The decision is by role, not rank: scanned and reversible stacks put their
    layers on a leading axis, so a stacked LayerNorm scale is rank 2 like a kernel.

    >>> params = {"blocks": {"ln": {"scale": jnp.ones((4, 8)), "bias": jnp.ones((4, 8))},
    ...                      "fc": {"kernel": jnp.ones((4, 8, 8)), "bias": jnp.ones((4, 8))}},
    ...           "embed": {"embedding": jnp.ones((16, 8))}}
    >>> sorted(decayed_paths(params, ["bias", "scale"]))
    ['blocks/fc/kernel', 'embed/embedding']
    """
    patterns = tuple(exclude)

    def decays(path: tuple[Any, ...], _: Any) -> bool:
        names = _path_names(path)
        where = "/".join(names)
        return not any(
            fnmatch.fnmatchcase(where, p) or fnmatch.fnmatchcase(names[-1], p) for p in patterns
        )

    return jax.tree_util.tree_map_with_path(decays, params)


def decayed_paths(params: Any, exclude: Sequence[str]) -> list[str]:
    """The "/"-joined paths of the parameters :func:`decay_mask` decays."""
    flat = jax.tree_util.tree_leaves_with_path(decay_mask(params, exclude))
    return ["/".join(_path_names(path)) for path, decays in flat if decays]


def decay_summary(params: Any, exclude: Sequence[str]) -> str:
    """``weight decay: n of m parameter leaves (not decayed: bias x 3, scale x 2)``.

    >>> decay_summary({"a": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}, ["bias"])
    'weight decay: 1 of 2 parameter leaves (not decayed: bias x 1)'
    """
    flat = jax.tree_util.tree_leaves_with_path(decay_mask(params, exclude))
    kept = collections.Counter(_path_names(path)[-1] for path, decays in flat if not decays)
    shown = ", ".join(f"{name} x {n}" for name, n in sorted(kept.items())) or "none"
    decayed = len(flat) - sum(kept.values())
    return f"weight decay: {decayed} of {len(flat)} parameter leaves (not decayed: {shown})"


def make_optimizer(
    cfg: Optim, total_steps: int, *, clip: bool = True
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation of ``cfg`` and its learning-rate schedule.

    Args:
      cfg: the ``optim`` config section.
      total_steps: the steps the schedule spans (``optim.schedule_steps``, else ``train.steps``).
      clip: with ``optim.clip_norm``, include the global-norm clip; False: ``optax.identity``
        in its place (the fused step clips by itself; both hold an empty state, so the
        optimizer state has the same structure either way and checkpoints move between them).

    >>> from train.config import Optim
    >>> tx, lr = make_optimizer(Optim(lr=0.1, warmup_steps=10, schedule="cosine"), 100)
    >>> [round(float(lr(s)), 6) for s in (0, 5, 10, 100)]
    [0.0, 0.05, 0.1, 0.0]
    """
    if cfg.schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(
            0.0,
            cfg.lr,
            warmup_steps=cfg.warmup_steps,
            decay_steps=max(total_steps, cfg.warmup_steps + 1),
            end_value=cfg.lr * cfg.final_lr_fraction,
        )
    elif cfg.warmup_steps:
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)],
            [cfg.warmup_steps],
        )
    else:
        schedule = optax.constant_schedule(cfg.lr)
    exclude = tuple(cfg.decay_exclude)
    mask = (lambda params: decay_mask(params, exclude)) if exclude else None
    parts = []
    if cfg.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm) if clip else optax.identity())
    if cfg.name == "sgd":
        if cfg.weight_decay:
            parts.append(optax.add_decayed_weights(cfg.weight_decay, mask))
        parts.append(optax.sgd(schedule, momentum=cfg.momentum or None, nesterov=cfg.nesterov))
    else:
        parts.append(
            optax.adamw(
                schedule,
                b1=cfg.b1,
                b2=cfg.b2,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                mask=mask,
            )
        )
    return optax.chain(*parts), schedule


# --- init -----------------------------------------------------------------------------------------


def make_init(
    model: fnn.Module, tx: optax.GradientTransformation, example_x: Any, *, seed: int
) -> Callable[[], TrainState]:
    """``init() -> TrainState``; jit it with ``out_shardings`` so each leaf is born sharded.

    Args:
      model: the flax module.
      tx: the optimizer.
      example_x: shape and dtype of an input batch (anything with ``.shape``, ``.dtype``).
      seed: seeds params, dropout and the per-step rng.
    """

    def init() -> TrainState:
        root = jax.random.key(seed)
        k_params, k_dropout, k_train = jax.random.split(root, 3)
        x = jnp.zeros(example_x.shape, example_x.dtype)
        variables = model.init({"params": k_params, "dropout": k_dropout}, x, train=False)
        params = variables["params"]
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            batch_stats=variables.get("batch_stats", {}),
            rng=jax.random.key_data(k_train),
        )

    return init


# --- step -----------------------------------------------------------------------------------------


def cast_floats(tree: Any, dtype: Any) -> Any:
    """The float leaves of ``tree`` in ``dtype`` (the compute dtype), the others as they are."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def make_loss_fn(
    model: fnn.Module,
    *,
    compute_dtype: Any,
    has_batch_stats: bool,
    loss: losses_lib.LossFn = losses_lib.cross_entropy,
) -> Callable:
    """``loss_fn(params, batch_stats, batch, key) -> (loss, (metrics, new_batch_stats))``.

    ``loss`` is a :mod:`train.losses` function; the loss and each metric are batch means. With
    ``compute_dtype=bfloat16`` the float32 master weights and float inputs are cast to bfloat16
    for the forward and backward; the loss, gradients and update stay float32.
    """

    def loss_fn(params, batch_stats, batch, key):
        variables = {"params": cast_floats(params, compute_dtype)}
        if has_batch_stats:
            variables["batch_stats"] = batch_stats
        x = batch["x"]
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(compute_dtype)
        out = model.apply(
            variables,
            x,
            train=True,
            rngs={"dropout": key},
            mutable=["batch_stats"] if has_batch_stats else False,
        )
        outputs, new_vars = out if has_batch_stats else (out, {})
        per_example, metrics = loss(losses_lib.at_least_float32(outputs), batch["y"])
        new_stats = new_vars.get("batch_stats", batch_stats)
        new_stats = jax.tree.map(lambda n, o: n.astype(o.dtype), new_stats, batch_stats)
        means = {k: jnp.mean(v.astype(jnp.float32)) for k, v in metrics.items()}
        return jnp.mean(per_example), (means, new_stats)

    return loss_fn


def micro_batch(batch: dict[str, jax.Array], i: jax.Array | int, k: int) -> dict[str, jax.Array]:
    """Micro-batch ``i`` of ``k`` of ``batch`` (leaves (B, ...)): rows i, i+k, i+2k, ...

    Strided rather than contiguous, so each micro-batch takes B/(k n) rows from each of the n
    devices the batch axis is split over: no data moves between devices. The (B/k, k, ...)
    view is a reshape, and each micro-batch is read from it in place (no transposed copy of the
    batch).

    >>> micro_batch({"x": jnp.arange(6)}, 1, 2)["x"].tolist()
    [1, 3, 5]
    """

    def rows(v: jax.Array) -> jax.Array:
        strided = v.reshape(v.shape[0] // k, k, *v.shape[1:])  # (B/k, k, ...)
        return jax.lax.dynamic_index_in_dim(strided, i, axis=1, keepdims=False)

    return jax.tree.map(rows, batch)


def accumulated_value_and_grad(loss_fn: Callable, k: int) -> Callable:
    """``jax.value_and_grad(loss_fn, has_aux=True)`` over ``k`` micro-batches in a ``lax.scan``.

    ``loss_fn(params, batch_stats, batch, key) -> (loss, (metrics, batch_stats))`` must return
    batch *means*: the mean of k equal micro-batch means is then the whole batch's mean, so
    loss, metrics and gradient equal one pass over the k-times larger batch up to float
    rounding (the sums are taken in another order), while the backward holds one micro-batch's
    activations. Exact for models whose output for an example does not depend on the other
    examples: BatchNorm normalises each micro-batch by its own statistics and updates its
    running statistics k times (as in every trainer that accumulates), and dropout draws its
    masks per micro-batch (key folded with the micro-batch index).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if k == 1:
        return grad_fn

    def accumulated(params, batch_stats, batch, key):
        def body(carry, i):
            sums, stats, grad_sum = carry  # sums: (loss, metrics) summed over micro-batches
            micro, key_i = micro_batch(batch, i, k), jax.random.fold_in(key, i)
            (loss, (metrics, stats)), grads = grad_fn(params, stats, micro, key_i)
            sums = jax.tree.map(jnp.add, sums, (loss, metrics))
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (sums, stats, grad_sum), None

        # The sums start as zeros shaped like one micro-batch's (loss, metrics).
        shapes = jax.eval_shape(grad_fn, params, batch_stats, micro_batch(batch, 0, k), key)[0]
        sums = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (shapes[0], shapes[1][0]))
        init = (sums, batch_stats, jax.tree.map(jnp.zeros_like, params))
        ((loss_sum, metric_sums), stats, grad_sum), _ = jax.lax.scan(body, init, jnp.arange(k))
        mean = lambda t: jax.tree.map(lambda x: x / k, t)
        return (loss_sum / k, (mean(metric_sums), stats)), mean(grad_sum)

    return accumulated


#: The train step's own metrics; the loss function's join them. A model with checked
#: reversible layers adds :data:`remat_nn.DRIFT_REPORT_FIELDS` (stacks whose check failed,
#: layers recomputed), reported through a probe's cotangent (:func:`remat_nn.report_drift_to`),
#: so that the step holds no host callback and JAX's persistent compilation cache keeps it.
STEP_METRICS = ("loss", "grad_norm", "lr", "finite", *rn.DRIFT_REPORT_FIELDS)


def make_train_step(
    model: fnn.Module,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    compute_dtype: Any = jnp.float32,
    has_batch_stats: bool,
    skip_nonfinite: bool = False,
    grad_accum: int = 1,
    loss: losses_lib.LossFn = losses_lib.cross_entropy,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """``step(state, batch) -> (new_state, metrics)``; jit it with ``donate_argnums=0``.

    Metrics (device scalars): loss, the loss function's metrics (accuracy for cross-entropy),
    grad_norm, lr, finite (loss, gradient norm and
    update norm are finite). With ``skip_nonfinite`` a non-finite step leaves params, optimizer
    state and batch stats unchanged (the step counter and rng still advance). With
    ``grad_accum=k`` the gradient is the mean of k micro-batch gradients (see
    :func:`accumulated_value_and_grad`): one optimizer update per step, as for the whole batch.
    """
    loss_fn = make_loss_fn(
        model, compute_dtype=compute_dtype, has_batch_stats=has_batch_stats, loss=loss
    )
    reported: list[bool] = []  # per trace of the loss: did a checked stack take the probe?

    def probed_loss(params_and_probe, batch_stats, batch, key):
        params, probe = params_and_probe
        with rn.report_drift_to(probe) as sink:
            out = loss_fn(params, batch_stats, batch, key)
        reported.append(sink.used)
        return out

    grad_fn = accumulated_value_and_grad(probed_loss, grad_accum)

    def step(state: TrainState, batch: dict[str, jax.Array]):
        rng, key = jax.random.split(jax.random.wrap_key_data(state.rng))
        probe = jnp.zeros((len(rn.DRIFT_REPORT_FIELDS),), jnp.float32)
        (loss, (loss_metrics, batch_stats)), (grads, drift) = grad_fn(
            (state.params, probe), state.batch_stats, batch, key
        )
        if clash := sorted(set(loss_metrics) & set(STEP_METRICS)):
            raise ValueError(
                f"the loss function's metrics {clash} have the names of the train step's own "
                f"{list(STEP_METRICS)}. Fix: rename them in the loss function (model.loss)."
            )
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # Checked before the state can hold Inf: loss, gradient and the update itself.
        finite = (
            jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(updates))
        )
        if skip_nonfinite:
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
            params = keep(params, state.params)
            opt_state = keep(opt_state, state.opt_state)
            batch_stats = keep(batch_stats, state.batch_stats)
        new_state = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            batch_stats=batch_stats,
            rng=jax.random.key_data(rng),
        )
        metrics = {
            "loss": loss,
            **loss_metrics,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(schedule(state.step), jnp.float32),
            "finite": finite,
        }
        if any(reported):  # the counts, summed over micro-batches (grad_fn took their mean)
            metrics.update(zip(rn.DRIFT_REPORT_FIELDS, drift * grad_accum, strict=True))
        return new_state, metrics

    return step


def make_eval_step(
    model: fnn.Module,
    *,
    compute_dtype: Any,
    has_batch_stats: bool,
    loss: losses_lib.LossFn = losses_lib.cross_entropy,
) -> Callable:
    """``eval_step(state, batch, sums) -> sums``: adds the masked batch's sums of the loss and of
    each metric, and its example count, to ``sums`` (start from :func:`eval_zeros`)."""

    def eval_step(state: TrainState, batch: dict[str, jax.Array], sums: dict[str, jax.Array]):
        variables = {"params": cast_floats(state.params, compute_dtype)}
        if has_batch_stats:
            variables["batch_stats"] = state.batch_stats
        x = batch["x"]
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(compute_dtype)
        outputs = losses_lib.at_least_float32(model.apply(variables, x, train=False))
        per_example, metrics = loss(outputs, batch["y"])
        w = batch["mask"]  # (B,) or (B, T) like the losses: 0 on padding rows
        new = {"loss": per_example, **metrics}
        out = {k: sums[k] + jnp.sum(v.astype(jnp.float32) * w) for k, v in new.items()}
        return {**out, "count": sums["count"] + jnp.sum(w)}

    return eval_step


def eval_zeros(metric_names: Sequence[str] = ("accuracy",)) -> dict[str, np.ndarray]:
    """The starting sums of :func:`make_eval_step` for a loss with these metrics."""
    return {k: np.zeros((), np.float32) for k in ("loss", *metric_names, "count")}
