"""Config validation: unknown keys, types and ranges, all errors at once with dotted paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import models
from train.config import ConfigError, YamlLoader, apply_overrides, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def errors_of(path=None, overrides=()) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return dict(info.value.errors)


def test_yaml_12_floats_are_floats():
    assert yaml.load("a: 1e-3\nb: 5E+2\nc: 1.5\nd: 3\ne: 1e3x", Loader=YamlLoader) == {
        "a": 0.001, "b": 500.0, "c": 1.5, "d": 3, "e": "1e3x",
    }  # fmt: skip
    assert yaml.safe_load("a: 1e-3") == {"a": "1e-3"}  # what plain PyYAML does


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
        "optim.lr", "optim.momentun", "train.steps", "train.on_nonfinite", "data.source",
        "data.test_fraction", "mesh", "bogus",
    }  # fmt: skip
    assert "greater than 0" in errs["optim.lr"] and "-1" in errs["optim.lr"]
    assert "did you mean 'optim.momentum'" in errs["optim.momentun"]
    assert "'halt' or 'skip'" in errs["train.on_nonfinite"]
    assert "mesh.data must be a positive size or -1" in errs["mesh"]


def test_model_options_are_validated_by_the_models_schema():
    errs = errors_of(None, ["model.name=transformr"])
    assert "did you mean 'transformer'" in errs["model.name"].lower()
    errs = errors_of(None, ["model.name=transformer", "data.source=corpus",
                            "model.options.d_modle=64", "model.options.n_heads=0"])  # fmt: skip
    assert "unknown key" in errs["model.options.d_modle"]
    assert "greater than 0" in errs["model.options.n_heads"]
    errs = errors_of(None, ["model.name=transformer"])  # the default source is images
    assert "does not fit model 'transformer'" in errs["data.source"]


def test_remat_plan_is_folded_into_the_model_and_checked():
    cfg = load_config(None, ["model.name=transformer", "data.source=corpus",
                             "remat={save: [query_proj], offload: [mlp_hidden]}"])  # fmt: skip
    assert cfg.model_options()["remat"] == "custom"
    assert cfg.model_options()["custom_plan"] == {"save": ["query_proj"], "offload": ["mlp_hidden"]}
    errs = errors_of(None, ["model.name=transformer", "data.source=corpus",
                            "remat={save: [query_proj], offload: [query_proj]}"])  # fmt: skip
    assert any(p.startswith("remat") or p.startswith("model.options") for p in errs)


def test_malformed_overrides():
    tree: dict = {"train": 3}
    errs = apply_overrides(tree, ["train.steps=4", "novalue", "a..b=1"])
    assert [p for p, _ in errs] == ["train.steps", "novalue", "a..b"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate_and_say_how_to_run(path):
    cfg = load_config(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# python -m train --config configs/" + path.name), first
    spec = models.get(cfg.model.name)
    assert spec.task in ("classify", "lm")


def test_shipped_configs_use_the_intended_models():
    names = {p.stem: load_config(p).model.name for p in CONFIGS}
    assert names["revnet"].startswith("revnet") and names["resnet"] == "resnet32"
    assert names["transformer"] == names["transformer_offload"] == "transformer"
    assert load_config(ROOT / "configs/revnet.yaml").data.source == "digits"
    assert load_config(ROOT / "configs/transformer_offload.yaml").remat is not None


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "train", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_cli_help_and_config_errors(tmp_path):
    helped = _cli("--help")
    assert helped.returncode == 0
    for option in ("--dry-run", "--restart", "optim.lr", "checkpoint.keep_best", "mesh.fsdp",
                   "train.on_nonfinite", "--coordinator"):  # fmt: skip
        assert option in helped.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {lr: -1}\ntrain: {stepz: 3}\n")
    result = _cli("--config", str(bad), "mesh.fsdp=0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for path in ("optim.lr", "train.stepz", "mesh"):
        assert f"  {path}:" in result.stderr, result.stderr
