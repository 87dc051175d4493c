"""The :class:`Experiment`: everything a run builds from its config before the first step.

:func:`build_experiment` loads the data, builds the model under its remat plan (planning it first
for ``remat: {policy: auto}``) and lays the train state out on the mesh; :func:`compiled`
compiles the train step ahead of time with the whole state donated. The loop (:mod:`train.loop`)
and the dry run (:mod:`train.dry_run`) both start from it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import models
from models.summary import count_params
from remat_nn import format_bytes
from train import autoplan, donation, multihost
from train import data as data_lib
from train import fused as fused_lib
from train import losses as losses_lib
from train import remat as remat_lib
from train import sharding as sharding_lib
from train import state as state_lib
from train.autoplan import AutoChoice
from train.config import AutoRequest, Config
from train.errors import SetupError
from train.state import TrainState

__all__ = ["Experiment", "build_experiment", "compiled", "model_options", "schedule_steps"]


@dataclass
class Experiment:
    """Everything a run builds from its config before the first step.

    Attributes:
      cfg: the config.
      dataset: the loaded data.
      model: the flax module, with its remat plan and compute dtype.
      options: the model's options as its build received them (data-derived values filled
        in, resolved by :func:`models.resolve_options`: ``remat`` is the plan that runs).
      mesh: the device mesh; ``global_batch`` is split over all of it.
      state_shardings: the train state's shardings (a pytree like the state).
      abstract: the train state as ``ShapeDtypeStruct`` with shardings.
      init: ``init() -> TrainState`` (jit it with ``out_shardings=state_shardings``).
      tx: the optimizer.
      step_fn: the train step before jit (the dry run measures it).
      jit_kwargs: shardings and donation the step is compiled with.
      train_step: the compiled step; ``train_step(state, batch)`` donates ``state`` (None
        until :func:`compiled`).
      eval_step: the jitted eval step (adds to running sums); None with ``train_step``.
      auto_choice: ``remat: {policy: auto}``: the planner's choice (plan and form).
      plan_file: ``remat: {policy: auto}``: the plan file the model was built from (its
        ``variant`` may change the parameters); None otherwise.
      loss: the :mod:`train.losses` function (``model.loss``).
      metric_names: the metrics it reports (``accuracy`` for cross-entropy).
    """

    cfg: Config
    dataset: data_lib.Dataset
    model: Any
    options: dict[str, Any]
    mesh: jax.sharding.Mesh
    global_batch: int
    batch_sharding: Any
    replicated: Any
    state_shardings: Any
    abstract: TrainState
    init: Callable[[], TrainState]
    tx: optax.GradientTransformation
    step_fn: Callable[..., Any]
    jit_kwargs: dict[str, Any]
    train_step: Any
    eval_step: Any
    compute_dtype: Any
    has_batch_stats: bool
    say: Callable[[str], None]
    out: Callable[[str], None] | None
    plan_file: Path | None = None
    auto_choice: AutoChoice | None = None
    loss: losses_lib.LossFn = losses_lib.cross_entropy
    metric_names: tuple[str, ...] = ("accuracy",)
    #: Compiles the steps (:func:`compiled` calls it; None once it has).
    pending: Callable[[], _Steps] | None = None

    @property
    def run_dir(self) -> Path:
        return self.cfg.resolved_run_dir.absolute()

    @property
    def is_main(self) -> bool:
        return multihost.is_main()


def build_experiment(
    cfg: Config,
    *,
    say: Callable[[str], None],
    out: Callable[[str], None] | None = None,
    restart: bool = False,
    dry_run: bool = False,
) -> Experiment:
    """Loads the data, builds the model and optimizer, and prepares the donated train step:
    :func:`compiled` compiles it (a run found complete on resume never does)."""
    _use_compile_cache(cfg)
    spec = _model_spec(cfg)
    loss = _loss(cfg, spec)
    dataset = data_lib.load(cfg.data, task=spec.task)
    options = model_options(cfg, spec, dataset)
    # The config's remat request resolved once: a Plan, "none", an AutoRequest or None (default).
    plan = remat_lib.resolve(cfg.remat_request, spec, model=cfg.model.label)
    mesh = sharding_lib.make_mesh(cfg.mesh)
    global_bs = _global_batch_size(cfg, mesh.size)
    data_lib.check_batch(dataset, global_bs, jax.process_count())  # before anything is written
    batch_sh, repl = sharding_lib.batch_sharding(mesh), sharding_lib.replicated(mesh)
    tx, schedule = _optimizer(cfg)
    example = dataset.example_batch(1)
    compute_dtype = jnp.dtype(cfg.train.compute_dtype)
    options, plan, plan_file, choice = _chosen_form(
        cfg,
        plan,
        options,
        spec=spec,
        tx=tx,
        example=example,
        micro_batch=global_bs // mesh.size // cfg.train.grad_accum,  # one device's micro-batch
        compute_dtype=compute_dtype,
        say=say,
        loss=loss,
        write=multihost.is_main() and not dry_run,
        restart=restart,
    )
    options = models.resolve_options(spec, **remat_lib.model_options_with_plan(options, plan))
    model = _build_model(spec, options)
    init = state_lib.make_init(model, tx, _x_shape(example), seed=cfg.train.seed)
    state_sh, abstract = _state_layout(cfg, init, mesh)
    has_bn = bool(jax.tree.leaves(abstract.batch_stats))
    say(_summary(cfg, abstract, dataset, mesh, global_bs))
    say(remat_lib.plan_line(cfg.remat_request, options.get("remat"), spec.remat_presets, choice))
    remat_lib.check_offload(plan, cfg.train.offload_on_cpu, say)
    step_fn = _train_step_fn(cfg, spec, model, tx, schedule, compute_dtype, has_bn, loss)
    pending = functools.partial(
        _compile_steps,
        cfg,
        step_fn,
        state_lib.make_eval_step(
            model, compute_dtype=compute_dtype, has_batch_stats=has_bn, loss=loss
        ),
        abstract=abstract,
        batch_abstract=_batch_abstract(example, global_bs, batch_sh),
        shardings=(state_sh, batch_sh, repl),
        say=say,
    )
    return Experiment(
        cfg=cfg,
        dataset=dataset,
        model=model,
        options=options,
        mesh=mesh,
        global_batch=global_bs,
        batch_sharding=batch_sh,
        replicated=repl,
        state_shardings=state_sh,
        abstract=abstract,
        init=init,
        tx=tx,
        **_Steps(step_fn, {}, None, None, ())._asdict(),  # compiled() fills in the rest
        compute_dtype=compute_dtype,
        has_batch_stats=has_bn,
        say=say,
        out=out,
        plan_file=plan_file,
        auto_choice=choice,
        loss=loss,
        pending=pending,
    )


def compiled(exp: Experiment) -> Experiment:
    """``exp`` with its train and eval steps compiled (itself if they are)."""
    if exp.pending is None:
        return exp
    return dataclasses.replace(exp, pending=None, **exp.pending()._asdict())


def _batch_abstract(example: dict[str, Any], global_bs: int, sharding: Any) -> dict[str, Any]:
    """The global batch's shapes, dtypes and sharding, from a one-example batch."""
    return {
        k: jax.ShapeDtypeStruct((global_bs, *v.shape[1:]), v.dtype, sharding=sharding)
        for k, v in example.items()
    }


def _chosen_form(
    cfg: Config, plan: Any, options: dict[str, Any], **auto: Any
) -> tuple[dict[str, Any], Any, Path | None, Any]:
    """``(options, plan, plan_file, choice)``: for ``remat: {policy: auto}``, the form and plan
    the planner chose (its options on the model's, its own remat if it sets one; the state is
    built from this model) with the plan file and the choice; otherwise as given."""
    if not isinstance(plan, AutoRequest):
        return options, plan, None, None
    plan_file, choice = _auto_plan(cfg, plan, options=options, **auto)
    return {**options, **choice.model_options}, choice.policy, plan_file, choice


def _optimizer(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    # The fused step (train.update_in_backward) clips by the global norm itself: its optimizer
    # has optax.identity in the clip's place, the same (empty) state.
    clip = not cfg.train.update_in_backward
    return state_lib.make_optimizer(cfg.optim, schedule_steps(cfg), clip=clip)


def _train_step_fn(
    cfg: Config,
    spec: models.ModelSpec,
    model: Any,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    compute_dtype: Any,
    has_bn: bool,
    loss: losses_lib.LossFn,
) -> Callable[..., Any]:
    # The train step before jit: with train.update_in_backward the same state, updated layer by
    # layer in the backward.
    if cfg.train.update_in_backward:
        return fused_lib.train_step(cfg, spec, model, tx, schedule, compute_dtype, loss)
    return state_lib.make_train_step(
        model,
        tx,
        schedule,
        compute_dtype=compute_dtype,
        has_batch_stats=has_bn,
        skip_nonfinite=cfg.train.on_nonfinite == "skip",
        grad_accum=cfg.train.grad_accum,
        loss=loss,
    )


def _use_compile_cache(cfg: Config) -> None:
    # train.compile_cache, unless the environment already set a cache directory.
    if cfg.train.compile_cache and not jax.config.jax_compilation_cache_dir:
        cache_dir = Path(cfg.train.compile_cache).expanduser().absolute()
        jax.config.update("jax_compilation_cache_dir", str(cache_dir))


def _x_shape(example: dict[str, Any]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(example["x"].shape, example["x"].dtype)


def _auto_plan(
    cfg: Config,
    request: AutoRequest,
    *,
    spec: models.ModelSpec,
    options: dict[str, Any],
    tx: optax.GradientTransformation,
    example: dict[str, Any],
    micro_batch: int,
    compute_dtype: Any,
    say: Callable[[str], None],
    loss: losses_lib.LossFn,
    write: bool,
    restart: bool,
) -> tuple[Path, AutoChoice]:
    # `remat: {policy: auto, budget: ...}`: plan once, on one device's batch, and keep the plan
    # (and the model's form chosen) in the run directory so a resumed run builds the same model
    # and compiles the same step. Each form is planned on its own state's shapes.
    plan_file = cfg.resolved_run_dir.absolute() / autoplan.PLAN_FILE
    if restart and write:
        plan_file.unlink(missing_ok=True)

    def build(p: Any, overrides: Mapping[str, Any] | None = None) -> Any:
        # The model under plan p (None: its options' own remat); overrides: a variant's options.
        opts = remat_lib.model_options_with_plan({**options, **(overrides or {})}, p)
        return _build_model(spec, models.resolve_options(spec, **opts))

    choice = autoplan.load_or_plan(
        request,
        run_dir=plan_file.parent,
        build=build,
        abstract_state=lambda o: jax.eval_shape(
            state_lib.make_init(build(None, o), tx, _x_shape(example), seed=cfg.train.seed)
        ),
        batch={
            k: jax.ShapeDtypeStruct((micro_batch, *v.shape[1:]), v.dtype)
            for k, v in example.items()
        },
        compute_dtype=compute_dtype,
        say=say,
        model_variants=spec.variants(options) if spec.variants else None,
        write=write,
        loss=loss,
    )
    return plan_file, choice


def _state_layout(cfg: Config, init: Callable[[], TrainState], mesh: Any) -> tuple[Any, Any]:
    # The train state's shardings on the mesh, and the state as sharded ShapeDtypeStructs.
    unsharded = jax.eval_shape(init)
    state_sh = sharding_lib.state_shardings(unsharded, mesh, min_size=cfg.mesh.fsdp_min_size)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), unsharded, state_sh
    )
    return state_sh, abstract


def _summary(
    cfg: Config, abstract: TrainState, dataset: data_lib.Dataset, mesh: Any, global_bs: int
) -> str:
    n_params = count_params(abstract.params)
    return (
        f"model {cfg.model.label}: {n_params:,} params | data {dataset.name}: "
        f"{dataset.num_examples('train')} train / {dataset.num_examples('test')} test examples | "
        f"mesh {dict(mesh.shape)} on {jax.process_count()} process(es), "
        f"{jax.devices()[0].platform} | global batch {global_bs} ({global_bs // mesh.size}/device)"
        + _accum_note(cfg.train.grad_accum, global_bs)
    )


class _Steps(NamedTuple):
    step_fn: Callable[..., Any]  # the train step before jit
    jit_kwargs: dict[str, Any]  # its shardings and donation
    train_step: Any  # compiled
    eval_step: Any  # jitted
    metric_names: tuple[str, ...]  # the loss's metrics, read off the compiled step


def _compile_steps(
    cfg: Config,
    step_fn: Callable[..., Any],
    eval_fn: Callable[..., Any],
    *,
    abstract: TrainState,
    batch_abstract: dict[str, jax.ShapeDtypeStruct],
    shardings: tuple[Any, Any, Any],
    say: Callable[[str], None],
) -> _Steps:
    # The train step compiled ahead of time, once: the same executable runs every step and is
    # checked for donation before the first one. The eval step adds to running sums.
    state_sh, batch_sh, repl = shardings
    jit_kwargs = dict(
        in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, repl), donate_argnums=0
    )
    train_step = jax.jit(step_fn, **jit_kwargs).lower(abstract, batch_abstract).compile()
    metric_names = _metric_names(cfg, train_step)
    eval_step = jax.jit(
        eval_fn, in_shardings=(state_sh, batch_sh, repl), out_shardings=repl, donate_argnums=2
    )
    if cfg.train.verify_donation:
        alias_bytes = donation.verify_donation(train_step, abstract)
        say(f"donation: XLA aliases {format_bytes(alias_bytes)} per device (the whole train state)")
    return _Steps(step_fn, jit_kwargs, train_step, eval_step, metric_names)


def _loss(cfg: Config, spec: models.ModelSpec) -> losses_lib.LossFn:
    # model.loss, else the task's: mean squared error for regression, else cross-entropy.
    return losses_lib.resolve(
        cfg.model.loss or ("mse" if spec.task == "regress" else "cross_entropy")
    )


def _metric_names(cfg: Config, train_step: Any) -> tuple[str, ...]:
    # The loss's metrics, read off the compiled step's outputs; checkpoint.best_metric must be
    # one of them (or the loss).
    names = tuple(sorted(set(train_step.out_info[1]) - set(state_lib.STEP_METRICS)))
    ranked = cfg.checkpoint.best_metric.removeprefix("eval_")
    if cfg.checkpoint.keep_best and ranked != "loss" and ranked not in names:
        raise SetupError(
            f"checkpoint.best_metric={cfg.checkpoint.best_metric} ranks checkpoints by a metric "
            f"the loss ({cfg.model.loss or 'the task default'}) does not report (it reports "
            f"{list(names) or 'none'}). Fix: checkpoint.best_metric=eval_loss, or "
            "checkpoint.keep_best=0."
        )
    return names


def _model_spec(cfg: Config) -> models.ModelSpec:
    # The config was checked against the registry on load; a module (model.module) that stopped
    # importing since is reported like a config error.
    try:
        return cfg.model.spec()
    except models.ModuleError as e:
        raise SetupError(str(e)) from None


def _build_model(spec: models.ModelSpec, options: dict[str, Any]) -> Any:
    # `options` as models.resolve_options gives them (validated once, remat resolved).
    try:
        return spec.build(**options)
    except models.ModuleError as e:  # model.module's build returned something else than a Module
        raise SetupError(str(e)) from None


def schedule_steps(cfg: Config) -> int:
    """The steps the learning-rate schedule spans: extending a run keeps it."""
    return cfg.optim.schedule_steps or cfg.train.steps


def model_options(cfg: Config, spec: models.ModelSpec, dataset: data_lib.Dataset) -> dict[str, Any]:
    """The model's constructor options: ``model.options`` completed from the data and the config.

    Options the data decides (classes, vocabulary, image size and channels, regression outputs)
    are filled in when the model has them and the config does not set them; a set value must
    agree with the data. The compute dtype is one knob: ``train.compute_dtype`` sets the model's
    ``dtype`` option. The top-level ``remat`` is not added here (``train.remat`` hands it over).

    Args:
      cfg: the run's config.
      spec: the model's registry entry (its options' schema).
      dataset: the loaded data.

    Returns:
      keyword arguments for ``models.build`` (or the spec's constructor).

    Raises:
      SetupError: a set option that disagrees with the data or with ``train.compute_dtype``.

    >>> from train.config import load_config
    >>> cfg = load_config(None, ["model.name=transformer", "data.source=corpus"])
    >>> dataset = data_lib.load(cfg.data, task="lm")
    >>> options = model_options(cfg, models.get("transformer"), dataset)
    >>> options["vocab_size"], options["dtype"]
    (256, 'float32')
    """
    opts = dict(cfg.model.options)
    fields = spec.options.model_fields
    from_data: dict[str, int | None] = {
        "num_classes": dataset.num_classes,
        "vocab_size": dataset.vocab_size,
    }
    if dataset.task == "regress":
        from_data["num_outputs"] = dataset.num_outputs
    if dataset.task == "classify":
        from_data["image_size"] = dataset.train_x.shape[1]
        from_data["in_channels"] = dataset.train_x.shape[3]
    for key, value in from_data.items():
        if value is None or key not in fields:
            continue
        too_small = key in ("num_classes", "vocab_size") and opts.get(key, value) < value
        differs = (
            key in ("image_size", "in_channels", "num_outputs") and opts.get(key, value) != value
        )
        if too_small or differs:
            raise SetupError(
                f"model.options.{key}={opts[key]} does not fit the data ({dataset.name}: {value}). "
                f"Fix: drop model.options.{key} (it is filled from the data)."
            )
        opts.setdefault(key, value)
    if "dtype" in fields:
        compute = cfg.train.compute_dtype
        if str(opts.setdefault("dtype", compute)) != compute:
            raise SetupError(
                f"model.options.dtype={opts['dtype']} differs from train.compute_dtype={compute}. "
                f"Fix: drop model.options.dtype; train.compute_dtype sets the model's compute "
                "dtype (master weights stay float32)."
            )
    return opts


def _global_batch_size(cfg: Config, num_devices: int) -> int:
    if cfg.data.batch_size_per_device is not None:
        bs = cfg.data.batch_size_per_device * num_devices
    else:
        bs = cfg.data.batch_size or 0
        if bs % num_devices:
            raise SetupError(
                f"data.batch_size={bs} does not split over the mesh's {num_devices} devices. "
                f"Fix: a multiple of {num_devices}, or set data.batch_size_per_device."
            )
    _check_grad_accum(bs, cfg.train.grad_accum, num_devices)
    return bs


def _accum_note(k: int, global_bs: int) -> str:
    return f" in {k} micro-batches of {global_bs // k} (train.grad_accum)" if k > 1 else ""


def _check_grad_accum(global_bs: int, k: int, num_devices: int) -> None:
    # Each micro-batch is split over every device like the whole batch (state.micro_batch).
    if global_bs % (k * num_devices):
        raise SetupError(
            f"train.grad_accum={k} does not split the global batch of {global_bs} into "
            f"micro-batches that split over the mesh's {num_devices} devices (needs a multiple "
            f"of {k * num_devices}). Fix: a global batch that is a multiple of {k * num_devices}, "
            "or another train.grad_accum."
        )
