"""The schema: one pydantic model per config section, unknown keys rejected.

A field that a resumed run may change (it does not change what the run computes: logging,
evaluation and checkpoint cadence, the run's length) is made with :func:`safe_field`; a whole
section may be marked (``checkpoint``, ``distributed``). :mod:`train.config._resume` reads the
marks; nothing else lists those keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field, NonNegativeInt, PositiveInt
from pydantic_core import PydanticUndefined

from train.config._remat import RematRequest, parse_remat
from train.config._sources import DATA_SOURCES, Task

# A positive number that is finite: inf passes `gt=0` and would surface later as a non-finite loss.
PositiveFinite = Annotated[float, Field(gt=0, allow_inf_nan=False)]

# A path the user wrote: ``~`` (and ``~user``) expands to the home directory, as in a shell.
UserPath = Annotated[str, pydantic.AfterValidator(os.path.expanduser)]

__all__ = [
    "RESUME_SAFE",
    "Checkpoint",
    "Config",
    "Data",
    "Distributed",
    "InitFrom",
    "Mesh",
    "Model",
    "Optim",
    "Profile",
    "Synthetic",
    "Tokens",
    "Train",
    "safe_field",
]

#: The ``json_schema_extra`` key that marks a field (or a whole section) resume-safe.
RESUME_SAFE = "resume_safe"


def safe_field(default: Any = PydanticUndefined, **kwargs: Any) -> Any:
    """A pydantic ``Field`` that a resumed run may change; takes ``Field``'s arguments.

    On a section (``distributed: Distributed = safe_field(default_factory=Distributed)``) it
    marks every key of the section.

    >>> class Section(pydantic.BaseModel):
    ...     every: int = safe_field(10, description="steps between saves")
    >>> Section.model_fields["every"].json_schema_extra
    {'resume_safe': True}
    """
    return Field(default, json_schema_extra={RESUME_SAFE: True}, **kwargs)


class _Section(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", validate_default=True)


class Model(_Section):
    """The model to train: a registered one (``name``) or your own (``module``), and its options."""

    name: str | None = Field(
        None,
        description="registered model name (see models.REGISTRY; python -m models.summary --list); "
        "revnet38 unless model.module is set",
    )
    module: str | None = Field(
        None,
        description="your own model instead of a registered one: 'package.module:build', where "
        "build(**model.options) returns a flax.linen.Module (a function, or the Module class "
        "itself), or a flax.nnx.Module class (or a function taking rngs that builds one); "
        "importable from the working directory or PYTHONPATH. See README 'Train your "
        "model'",
    )
    task: Task | None = Field(
        None,
        description="model.module only: classify (images (B, H, W, C) -> logits (B, classes)), "
        "lm (int32 tokens (B, T) -> logits (B, T, vocab)) or regress (float features (B, F) -> "
        "predictions (B, num_outputs); data: synthetic or npz); default classify",
    )
    loss: str | None = Field(
        None,
        description="the loss minimised: cross_entropy (metric accuracy), mse (metric mae) or "
        "'package.module:function', where function(outputs, targets) -> (per-example losses, "
        "{metric: per-example values}); default: mse for model.task=regress, else "
        "cross_entropy. See README 'Train your model'",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="model constructor options, validated by the model's own schema; "
        "num_classes, vocab_size, image_size and in_channels come from the data if unset (for "
        "model.module: when build takes a parameter of that name)",
    )

    @pydantic.model_validator(mode="after")
    def _one_model(self) -> Model:
        if self.module is not None and self.name is not None:
            raise ValueError(
                f"set model.name or model.module, not both (got name={self.name!r}, "
                f"module={self.module!r}). Fix: drop model.name to train your own module"
            )
        if self.module is None:
            if self.task is not None:
                raise ValueError(
                    f"model.task={self.task!r} applies to model.module only (a registered model "
                    "has its own task). Fix: drop model.task"
                )
            self.name = self.name or "revnet38"
        return self

    def spec(self) -> Any:
        """The :class:`models.ModelSpec` to build: the registered ``name``'s or ``module``'s.

        Raises:
          ValueError: an unknown name, or a module that cannot be imported or used
            (:class:`models.ModuleError`, naming ``model.module`` and the fix).
        """
        import models

        if self.module is not None:
            return models.from_module(self.module, task=self.task or "classify")
        return models.get(self.name or "")

    @property
    def label(self) -> str:
        """How logs call the model: its registered name or its module reference."""
        return self.module or self.name or ""


class Synthetic(_Section):
    """Shape of the synthetic data set (``data.source: synthetic``), for benchmarks."""

    num_examples: PositiveInt = Field(2048, description="training examples (or token windows)")
    image_shape: tuple[PositiveInt, PositiveInt, PositiveInt] = Field(
        (32, 32, 3), description="(H, W, C) of each image, classification only"
    )
    num_classes: PositiveInt = Field(10, description="classes, classification only")
    vocab_size: PositiveInt = Field(256, description="token ids, language modelling only")
    features: PositiveInt = Field(
        8, description="regression only (model.task=regress): features per example"
    )
    outputs: PositiveInt = Field(
        1, description="regression only: targets per example (x @ w + 0.1 noise)"
    )


class Tokens(_Section):
    """A flat binary file of token ids (``data.source: tokens``), memory-mapped, never loaded."""

    dtype: Literal["uint16", "int32"] = Field(
        "uint16", description="dtype of each token id in the file (native byte order, no header)"
    )
    vocab_size: PositiveInt | None = Field(
        None,
        description="token ids are 0 .. vocab_size-1; null: one streaming pass over the file "
        "finds the largest id at start-up (set it to skip that pass)",
    )


_SOURCE_NAMES = tuple(DATA_SOURCES)
_PATH_SOURCES = "/".join(name for name, s in DATA_SOURCES.items() if s.needs_path)


class Data(_Section):
    """Where the examples come from, how they are augmented, and how they are batched."""

    source: Literal[_SOURCE_NAMES] = Field(
        "digits",
        description="; ".join(f"{name}: {s.description}" for name, s in DATA_SOURCES.items()),
    )
    path: UserPath | None = Field(
        None, description=f"file or directory for {_PATH_SOURCES} (~ is the home directory)"
    )
    batch_size: PositiveInt | None = Field(
        128, description="global batch size (all devices, all processes)"
    )
    batch_size_per_device: PositiveInt | None = Field(
        None, description="per-device batch size; global = this x mesh size (overrides batch_size)"
    )
    seq_len: PositiveInt = Field(128, description="tokens per example, language modelling only")
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="held-out share when the source has no test split"
    )
    split_seed: int = Field(0, description="seed of the fixed train/test split")
    augment: Literal["none", "crop_flip"] = Field(
        "none",
        description="training images only: crop_flip pads 4 pixels (black), takes a random crop "
        "of the original size and flips it left-right with probability 1/2 (the RevNet / ResNet "
        "CIFAR augmentation), drawn per (train.seed, step) so a resumed run sees the same crops",
    )
    normalize: Literal["none", "per_channel"] = Field(
        "none",
        description="images: per_channel subtracts the training split's per-channel mean and "
        "divides by its standard deviation (train and test alike); none keeps pixels in [0, 1]",
    )
    prefetch: NonNegativeInt = safe_field(
        2, description="training batches grain reads ahead of the step (0: read in the loop)"
    )
    read_threads: PositiveInt = safe_field(
        1, description="grain threads that read and augment the prefetched batches"
    )
    tokens: Tokens = Field(default_factory=Tokens)  # type: ignore[arg-type]
    synthetic: Synthetic = Field(default_factory=Synthetic)  # type: ignore[arg-type]

    @pydantic.model_validator(mode="after")
    def _check(self) -> Data:
        source = DATA_SOURCES[self.source]
        if source.needs_path and not self.path:
            raise ValueError(f"data.source={self.source!r} needs data.path (a file or directory)")
        if self.batch_size is None and self.batch_size_per_device is None:
            raise ValueError("set data.batch_size (global) or data.batch_size_per_device")
        if source.token_data:
            for key in ("augment", "normalize"):
                if getattr(self, key) != "none":
                    raise ValueError(
                        f"data.{key}={getattr(self, key)!r} applies to images; data.source="
                        f"{self.source!r} is token data. Fix: drop data.{key}"
                    )
        return self


class Optim(_Section):
    """The optax optimizer, learning-rate schedule, clipping and weight decay."""

    name: Literal["sgd", "adamw"] = Field("sgd", description="sgd (with momentum) or adamw")
    lr: PositiveFinite = Field(0.1, description="peak learning rate")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="sgd momentum (0 = plain sgd)")
    nesterov: bool = Field(False, description="sgd: Nesterov momentum")
    b1: float = Field(0.9, ge=0.0, lt=1.0, description="adamw beta1")
    b2: float = Field(0.999, ge=0.0, lt=1.0, description="adamw beta2")
    eps: PositiveFinite = Field(1e-8, description="adamw epsilon")
    weight_decay: float = Field(0.0, ge=0.0, description="decoupled weight decay")
    decay_exclude: list[str] = Field(
        ["bias", "scale"],
        description="parameters weight decay skips: each entry is an fnmatch glob matched against "
        "the parameter's path joined by '/' (blocks/attn/query/bias) and against its name (the "
        "last component); a parameter is not decayed if any entry matches. The default spares "
        "biases and norm scales however they are stacked (kernels and embeddings decay); [] "
        "decays every parameter",
    )
    schedule_steps: PositiveInt | None = Field(
        None,
        description="steps the learning-rate schedule spans (the cosine decay length); null: "
        "train.steps. To extend a finished run, raise train.steps and set this to the old total "
        "so the schedule is not stretched",
    )
    schedule: Literal["constant", "cosine"] = Field(
        "cosine", description="lr after warm-up: constant, or cosine decay to final_lr_fraction"
    )
    warmup_steps: NonNegativeInt = Field(0, description="linear warm-up from 0 to lr")
    final_lr_fraction: float = Field(0.0, ge=0.0, le=1.0, description="cosine end lr / lr")
    clip_norm: PositiveFinite | None = Field(None, description="clip gradients to this global norm")


class Profile(_Section):
    """A ``jax.profiler`` trace of a window of train steps (``train.profile``)."""

    start: NonNegativeInt = Field(
        description="steps taken before the trace starts (a run resumed past it is not traced)"
    )
    steps: PositiveInt = Field(3, description="steps traced")


class Train(_Section):
    """Length of the run, logging, evaluation, precision and failure handling."""

    steps: PositiveInt = safe_field(
        1000,
        description="optimizer steps of the whole run; raising it resumes a finished run (with "
        "optim.schedule_steps set to the old total, else a cosine schedule would stretch)",
    )
    seed: int = Field(0, description="seed of init, dropout and data order")
    log_every: PositiveInt = safe_field(50, description="steps between log lines (host syncs)")
    eval_every: NonNegativeInt = safe_field(
        0, description="steps between evaluations on the test split (0 = only at the end)"
    )
    eval_batches: PositiveInt | None = safe_field(
        None, description="batches per evaluation (default: the whole test split)"
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the forward/backward; master weights stay float32"
    )
    grad_accum: PositiveInt = Field(
        1,
        description="gradient accumulation: each step splits the global batch into this many "
        "micro-batches, runs forward and backward on one at a time (lax.scan) and applies the "
        "mean gradient once: the update of the whole batch with one micro-batch's activation "
        "memory (BatchNorm sees micro-batch statistics). data.batch_size / grad_accum must "
        "split over the mesh's devices",
    )
    on_nonfinite: Literal["halt", "skip"] = Field(
        "halt",
        description="NaN/Inf loss or gradient: halt keeping the last good checkpoint, or skip "
        "the update",
    )
    verify_donation: bool = safe_field(
        True, description="check the compiled step aliases the state and old buffers are freed"
    )
    offload_on_cpu: Literal["warn", "error"] = Field(
        "warn",
        description="a remat plan offloads to host memory on a CPU backend, which has one memory "
        "(nothing moves): warn once and run, or refuse",
    )
    update_in_backward: bool = safe_field(
        False,
        description="apply the optimizer to each block's parameters inside the backward pass, as "
        "soon as its gradient is known, so the full gradient never exists (rn.fused_update_step; "
        "the scanned, nested or reversible transformer, the RevNets, the ResNets with "
        "scan_units; optim.clip_norm costs a "
        "second backward pass; no train.grad_accum, on_nonfinite=skip or dropout); the same "
        "state as the "
        "two-phase step, so either resumes the other",
    )
    progress: Literal["auto", "on", "off"] = safe_field(
        "auto", description="tqdm progress bar (auto: only on a TTY)"
    )
    plot: bool = safe_field(True, description="write plot.png of the curves at the end")
    profile: Profile | None = safe_field(
        None,
        description="{start: N, steps: M}: a jax.profiler trace of steps N+1..N+M in "
        "<run_dir>/profile, for TensorBoard's profile tab or the Perfetto UI "
        "(perfetto_trace.json.gz); see README 'Trainer features'",
    )
    tensorboard: bool = safe_field(
        True,
        description="also write the metrics as TensorBoard scalars to <run_dir>/tensorboard "
        "(rebuilt from metrics.jsonl when a run starts, so a resumed run continues one stream); "
        "view with tensorboard --logdir <run_dir>/tensorboard",
    )
    compile_cache: str | None = safe_field(
        "~/.cache/remat_nn/jax",
        description="JAX persistent compilation cache directory, so a rerun (a resume) skips "
        "XLA compilation (the train step's too: its drift checks report in its metrics, not "
        "by host callbacks, which JAX never stores); ~ is the user's home, a relative path "
        "the working directory's (null: off)",
    )


class Checkpoint(_Section):
    """Orbax checkpointing of the whole train state and the data position."""

    every: PositiveInt = Field(100, description="steps between checkpoints (and at the end)")
    every_minutes: PositiveFinite | None = Field(
        None,
        description="also checkpoint when this many minutes of wall time have passed since the "
        "last save (or the start); checked after each step (with several processes: at log "
        "steps, on process 0's clock). null: by steps only",
    )
    keep: PositiveInt = Field(3, description="keep the last K checkpoints")
    keep_best: NonNegativeInt = Field(
        0, description="also keep the best K by best_metric (0 = off); needs train.eval_every"
    )
    best_metric: Literal["eval_accuracy", "eval_loss"] = Field(
        "eval_accuracy", description="metric ranking checkpoints for keep_best"
    )
    async_save: bool = Field(True, description="write checkpoints in a background thread")


class Mesh(_Section):
    """Device mesh: batches split over data x fsdp, params and optimizer state over fsdp."""

    data: int = Field(-1, description="data-parallel axis size (-1: all remaining devices)")
    fsdp: int = Field(1, description="FSDP axis size (-1: all remaining devices)")
    fsdp_min_size: NonNegativeInt = Field(
        1024, description="arrays with fewer elements stay replicated"
    )

    @pydantic.model_validator(mode="after")
    def _check(self) -> Mesh:
        for axis in ("data", "fsdp"):
            v = getattr(self, axis)
            if v == 0 or v < -1:
                raise ValueError(f"mesh.{axis} must be a positive size or -1, got {v}")
        if self.data == -1 and self.fsdp == -1:
            raise ValueError("at most one of mesh.data / mesh.fsdp may be -1")
        return self


class Distributed(_Section):
    """Multi-process setup (``jax.distributed.initialize``); flags and JAX_* env also work."""

    coordinator_address: str | None = Field(None, description="host:port of process 0")
    num_processes: PositiveInt | None = Field(None, description="number of processes")
    process_id: NonNegativeInt | None = Field(None, description="this process's id")
    heartbeat_timeout: PositiveInt = Field(
        30, description="seconds after which a silent process counts as dead and the run aborts"
    )


class InitFrom(_Section):
    """Start a fresh run from another run's checkpoint (ignored once this run has saved)."""

    path: UserPath = Field(
        description="the source: a run directory, its checkpoints/ directory (the newest "
        "finished step is taken) or one step directory (~ is the home directory)"
    )
    what: Literal["params", "all"] = Field(
        "params",
        description="params: the model's parameters and BatchNorm statistics, with a fresh "
        "optimizer state, step 0 and this run's rng (fine-tuning); all: the whole train state "
        "(optimizer state, step and rng too), so the run goes on at the source's step on its "
        "schedule, with this run's data order from its start",
    )


class Config(_Section):
    """A whole run. Sections: model, remat, data, optim, train, checkpoint, mesh, distributed."""

    name: str = safe_field("run", description="run name; default run_dir is runs/<name>")
    run_dir: UserPath | None = safe_field(
        None, description="where checkpoints, metrics and plots go (~ is the home directory)"
    )
    model: Model = Field(default_factory=Model)  # type: ignore[arg-type]
    remat: str | dict[str, Any] | None = Field(
        None,
        description="remat plan of the model: none, a preset name of the model, a remat_nn "
        "policy name or alias (dots, dots_no_batch, ...), {save: [...], offload: [...], "
        "recompute: [...], default: recompute|save}, or {policy: auto, budget: 2GiB} for the "
        "plan the budget planner picks (budget in B/KiB/MiB/GiB, or a fraction of no remat; "
        "below every plan it falls back on the model's forms, e.g. the transformer's "
        "reversible: variants: {label: {options}} adds one, {label: null} drops one, {} none)",
    )
    data: Data = Field(default_factory=Data)  # type: ignore[arg-type]
    optim: Optim = Field(default_factory=Optim)  # type: ignore[arg-type]
    train: Train = Field(default_factory=Train)  # type: ignore[arg-type]
    checkpoint: Checkpoint = safe_field(default_factory=Checkpoint)  # type: ignore[arg-type]
    init_from: InitFrom | None = safe_field(
        None,
        description="{path: ..., what: params|all}: initialise a fresh run from another run's "
        "checkpoint instead of the model's init (see init_from.path, init_from.what); ignored "
        "once the run has a checkpoint of its own",
    )
    mesh: Mesh = Field(default_factory=Mesh)  # type: ignore[arg-type]
    distributed: Distributed = safe_field(default_factory=Distributed)  # type: ignore[arg-type]
    # What parse_remat made of `remat`: the request (None: invalid) and the problems.
    _remat_parsed: tuple[RematRequest | None, list[tuple[str, str]]] = pydantic.PrivateAttr(
        default=(None, [])
    )

    @pydantic.field_validator("remat", mode="before")
    @classmethod
    def _remat_form(cls, v: Any) -> Any:
        # One message instead of one per member of the union.
        if v is not None and not isinstance(v, str | dict):
            raise ValueError(
                f"must be a preset name (e.g. full) or a plan mapping {{save: [...], offload: "
                f"[...], recompute: [...], default: recompute}}, got {type(v).__name__} {v!r}"
            )
        return v

    @pydantic.model_validator(mode="after")
    def _parse_remat(self) -> Config:
        # Never raises: load_config lists the problems with the registry's (same order).
        self._remat_parsed = parse_remat(self.remat, self.model.options)
        return self

    @property
    def remat_request(self) -> RematRequest:
        """The remat request ``remat`` (or the model's own ``remat`` option) makes, parsed once.

        Raises:
          ValueError: the request is invalid (:func:`load_config` reports why).
        """
        request, problems = self._remat_parsed
        if request is None:
            why = "".join(f"; {path}: {msg}" for path, msg in problems).rstrip(".")
            raise ValueError(
                f"remat={self.remat!r} (model.options={self.model.options!r}) is not a valid "
                f"request{why}. Fix: load the config with train.config.load_config, which checks "
                "it against the model."
            )
        return request

    @property
    def remat_parsed(self) -> tuple[RematRequest | None, list[tuple[str, str]]]:
        """What :func:`~train.config.parse_remat` made of ``remat``: the request (None: invalid)
        and the problems of the top-level value, as ``(dotted path, message)`` pairs."""
        return self._remat_parsed

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name
