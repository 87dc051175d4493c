"""Config validation: unknown keys, types and ranges, all errors at once with dotted paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import models
from train.config import (
    ConfigError,
    YamlLoader,
    apply_overrides,
    dump_config,
    is_resume_safe,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def errors_of(path=None, overrides=()) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return dict(info.value.errors)


def test_yaml_12_floats_are_floats():
    assert yaml.load("a: 1e-3\nb: 5E+2\nc: 1.5\nd: 3\ne: 1e3x", Loader=YamlLoader) == {
        "a": 0.001,
        "b": 500.0,
        "c": 1.5,
        "d": 3,
        "e": "1e3x",
    }
    assert yaml.safe_load("a: 1e-3") == {"a": "1e-3"}  # what plain PyYAML does


def test_yaml_11_booleans_are_strings_where_the_schema_wants_one(tmp_path):
    # `python -m train --help` lists train.progress as auto|on|off; YAML 1.1 reads on/off as
    # booleans. Where the setting is a string that is the only meaning; where it is a bool the
    # spelling stays an error (yes: true or the string 'yes'?).
    assert load_config(None, ["train.progress=on"]).train.progress == "on"
    path = tmp_path / "mine.yaml"
    path.write_text("train: {progress: off}\n")
    assert load_config(path).train.progress == "off"
    assert "YAML 1.1" in errors_of(None, ["train.plot=yes"])["train.plot"]
    assert "YAML 1.1" in errors_of(None, ["model.options.width=on"])["model.options.width"]


def test_config_file_values_and_overrides(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("optim: {lr: 1e-3, name: adamw}\ntrain: {steps: 10}\n")
    cfg = load_config(
        path,
        ["train.steps=20", "mesh.fsdp=2", "data.batch_size=null", "data.batch_size_per_device=4"],
    )
    assert cfg.name == "mine" and cfg.resolved_run_dir == Path("runs/mine")
    assert cfg.optim.lr == 0.001 and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 20 and cfg.mesh.fsdp == 2 and cfg.data.batch_size is None
    assert "data" in errors_of(None, ["data.batch_size=null"])
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again).model_dump() == cfg.model_dump() | {"name": "mine"}


def test_every_error_is_reported_at_once_with_its_dotted_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "optim: {lr: -1, momentun: 0.9}\n"
        "train: {steps: ten, on_nonfinite: ignore}\n"
        "data: {source: imagenet, test_fraction: 1.5}\n"
        "mesh: {data: 0}\n"
        "bogus: 1\n"
    )
    errs = errors_of(path)
    assert set(errs) == {
        "optim.lr",
        "optim.momentun",
        "train.steps",
        "train.on_nonfinite",
        "data.source",
        "data.test_fraction",
        "mesh",
        "bogus",
    }
    assert "greater than 0" in errs["optim.lr"] and "-1" in errs["optim.lr"]
    assert "did you mean 'optim.momentum'" in errs["optim.momentun"]
    assert "'halt' or 'skip'" in errs["train.on_nonfinite"]
    assert "mesh.data must be a positive size or -1" in errs["mesh"]


def test_a_key_without_its_section_gets_the_dotted_path_as_hint():
    errs = errors_of(None, ["steps=10", "lr=0.1", "stpes=3", "bogus=1"])
    assert "did you mean 'train.steps'?" in errs["steps"]  # not a fuzzy top-level key
    assert "did you mean 'optim.lr'?" in errs["lr"]
    assert "did you mean 'train.steps'?" in errs["stpes"]
    assert "did you mean" not in errs["bogus"]


def test_model_options_are_validated_by_the_models_schema():
    errs = errors_of(None, ["model.name=transformr"])
    assert "did you mean 'transformer'" in errs["model.name"].lower()
    errs = errors_of(
        None,
        [
            "model.name=transformer",
            "data.source=corpus",
            "model.options.d_modle=64",
            "model.options.n_heads=0",
        ],
    )
    assert "unknown key" in errs["model.options.d_modle"]
    assert "greater than 0" in errs["model.options.n_heads"]
    errs = errors_of(None, ["model.name=transformer"])  # the default source is images
    assert "does not fit model 'transformer'" in errs["data.source"]


def test_remat_plan_is_read_once_into_a_plan_and_checked():
    import remat_nn as rn
    from train import remat as remat_lib

    cfg = load_config(
        None,
        [
            "model.name=transformer",
            "data.source=corpus",
            "remat={save: [query_proj], offload: [mlp_hidden]}",
        ],
    )
    assert remat_lib.resolve(cfg.remat_request, cfg.model.spec()) == rn.plan(
        {"save": ["query_proj"], "offload": ["mlp_hidden"]}
    )
    errs = errors_of(
        None,
        [
            "model.name=transformer",
            "data.source=corpus",
            "remat={save: [query_proj], offload: [query_proj]}",
        ],
    )
    assert any(p.startswith("remat") or p.startswith("model.options") for p in errs)


def test_remat_takes_the_librarys_policy_names_and_none_under_scan_levels():
    from train import remat as remat_lib

    def resolved(path, *overrides):
        cfg = load_config(path, list(overrides))
        return remat_lib.resolve(cfg.remat_request, cfg.model.spec())

    lm = ["model.name=transformer", "data.source=corpus"]
    # The transformer refused `dots` ("unknown remat preset"): one vocabulary for every model.
    assert resolved(None, *lm, "remat=dots") == "dots"
    assert resolved(ROOT / "configs/resnet.yaml", "remat=dots_no_batch") == "dots_no_batch"
    message = errors_of(None, [*lm, "remat=dot"])["remat"]
    assert "Did you mean 'dots'?" in message and "dots_with_no_batch_dims_saveable" in message
    # `none` where a nested scan recomputes segments: honoured (each unit without remat), not
    # turned into `full` (the transformer did) nor refused (the ResNet did).
    nested = {
        "transformer.yaml": ["model.options.scan_levels=1"],
        "resnet.yaml": ["model.options.scan_units=true", "model.options.scan_levels=2"],
    }
    for name, options in nested.items():
        cfg = load_config(ROOT / "configs" / name, ["remat=none", *options])
        plan = remat_lib.resolve(cfg.remat_request, cfg.model.spec())
        built = models.resolve_options(cfg.model.spec(), **cfg.model.options, remat=plan)
        assert plan == remat_lib.NO_REMAT and built["remat"] == "none", name


def test_malformed_overrides():
    tree: dict = {"train": 3}
    errs = apply_overrides(tree, ["train.steps=4", "novalue", "a..b=1"])
    assert [p for p, _ in errs] == ["train.steps", "novalue", "a..b"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate_and_say_how_to_run(path):
    cfg = load_config(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# python -m train --config configs/" + path.name), first
    spec = cfg.model.spec()
    assert spec.task in ("classify", "lm")


def test_shipped_configs_use_the_intended_models():
    names = {p.stem: load_config(p).model.name for p in CONFIGS}
    assert names["revnet"].startswith("revnet") and names["resnet"] == "resnet32"
    assert names["transformer"] == names["transformer_offload"] == "transformer"
    assert load_config(ROOT / "configs/revnet.yaml").data.source == "digits"
    assert load_config(ROOT / "configs/transformer_offload.yaml").remat is not None
    cifar = load_config(ROOT / "configs/revnet_cifar.yaml")
    assert names["revnet_cifar"] == "revnet38" and cifar.data.source == "cifar10"
    assert (cifar.data.augment, cifar.data.normalize) == ("crop_flip", "per_channel")
    assert cifar.data.path == str(Path.home() / "data" / "cifar-10-batches-py")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_help_and_config_errors(tmp_path):
    helped = _cli("--help")
    assert helped.returncode == 0
    for option in (
        "--dry-run",
        "--restart",
        "optim.lr",
        "checkpoint.keep_best",
        "mesh.fsdp",
        "train.on_nonfinite",
        "--coordinator",
    ):
        assert option in helped.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {lr: -1}\ntrain: {stepz: 3}\n")
    result = _cli("--config", str(bad), "mesh.fsdp=0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for path in ("optim.lr", "train.stepz", "mesh"):
        assert f"  {path}:" in result.stderr, result.stderr


# --- resume-safe keys: marked on the schema, compared in the effective form -----------------------


def test_the_public_names_stay_importable_from_train_config():
    import train.config as config

    for name in (
        "Config",
        "ConfigError",
        "Optim",
        "Train",
        "Checkpoint",
        "Mesh",
        "Distributed",
        "Data",
        "Model",
        "Synthetic",
        "YamlLoader",
        "apply_overrides",
        "load_config",
        "dump_config",
        "describe_options",
        "safe_field",
        "is_resume_safe",
    ):
        assert name in config.__all__ and getattr(config, name) is not None, name
    assert config.ConfigError.__module__ == "train.config"  # as tracebacks show it


def test_resume_safe_keys_are_read_from_the_schema_marks(monkeypatch):
    from train import run_dir
    from train.config import Train, is_resume_safe, resume_safe_keys

    assert not hasattr(run_dir, "RESUME_SAFE")  # no hand-kept list beside the schema
    for key in (
        "name",
        "run_dir",
        "train.steps",
        "train.log_every",
        "train.eval_every",
        "train.progress",
        "checkpoint.keep",
        "checkpoint.best_metric",
        "distributed.coordinator_address",
        "distributed.process_id",
    ):
        assert is_resume_safe(key), key
    for key in (
        "optim.lr",
        "optim.schedule_steps",
        "optim.decay_exclude",
        "train.seed",
        "train.compute_dtype",
        "model.options.depth",
        "remat",
        "remat.save",
        "mesh.fsdp",
        "optim.decay_all",
        "nosuch",
        "train",
    ):
        assert not is_resume_safe(key), key
    assert "distributed.*" in resume_safe_keys() and "checkpoint.*" in resume_safe_keys()
    # Marking a field is all it takes (and all there is): the mark is what is read.
    monkeypatch.setattr(Train.model_fields["seed"], "json_schema_extra", {"resume_safe": True})
    assert is_resume_safe("train.seed") and "train.seed" in resume_safe_keys()


def test_help_says_which_options_may_change_on_resume():
    from train.config import describe_options

    lines = {
        line.split(":")[0].strip(): line
        for line in describe_options().splitlines()
        if line.startswith("  ") and not line.startswith("   ")
    }
    for key in (
        "train.steps",
        "train.log_every",
        "checkpoint.every",
        "distributed.process_id",
        "name",
    ):
        assert lines[key].endswith("[resume-safe]"), lines[key]
    for key in ("optim.lr", "optim.schedule_steps", "train.seed", "mesh.fsdp", "remat"):
        assert "[resume-safe]" not in lines[key], lines[key]
    assert "[resume-safe] may change when a run resumes" in describe_options()


def _dumped(*overrides: str) -> dict:
    return load_config(None, list(overrides)).model_dump(mode="json")


def test_raising_train_steps_alone_stretches_a_cosine_schedule_and_is_unsafe():
    from train.run_dir import config_diff, config_hash

    old, new = _dumped("train.steps=1000"), _dumped("train.steps=1500")
    unsafe, safe = config_diff(old, new)
    assert unsafe == ["  optim.schedule_steps: 1000 -> 1500"]
    assert safe == ["  train.steps: 1000 -> 1500"]
    assert config_hash(old) != config_hash(new)


def test_extending_with_the_old_schedule_span_is_a_safe_change():
    from train.run_dir import config_diff, config_hash

    old = _dumped("train.steps=1000")
    new = _dumped("train.steps=1500", "optim.schedule_steps=1000")
    assert config_diff(old, new) == ([], ["  train.steps: 1000 -> 1500"])
    assert config_hash(old) == config_hash(new)
    # Writing out the span the old run had implicitly is no change at all.
    assert config_diff(old, _dumped("train.steps=1000", "optim.schedule_steps=1000")) == ([], [])
    # A second extension compares against the first one's config.
    newer = _dumped("train.steps=2000", "optim.schedule_steps=1000")
    assert config_diff(new, newer) == ([], ["  train.steps: 1500 -> 2000"])


def test_a_constant_schedule_does_not_care_how_long_the_run_is():
    from train.run_dir import config_diff, config_hash

    old = _dumped("optim.schedule=constant", "train.steps=1000")
    new = _dumped("optim.schedule=constant", "train.steps=1500")
    assert config_diff(old, new) == ([], ["  train.steps: 1000 -> 1500"])
    assert config_hash(old) == config_hash(new)


def test_other_changes_keep_their_verdicts():
    from train.run_dir import config_diff, config_hash

    old = _dumped()
    cadence = _dumped(
        "train.log_every=7", "checkpoint.keep=9", "distributed.process_id=0", "train.progress='off'"
    )
    unsafe, safe = config_diff(old, cadence)
    assert unsafe == [] and len(safe) == 4 and config_hash(old) == config_hash(cadence)
    lr = _dumped("optim.lr=0.2")
    assert config_diff(old, lr) == (["  optim.lr: 0.1 -> 0.2"], [])
    assert config_hash(old) != config_hash(lr)
    # A key an older run had and the schema no longer knows is an unsafe change.
    older = {**old, "optim": {**old["optim"], "decay_all": False}}
    assert config_diff(older, old)[0] == ["  optim.decay_all: False -> '(unset)'"]


# --- optimizer options ----------------------------------------------------------------------------


def test_decay_exclude_and_schedule_steps_defaults_and_values():
    cfg = load_config(None, [])
    assert cfg.optim.decay_exclude == ["bias", "scale"] and cfg.optim.schedule_steps is None
    cfg = load_config(None, ["optim.decay_exclude=[]", "optim.schedule_steps=800"])
    assert cfg.optim.decay_exclude == [] and cfg.optim.schedule_steps == 800
    cfg = load_config(None, ["optim.decay_exclude=[blocks/*/bias, embedding]"])
    assert cfg.optim.decay_exclude == ["blocks/*/bias", "embedding"]
    assert "optim.schedule_steps" in errors_of(None, ["optim.schedule_steps=0"])
    assert "optim.decay_exclude" in errors_of(None, ["optim.decay_exclude=bias"])
    from train.config import describe_options

    text = " ".join(describe_options().split())
    assert "fnmatch glob" in text and "not stretched" in text


def test_user_paths_expand_the_home_directory(tmp_path, monkeypatch):
    # data.path and run_dir as a shell reads them: "~/..." is under $HOME, not a directory "~".
    import numpy as np

    from train import data

    monkeypatch.setenv("HOME", str(tmp_path))
    x = np.arange(10 * 4 * 4, dtype=np.float32).reshape(10, 4, 4, 1)
    np.savez(tmp_path / "mine.npz", x_train=x, y_train=np.arange(10) % 2)
    cfg = load_config(None, ["data.source=npz", "data.path=~/mine.npz", "run_dir=~/runs/a"])
    assert cfg.data.path == str(tmp_path / "mine.npz")
    assert cfg.resolved_run_dir == tmp_path / "runs" / "a"
    assert data.load_npz(cfg.data).name == "npz:mine.npz"
    assert load_config(None, ["data.source=npz", "data.path=rel/x.npz"]).data.path == "rel/x.npz"


def test_data_augment_and_normalize_default_off_and_apply_to_images_only():
    cfg = load_config(None, [])
    assert (cfg.data.augment, cfg.data.normalize) == ("none", "none")  # the digits run as before
    errs = errors_of(None, ["data.source=corpus", "data.augment=crop_flip"])
    assert "applies to images" in errs["data"] and "Fix: drop data.augment" in errs["data"]
    errs = errors_of(None, ["data.source=tokens"])
    assert "needs data.path" in errs["data"]
    errs = errors_of(None, ["data.augment=rotate", "data.tokens.dtype=int64"])
    assert "'none' or 'crop_flip'" in errs["data.augment"]
    assert "'uint16' or 'int32'" in errs["data.tokens.dtype"]
    cfg = load_config(None, ["model.name=transformer", "data.source=tokens", "data.path=~/t.bin"])
    assert cfg.data.path == str(Path.home() / "t.bin")
    assert is_resume_safe("data.prefetch") and is_resume_safe("data.read_threads")
    assert not is_resume_safe("data.augment") and not is_resume_safe("data.normalize")


def test_model_module_is_exclusive_with_model_name_and_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "user_models_for_config_test.py").write_text(
        "import flax.linen as nn\n"
        "NOT_CALLABLE = 3\n"
        "def build(num_classes, width=4, *, remat=None):\n"
        "    return nn.Dense(num_classes)\n"
        "def not_a_module(num_classes):\n"
        "    return 'dense'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = "user_models_for_config_test"
    cfg = load_config(None, [f"model.module={mod}:build", "model.options={width: 8}"])
    assert cfg.model.name is None and cfg.model.label == f"{mod}:build"
    spec = cfg.model.spec()
    assert spec.task == "classify" and set(spec.options.model_fields) == {
        "num_classes",
        "width",
        "remat",
    }
    built = models.build(spec, num_classes=3, width=8)
    assert built.features == 3
    assert load_config(None, []).model.name == "revnet38"  # the default without a module
    lm = load_config(
        None, [f"model.module={mod}:build", "model.task=lm", "data.source=corpus", "remat=none"]
    )
    assert lm.model.spec().task == "lm"

    def error(*overrides: str) -> tuple[str, str]:
        ((path, msg),) = errors_of(None, overrides).items()
        return path, msg

    path, msg = error(f"model.module={mod}:build", "model.name=resnet32")
    assert path == "model" and "not both" in msg and "Fix: drop model.name" in msg
    path, msg = error("model.task=lm")
    assert path == "model" and "applies to model.module only" in msg
    path, msg = error("model.module=no_such_pkg_for_test.models:build")
    assert path == "model.module" and "cannot import 'no_such_pkg_for_test.models'" in msg
    assert "PYTHONPATH" in msg and "model.module='no_such_pkg_for_test.models:build'" in msg
    path, msg = error(f"model.module={mod}:buidl")
    assert path == "model.module" and "has no attribute 'buidl'" in msg
    assert "['build', 'not_a_module']" in msg
    path, msg = error(f"model.module={mod}:NOT_CALLABLE")
    assert path == "model.module" and "is a int, not callable" in msg
    path, msg = error(f"model.module={mod}")
    assert path == "model.module" and "'package.module:build'" in msg
    path, msg = error(f"model.module={mod}:build", "model.options={depth: 3}")
    assert path == "model.options.depth" and "unknown key" in msg
    path, msg = error(f"model.module={mod}:not_a_module", "remat={save: [x]}")
    assert path == "remat" and "takes no remat plan option" in msg
    assert load_config(None, [f"model.module={mod}:build", "remat=full"]).remat == "full"
    path, msg = error(f"model.module={mod}:build", "remat=ful")
    assert path == "remat" and "not a remat_nn policy name. Did you mean 'full'?" in msg
    bad = load_config(None, [f"model.module={mod}:not_a_module"]).model.spec()
    with pytest.raises(models.ModuleError, match="returned a str, not a flax.linen.Module"):
        models.build(bad, num_classes=3)


def test_remat_allow_is_checked_by_the_planners_own_rule():
    """``remat.allow`` in a config is refused exactly where ``rn.plan_for_budget`` refuses it
    (one check, ``remat_nn.planner.check_allow``), the orders, subsets and wrong values alike."""
    import itertools

    import remat_nn as rn
    from remat_nn.planner import check_allow
    from train.config._remat import request_errors

    words = ["save", "offload", "recompute", "invert", "dots", "Save"]
    values: list = [list(c) for n in range(4) for c in itertools.permutations(words, n)]
    values += ["save", None, 3, {"save": 1}, ("save",)]
    refused = {True: 0, False: 0}
    for allow in values:
        try:
            check_allow(allow)
            planner_refuses = False
        except rn.PlanError:
            planner_refuses = True
        paths = [p for p, _ in request_errors({"policy": "auto", "budget": 0.5, "allow": allow})]
        assert ("remat.allow" in paths) == planner_refuses, allow
        refused[planner_refuses] += 1
    assert refused[True] > 100 and refused[False] >= 10  # both answers are exercised
