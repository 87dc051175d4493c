"""Run configuration: YAML validated into typed pydantic models.

A config is one YAML file (``configs/*.yaml``) plus dotted command-line overrides
(``optim.lr=3e-4 train.steps=200``). Every section rejects unknown keys; every error (an unknown
key, a wrong type, a value out of range, a bad model option or remat plan) is collected and
reported at once with its dotted path, as a :class:`ConfigError`.

>>> cfg = load_config(None, ["model.name=transformer", "data.source=corpus", "train.steps=3"])
>>> cfg.train.steps, cfg.optim.lr
(3, 0.1)
>>> load_config(None, ["optim.lr=-1", "train.stepz=3"])
Traceback (most recent call last):
...
train.config.ConfigError: ... 2 errors
  optim.lr: Input should be greater than 0 (got -1)
  train.stepz: unknown key; did you mean 'train.steps'? ...
"""

from __future__ import annotations

import difflib
import re
import textwrap
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

__all__ = [
    "Checkpoint",
    "Config",
    "ConfigError",
    "Data",
    "Distributed",
    "Mesh",
    "Model",
    "Optim",
    "Synthetic",
    "Train",
    "YamlLoader",
    "apply_overrides",
    "dump_config",
    "load_config",
]


class ConfigError(ValueError):
    """A config that does not validate; ``errors`` holds ``(dotted_path, message)`` pairs.

    Example of the wrong config and the fix::

        optim: {lr: -1, momentun: 0.9}     # 2 errors: optim.lr out of range, optim.momentun unknown
        optim: {lr: 0.1, momentum: 0.9}    # fix
    """

    def __init__(self, source: str, errors: Sequence[tuple[str, str]]):
        self.source = source
        self.errors = list(errors)
        n = len(self.errors)
        lines = [f"{source}: {n} error{'s' if n != 1 else ''}"]
        lines += [f"  {path or '<root>'}: {msg}" for path, msg in self.errors]
        super().__init__("\n".join(lines))


# --- YAML ---------------------------------------------------------------------------------------


class YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats such as ``1e-3`` as floats.

    YAML 1.1 (PyYAML) requires a dot in a float, so ``lr: 1e-3`` would be the string ``"1e-3"``.
    """


_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)
    |[-+]?(?:[0-9][0-9_]*)\.[0-9_]*
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))

# Plain scalars YAML 1.1 (PyYAML) and YAML 1.2 read differently: rejected, never guessed.
_BOOL_TAG, _INT_TAG, _FLOAT_TAG = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
_OCTAL_LIKE = re.compile(r"^[-+]?0[0-9_]+$")  # 010: octal 8 in YAML 1.1, decimal 10 in 1.2
_MAX_NODES = 100_000  # alias expansion ("billion laughs") stops here

_TAB_HINT = "YAML does not allow tabs for indentation; indent with spaces"


def _yaml_error(e: yaml.YAMLError) -> str:
    # PyYAML's messages span several lines (with a snippet and a caret): one line here.
    if isinstance(e, yaml.MarkedYAMLError):
        parts = [p for p in (e.context, e.problem) if p]
        mark = e.problem_mark or e.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        text = " ".join(", ".join(parts).split()) + where
        if "'\\t'" in text:
            text += f"; {_TAB_HINT}"
        return f"not valid YAML: {text}"
    return "not valid YAML: " + " ".join(str(e).split())


class _Builder:
    """Builds Python values from a composed YAML node tree, collecting errors by dotted path.

    On top of ``yaml.load``: duplicate keys (PyYAML keeps the last one silently), non-string
    keys, ``yes``/``no``/``on``/``off`` booleans, octal-looking and sexagesimal numbers, and
    recursive or exploding aliases are errors with the dotted path of the value.
    """

    def __init__(self, loader: YamlLoader, prefix: str = ""):
        self.loader = loader
        self.prefix = prefix
        self.errors: list[tuple[str, str]] = []
        self.nodes = 0
        self.flattened: set[int] = set()

    def error(self, path: str, msg: str) -> None:
        self.errors.append((path or self.prefix, msg))

    def build(self, node: yaml.Node, path: str, stack: tuple[int, ...] = ()) -> Any:
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            raise _TooLarge
        if id(node) in stack:
            self.error(path, "a YAML alias refers to its own anchor (a recursive value)")
            return None
        stack = (*stack, id(node))
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, stack)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(n, _join(path, str(i)), stack) for i, n in enumerate(node.value)]
        return self._scalar(node, path)

    def _scalar(self, node: yaml.ScalarNode, path: str) -> Any:
        value = self.loader.construct_object(node, deep=True)
        text = node.value
        if node.tag == _BOOL_TAG and text.lower() not in ("true", "false"):
            self.error(
                path,
                f"{text!r} is the boolean {str(value).lower()} in YAML 1.1 but the string "
                f"{text!r} in YAML 1.2; write {str(value).lower()} for a boolean, or quote it "
                f"({text!r}) for a string",
            )
        elif node.tag == _INT_TAG and _OCTAL_LIKE.match(text):
            self.error(
                path,
                f"{text} has a leading zero: octal {value} in YAML 1.1, decimal "
                f"{int(text.replace('_', ''))} in YAML 1.2; write it without the leading zero "
                "(or quote it for a string)",
            )
        elif node.tag in (_INT_TAG, _FLOAT_TAG) and ":" in text:
            self.error(
                path,
                f"{text} is the base-60 number {value} in YAML 1.1; quote it for a string",
            )
        return value

    def _mapping(self, node: yaml.MappingNode, path: str, stack: tuple[int, ...]) -> Any:
        if id(node) not in self.flattened:
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                    continue
                key = key_node.value
                line = key_node.start_mark.line + 1
                if key in first_line:
                    self.error(
                        _join(path, key),
                        f"duplicate key (lines {first_line[key]} and {line}); YAML would keep "
                        "only the last value. Fix: remove one of them",
                    )
                else:
                    first_line[key] = line
            self.loader.flatten_mapping(node)  # `<<: *anchor` merges, as yaml.safe_load does
            self.flattened.add(id(node))
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.error(path, "a key must be a plain name, got a list or mapping as a key")
                continue
            key = self.loader.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                self.error(
                    _join(path, key_node.value),
                    f"key {key_node.value!r} is read as {type(key).__name__} {key!r}, not a "
                    f"name; quote it ('{key_node.value}') or use an option name",
                )
                continue
            out[key] = self.build(value_node, _join(path, key), stack)
        return out


class _TooLarge(Exception):
    pass


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _load_yaml(text: str, source: str, prefix: str = "") -> tuple[Any, list[tuple[str, str]]]:
    """Parses ``text``; returns the value and the errors found (dotted paths under ``prefix``).

    Raises:
      ConfigError: the text is not YAML at all (syntax, several documents, too deep or large).
    """
    loader = YamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, []
        builder = _Builder(loader, prefix)
        value = builder.build(node, prefix)
        return value, builder.errors
    except yaml.YAMLError as e:
        raise ConfigError(source, [(prefix, _yaml_error(e))]) from None
    except RecursionError:
        raise ConfigError(source, [(prefix, "not valid YAML: nested too deeply")]) from None
    except _TooLarge:
        raise ConfigError(
            source, [(prefix, f"YAML aliases expand to more than {_MAX_NODES} values")]
        ) from None
    finally:
        loader.dispose()


# --- schema ---------------------------------------------------------------------------------------


class _Section(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", validate_default=True)


class Model(_Section):
    """Which registered model to train (``models.get(name)``) and its constructor options."""

    name: str = Field("revnet38", description="registered model name (see models.REGISTRY)")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="model constructor options, validated by the model's own schema; "
        "num_classes, vocab_size, image_size and in_channels come from the data if unset",
    )


class Synthetic(_Section):
    """Shape of the synthetic data set (``data.source: synthetic``), for benchmarks."""

    num_examples: PositiveInt = Field(2048, description="training examples (or token windows)")
    image_shape: tuple[PositiveInt, PositiveInt, PositiveInt] = Field(
        (32, 32, 3), description="(H, W, C) of each image, classification only"
    )
    num_classes: PositiveInt = Field(10, description="classes, classification only")
    vocab_size: PositiveInt = Field(256, description="token ids, language modelling only")


class Data(_Section):
    """Where the examples come from and how they are batched."""

    source: Literal["digits", "cifar10", "mnist", "npz", "text", "corpus", "synthetic"] = Field(
        "digits",
        description="digits: scikit-learn's bundled 8x8 digits (embedded default); cifar10: a "
        "CIFAR-10 python-pickle directory; mnist: a directory of MNIST IDX files; npz: arrays "
        "x_train/y_train[/x_test/y_test]; text: a plain text file (byte-level LM); corpus: the "
        "Python docs text shipped with every Python (byte-level LM); synthetic: random data",
    )
    path: str | None = Field(None, description="file or directory for cifar10/mnist/npz/text")
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
    synthetic: Synthetic = Field(default_factory=Synthetic)  # type: ignore[arg-type]

    @pydantic.model_validator(mode="after")
    def _check(self) -> Data:
        needs_path = {"cifar10", "mnist", "npz", "text"}
        if self.source in needs_path and not self.path:
            raise ValueError(f"data.source={self.source!r} needs data.path (a file or directory)")
        if self.batch_size is None and self.batch_size_per_device is None:
            raise ValueError("set data.batch_size (global) or data.batch_size_per_device")
        return self


class Optim(_Section):
    """The optax optimizer, learning-rate schedule, clipping and weight decay."""

    name: Literal["sgd", "adamw"] = Field("sgd", description="sgd (with momentum) or adamw")
    lr: PositiveFloat = Field(0.1, description="peak learning rate")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="sgd momentum (0 = plain sgd)")
    nesterov: bool = Field(False, description="sgd: Nesterov momentum")
    b1: float = Field(0.9, ge=0.0, lt=1.0, description="adamw beta1")
    b2: float = Field(0.999, ge=0.0, lt=1.0, description="adamw beta2")
    eps: PositiveFloat = Field(1e-8, description="adamw epsilon")
    weight_decay: float = Field(0.0, ge=0.0, description="decoupled weight decay")
    decay_exclude: list[str] = Field(
        ["bias", "scale"],
        description="parameters not decayed: fnmatch globs on the '/'-joined path or the name",
    )
    schedule_steps: PositiveInt | None = Field(
        None, description="steps the lr schedule spans (default train.steps; set to extend a run)"
    )
    schedule: Literal["constant", "cosine"] = Field(
        "cosine", description="lr after warm-up: constant, or cosine decay to final_lr_fraction"
    )
    warmup_steps: NonNegativeInt = Field(0, description="linear warm-up from 0 to lr")
    final_lr_fraction: float = Field(0.0, ge=0.0, le=1.0, description="cosine end lr / lr")
    clip_norm: PositiveFloat | None = Field(None, description="clip gradients to this global norm")


class Train(_Section):
    """Length of the run, logging, evaluation, precision and failure handling."""

    steps: PositiveInt = Field(1000, description="optimizer steps of the whole run")
    seed: int = Field(0, description="seed of init, dropout and data order")
    log_every: PositiveInt = Field(50, description="steps between log lines (host syncs)")
    eval_every: NonNegativeInt = Field(
        0, description="steps between evaluations on the test split (0 = only at the end)"
    )
    eval_batches: PositiveInt | None = Field(
        None, description="batches per evaluation (default: the whole test split)"
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the forward/backward; master weights stay float32"
    )
    on_nonfinite: Literal["halt", "skip"] = Field(
        "halt",
        description="NaN/Inf loss or gradient: halt keeping the last good checkpoint, or skip "
        "the update",
    )
    verify_donation: bool = Field(
        True, description="check the compiled step aliases the state and old buffers are freed"
    )
    offload_on_cpu: Literal["warn", "error"] = Field(
        "warn",
        description="a remat plan offloads to host memory on a CPU backend, which has one memory "
        "(nothing moves): warn once and run, or refuse",
    )
    progress: Literal["auto", "on", "off"] = Field(
        "auto", description="tqdm progress bar (auto: only on a TTY)"
    )
    plot: bool = Field(True, description="write plot.png of the curves at the end")
    compile_cache: str | None = Field(
        "runs/.jax_compile_cache",
        description="JAX persistent compilation cache directory, so a rerun (a resume) skips "
        "XLA compilation (null: off)",
    )


class Checkpoint(_Section):
    """Orbax checkpointing of the whole train state and the data position."""

    every: PositiveInt = Field(100, description="steps between checkpoints (and at the end)")
    keep: PositiveInt = Field(3, description="keep the last K checkpoints")
    keep_best: NonNegativeInt = Field(
        1, description="also keep the best K by best_metric (0 = off); needs eval_every"
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


class Config(_Section):
    """A whole run. Sections: model, remat, data, optim, train, checkpoint, mesh, distributed."""

    name: str = Field("run", description="run name; default run_dir is runs/<name>")
    run_dir: str | None = Field(None, description="where checkpoints, metrics and plots go")
    model: Model = Field(default_factory=Model)  # type: ignore[arg-type]
    remat: str | dict[str, Any] | None = Field(
        None,
        description="remat plan of the model: a preset name, {save: [...], offload: [...], "
        "recompute: [...], default: recompute|save}, or {policy: auto, budget: 2GiB} for the "
        "plan the budget planner picks (budget in B/KiB/MiB/GiB, or a fraction of no remat)",
    )
    data: Data = Field(default_factory=Data)  # type: ignore[arg-type]
    optim: Optim = Field(default_factory=Optim)  # type: ignore[arg-type]
    train: Train = Field(default_factory=Train)  # type: ignore[arg-type]
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)  # type: ignore[arg-type]
    mesh: Mesh = Field(default_factory=Mesh)  # type: ignore[arg-type]
    distributed: Distributed = Field(default_factory=Distributed)  # type: ignore[arg-type]

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

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name

    def model_options(self) -> dict[str, Any]:
        """The model options with the top-level ``remat`` plan folded in."""
        return _fold_remat(self.model.options, self.remat)


_AUTO_KEYS = {"policy", "budget", "allow", "host_bandwidth", "flops_per_second", "memory_bandwidth"}


def _auto_plan_errors(remat: dict[str, Any]) -> list[tuple[str, str]]:
    # `remat: {policy: auto, budget: 2GiB, allow: [...], host_bandwidth: .., flops_per_second: ..,
    # memory_bandwidth: ..}`
    import remat_nn as rn

    errors = [(f"remat.{k}", f"unknown key for policy: auto; valid: {sorted(_AUTO_KEYS)}")
              for k in remat if k not in _AUTO_KEYS]  # fmt: skip
    if "budget" not in remat:
        errors.append(("remat.budget", "policy: auto needs a budget, e.g. budget: 2GiB or 0.5"))
    else:
        try:
            rn.parse_budget(remat["budget"], reference_bytes=1)
        except (TypeError, ValueError) as e:
            errors.append(("remat.budget", str(e)))
    allow = remat.get("allow", ["save"])
    if (
        not isinstance(allow, list)
        or "save" not in allow
        or not set(allow) <= set(("save", "offload", "recompute"))
    ):
        hint = ""
        if isinstance(allow, list) and "invert" in allow:
            hint = "; invert is not per name: build a reversible model (model.options.reversible)"
        errors.append(
            ("remat.allow", f"must list 'save' and any of offload, recompute; got {allow!r}{hint}")
        )
    for k in ("host_bandwidth", "flops_per_second", "memory_bandwidth"):
        v = remat.get(k, 1.0)
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            errors.append((f"remat.{k}", f"must be a positive number, got {v!r}"))
    return errors


def _fold_remat(options: dict[str, Any], remat: Any) -> dict[str, Any]:
    # `remat: <preset>` -> options.remat; `remat: {save: [...]}` -> remat="custom", custom_plan.
    opts = dict(options)
    if isinstance(remat, str):
        opts["remat"] = remat
    elif isinstance(remat, dict) and remat.get("policy") == "auto":
        pass  # planned at the start of the run (train/autoplan.py), then folded in
    elif isinstance(remat, dict):
        opts["remat"] = "custom"
        opts["custom_plan"] = dict(remat)
    return opts


# --- loading --------------------------------------------------------------------------------------


def _parse_value(text: str, key: str) -> tuple[Any, list[tuple[str, str]]]:
    # An override's value is YAML, checked like a file's; what is not YAML stays a string.
    try:
        return _load_yaml(text, "<override>", key)
    except ConfigError:
        return text, []


def apply_overrides(tree: dict[str, Any], overrides: Iterable[str]) -> list[tuple[str, str]]:
    """Sets ``key.sub=value`` overrides in ``tree`` in place; returns errors for malformed ones.

    Values are YAML (``3``, ``1e-3``, ``true``, ``[a, b]``, ``{save: [x]}``); ``key.sub=null``
    sets None.
    """
    errors: list[tuple[str, str]] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not p for p in key.split(".")):
            errors.append((key or item, f"cannot read override {item!r}; expected key.sub=value"))
            continue
        *parents, leaf = key.split(".")
        node = tree
        for i, p in enumerate(parents):
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                where = ".".join(parents[: i + 1])
                errors.append((key, f"{where} is {child!r}, not a section; cannot set {key}"))
                break
            node = child
        else:
            node[leaf], value_errors = _parse_value(value, key)
            errors += value_errors
    return errors


def _dotted(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc)


def _fields_at(model: type[pydantic.BaseModel], loc: Sequence[Any]) -> list[str]:
    # The field names valid at `loc`'s parent, for did-you-mean hints.
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, pydantic.BaseModel)):
            return []
        cls = ann
    return list(getattr(cls, "model_fields", {}))


def _pydantic_errors(
    e: pydantic.ValidationError, model: type[pydantic.BaseModel], prefix: str = ""
) -> list[tuple[str, str]]:
    out = []
    for err in e.errors(include_url=False):
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        path = ".".join(filter(None, [prefix, _dotted(loc)]))
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(loc[-1]), _fields_at(model, loc), n=1)
            hint = f" did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else ""
            known = ", ".join(_fields_at(model, loc))
            out.append((path, f"unknown key;{hint} known keys: {known}"))
            continue
        msg = err["msg"].removeprefix("Value error, ")
        scalar = not isinstance(err.get("input"), dict | list)
        if loc and "input" in err and scalar and err["type"] not in ("missing", "model_type"):
            msg += f" (got {err['input']!r})"
        out.append((path, msg))
    return out


def _check_against_registry(
    model: Model, remat: Any, source: str | None, seq_len: int | None
) -> list[tuple[str, str]]:
    # The model name and its options are validated by the model's own schema (models registry).
    import models

    if not model.name:
        return []  # the model section itself failed; its errors are already listed
    try:
        spec = models.get(model.name)
    except ValueError as e:
        return [("model.name", str(e))]
    errors: list[tuple[str, str]] = []
    fields = spec.options.model_fields
    if remat is not None:
        if "remat" not in fields:
            errors.append(("remat", f"model {model.name!r} takes no remat plan option"))
        elif "remat" in model.options:
            errors.append(("remat", "set either remat or model.options.remat, not both"))
    if isinstance(remat, dict) and remat.get("policy") == "auto":
        errors += _auto_plan_errors(remat)
    elif isinstance(remat, dict):
        import remat_nn as rn

        try:
            rn.plan(remat)
        except rn.PlanError as e:
            errors.append(("remat", str(e)))
    plan_reported = bool(errors) and errors[-1][0] == "remat"
    opts = _fold_remat(model.options, remat)
    try:
        spec.options.model_validate(opts)
    except pydantic.ValidationError as e:
        for path, msg in _pydantic_errors(e, spec.options, "model.options"):
            if path.startswith("model.options.custom_plan") and remat is not None:
                path = "remat" + path.removeprefix("model.options.custom_plan")
            if plan_reported and path == "model.options" and "plan" in msg:
                continue  # the model's own plan check repeats the error listed under `remat`
            if remat is not None and path == "model.options" and "remat" in msg:
                path = "remat"
            errors.append((path, msg))
    lm_sources = {"text", "corpus", "synthetic"}
    image_sources = {"digits", "cifar10", "mnist", "npz", "synthetic"}
    allowed = lm_sources if spec.task == "lm" else image_sources
    if source is not None and source not in allowed:
        errors.append(
            (
                "data.source",
                f"{source!r} does not fit model {model.name!r} (task {spec.task!r}); "
                f"use one of {sorted(allowed)}",
            )
        )
    max_len = opts.get("max_len", getattr(fields.get("max_len"), "default", None))
    if spec.task == "lm" and isinstance(max_len, int) and seq_len and seq_len > max_len:
        errors.append(("data.seq_len", f"{seq_len} exceeds the model's max_len={max_len}"))
    return errors


def _registry_inputs(tree: dict[str, Any], cfg: Config | None) -> tuple[Any, ...]:
    # The registry checks run even when other sections fail, so all errors show at once.
    if cfg is not None:
        return cfg.model, cfg.remat, cfg.data.source, cfg.data.seq_len
    try:
        model = Model.model_validate(tree.get("model") or {})
    except pydantic.ValidationError:
        return Model.model_construct(name="", options={}), None, None, None
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    source = data.get("source", "digits") if isinstance(data.get("source", ""), str) else None
    seq_len = data.get("seq_len", 128) if isinstance(data.get("seq_len", 0), int) else None
    remat = tree.get("remat") if isinstance(tree.get("remat"), str | dict) else None
    return model, remat, source, seq_len


def _read_text(p: Path, source: str) -> str:
    # Every way a config path can fail to be a readable UTF-8 file is a ConfigError.
    if p.is_dir():
        raise ConfigError(source, [("", f"{str(p)!r} is a directory, not a YAML config file")])
    if not p.is_file():
        raise ConfigError(source, [("", f"no such config file {str(p)!r}")])
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(source, [("", f"cannot read {str(p)!r}: {e.strerror or e}")]) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            source,
            [("", f"not UTF-8 text: byte 0x{data[e.start]:02x} at line {line} (offset "
                  f"{e.start}). Fix: save the file as UTF-8")],
        ) from None  # fmt: skip


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Reads ``path`` (YAML; None for the defaults), applies overrides and validates.

    Args:
      path: the YAML file.
      overrides: ``key.sub=value`` strings, applied in order.

    Returns:
      The validated :class:`Config`; ``name`` defaults to the file's stem.

    Raises:
      ConfigError: every problem found, each with its dotted path.
    """
    source = str(path) if path is not None else "<defaults>"
    tree: Any = {}
    errors: list[tuple[str, str]] = []
    if path is not None:
        p = Path(path)
        tree, errors = _load_yaml(_read_text(p, source), source)
        if tree is None:
            raise ConfigError(
                source,
                [("", "the file holds no settings (it is empty or only comments). Fix: write "
                      "the sections to change (model:, data:, optim:, ...), or omit --config "
                      "to run with the defaults")],
            )  # fmt: skip
        if not isinstance(tree, dict):
            raise ConfigError(
                source,
                [("", f"the top level must be a mapping of sections (model:, data:, optim:, "
                      f"...), got a {type(tree).__name__}")],
            )  # fmt: skip
        tree.setdefault("name", p.stem)
    errors += apply_overrides(tree, overrides)
    # A value already reported (a duplicate key, `yes`, `010`) is not reported again by the schema.
    reported = {p for p, _ in errors}
    cfg = None
    try:
        cfg = Config.model_validate(tree)
    except pydantic.ValidationError as e:
        errors += [err for err in _pydantic_errors(e, Config) if err[0] not in reported]
    errors += _check_against_registry(*_registry_inputs(tree, cfg))
    if errors or cfg is None:
        raise ConfigError(source, errors or [("", "invalid config")])
    assert cfg is not None
    return cfg


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (what ``config.yaml`` in the run directory holds)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _type_name(ann: Any) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " | ".join(map(str, args))
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return "null" if ann is type(None) else getattr(ann, "__name__", str(ann))


def describe_options() -> str:
    """Every config option with its type, default and meaning (for ``--help``)."""
    lines: list[str] = []

    def walk(model: type[pydantic.BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            lines.append(f"  {prefix}{name}: {_type_name(ann)} (default {default!r})")
            if field.description:
                lines.extend(
                    textwrap.wrap(
                        field.description, 96, initial_indent=" " * 6, subsequent_indent=" " * 6
                    )  # fmt: skip
                )

    walk(Config, "")
    return "\n".join(lines)
