"""Malformed configs fail at the boundary: exit code 2, one line per problem with its dotted path,
no traceback, nothing written. And a property-based fuzz of the loader (hypothesis): it returns a
valid config or raises ConfigError with dotted paths, never any other exception."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pydantic
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from train.__main__ import main
from train.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
LM = "model: {name: transformer}\ndata: {source: corpus}\n"  # a model that takes remat plans

# name -> (file bytes, dotted paths that must be reported; "" is the file itself, <root>)
MALFORMED: dict[str, tuple[bytes | str, set[str]]] = {
    # unknown keys at every level
    "unknown_top": ("bogus: 1\n", {"bogus"}),
    "unknown_model": ("model: {nam: revnet38}\n", {"model.nam"}),
    "unknown_model_option": (
        "model: {name: revnet38, options: {depht: 3}}\n",
        {"model.options.depht"},
    ),
    "unknown_data": ("data: {sorce: digits}\n", {"data.sorce"}),
    "unknown_synthetic": (
        "data: {synthetic: {num_exampels: 3}}\n",
        {"data.synthetic.num_exampels"},
    ),
    "unknown_optim": ("optim: {learning_rate: 0.1}\n", {"optim.learning_rate"}),
    "unknown_train": ("train: {stepz: 3}\n", {"train.stepz"}),
    "unknown_checkpoint": ("checkpoint: {evry: 3}\n", {"checkpoint.evry"}),
    "unknown_mesh": ("mesh: {dta: 2}\n", {"mesh.dta"}),
    "unknown_distributed": ("distributed: {coordinator: h:1}\n", {"distributed.coordinator"}),
    "unknown_plan_key": (LM + "remat: {sav: [query_proj]}\n", {"remat"}),
    # wrong types
    "steps_word": ("train: {steps: ten}\n", {"train.steps"}),
    "lr_list": ("optim: {lr: [0.1]}\n", {"optim.lr"}),
    "lr_bad_float": ("optim: {lr: 1.0e}\n", {"optim.lr"}),
    "plot_word": ("train: {plot: maybe}\n", {"train.plot"}),
    "image_shape_short": (
        "data: {synthetic: {image_shape: [32, 32]}}\n",
        {"data.synthetic.image_shape.2"},
    ),
    "list_for_mapping": ("optim: [sgd, 0.1]\n", {"optim"}),
    "scalar_for_mapping": ("train: 100\n", {"train"}),
    # YAML pitfalls
    "yes_bool": ("train: {plot: yes}\n", {"train.plot"}),
    "no_as_string": ("data: {source: no}\n", {"data.source"}),
    "off_bool": ("train: {verify_donation: off}\n", {"train.verify_donation"}),
    "on_key": ("on: 1\n", {"on"}),
    "tabs": ("train:\n\tsteps: 3\n", {""}),
    "duplicate_section": ("train: {steps: 3}\ntrain: {steps: 4}\n", {"train"}),
    "duplicate_key": ("optim:\n  lr: 0.1\n  lr: 0.2\n", {"optim.lr"}),
    "null_int": ("train: {steps: ~}\n", {"train.steps"}),
    "null_section": ("optim: ~\n", {"optim"}),
    "octal": ("train: {steps: 010}\n", {"train.steps"}),
    "sexagesimal": ("train: {log_every: 1:30}\n", {"train.log_every"}),
    "int_key": ("1: x\n", {"1"}),
    "recursive_alias": ("data: &d {synthetic: *d}\n", {"data.synthetic"}),
    "two_documents": ("train: {steps: 3}\n---\ntrain: {steps: 4}\n", {""}),
    "unclosed_bracket": ("train: {steps: 3\n", {""}),
    # bad enums
    "optim_name": ("optim: {name: adam}\n", {"optim.name"}),
    "data_source": ("data: {source: imagenet}\n", {"data.source"}),
    "compute_dtype": ("train: {compute_dtype: float16}\n", {"train.compute_dtype"}),
    "best_metric": ("checkpoint: {best_metric: accuracy}\n", {"checkpoint.best_metric"}),
    "unknown_model_name": ("model: {name: transformr}\n", {"model.name"}),
    # constraint violations
    "negative_lr": ("optim: {lr: -0.1}\n", {"optim.lr"}),
    "zero_batch": ("data: {batch_size: 0}\n", {"data.batch_size"}),
    "zero_steps": ("train: {steps: 0}\n", {"train.steps"}),
    "momentum_one": ("optim: {momentum: 1.0}\n", {"optim.momentum"}),
    "mesh_two_wildcards": ("mesh: {data: -1, fsdp: -1}\n", {"mesh"}),
    "npz_without_path": ("data: {source: npz}\n", {"data"}),
    "source_does_not_fit": ("model: {name: transformer}\n", {"data.source"}),
    # remat plans
    "plan_name_in_two_lists": (
        LM + "remat: {save: [query_proj], offload: [query_proj]}\n",
        {"remat"},
    ),
    "unknown_preset": (LM + "remat: ful\n", {"remat"}),
    "plan_as_list": (LM + "remat: [query_proj]\n", {"remat"}),
    # the file itself
    "empty": ("", {""}),
    "only_comments": ("# nothing here\n", {""}),
    "top_level_list": ("- train\n- optim\n", {""}),
    "non_utf8": (b"train:\n  steps: \xff\xfe\n", {""}),
    "several_errors": (
        "optim: {lr: -1, momentun: 0.9}\ntrain: {steps: 0}\nbogus: 1\n",
        {"optim.lr", "optim.momentun", "train.steps", "bogus"},
    ),
}


def _check_cli_output(code: int, out: str, err: str, expected: set[str]) -> None:
    assert code == 2, (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert lines[0] == "error: invalid config", err
    n = int(lines[1].rsplit(": ", 1)[1].split()[0])  # "<file>: 3 errors"
    problems = lines[2:]
    assert len(problems) == n >= 1, err  # one line per problem, nothing else
    paths = {line.strip().split(": ", 1)[0] for line in problems}
    assert all(line.startswith("  ") for line in problems), err
    assert {"<root>" if p == "" else p for p in expected} <= paths, err


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    # Configs live in cfg/; the process runs in run/, which must stay empty (no runs/ written).
    (tmp_path / "cfg").mkdir()
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    return tmp_path


def _write(workdir: Path, name: str, text: bytes | str) -> Path:
    path = workdir / "cfg" / f"{name}.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_malformed_configs_exit_2_with_dotted_paths(workdir, capsys):
    assert len(MALFORMED) >= 30
    for name, (text, expected) in MALFORMED.items():
        path = _write(workdir, name, text)
        code = main(["--config", str(path)])
        captured = capsys.readouterr()
        try:
            _check_cli_output(code, captured.out, captured.err, expected)
        except AssertionError as e:
            raise AssertionError(f"config {name!r}: {e}") from None
    assert list((workdir / "run").iterdir()) == []


def test_missing_file_and_directory(workdir, capsys):
    for target, says in (
        (workdir / "cfg" / "nope.yaml", "no such config file"),
        (workdir / "cfg", "is a directory"),
    ):
        code = main(["--config", str(target)])
        captured = capsys.readouterr()
        _check_cli_output(code, captured.out, captured.err, {""})
        assert says in captured.err
    assert list((workdir / "run").iterdir()) == []


def test_malformed_overrides_are_checked_like_files(workdir, capsys):
    code = main(["train.steps=010", "train.plot=yes", "optim.lr=-1", "novalue"])
    captured = capsys.readouterr()
    _check_cli_output(
        code, captured.out, captured.err, {"train.steps", "train.plot", "optim.lr", "novalue"}
    )


def test_yaml_12_spellings_still_work(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(
        "name: 'no'\n"
        "optim: {lr: 1e-3, eps: 1E-8}\n"
        "train: {plot: false, verify_donation: True, steps: 10}\n"
        "data: {batch_size: 0x10}\n"
    )
    cfg = load_config(path)
    assert cfg.name == "no" and cfg.optim.lr == 1e-3 and cfg.optim.eps == 1e-8
    assert cfg.train.plot is False and cfg.train.verify_donation is True
    assert cfg.data.batch_size == 16
    merged = tmp_path / "merged.yaml"
    merged.write_text("train: {<<: {steps: 3, log_every: 1}, steps: 4}\n")
    cfg = load_config(merged)
    assert (cfg.train.steps, cfg.train.log_every) == (4, 1)


@pytest.mark.parametrize("name", ["tabs", "duplicate_key", "non_utf8"])
def test_cli_subprocess(workdir, name):
    text, expected = MALFORMED[name]
    path = _write(workdir, name, text)
    result = subprocess.run(
        [sys.executable, "-m", "train", "--config", str(path)],
        cwd=workdir / "run",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    _check_cli_output(result.returncode, result.stdout, result.stderr, expected)
    assert list((workdir / "run").iterdir()) == []


# --- property-based fuzz ------------------------------------------------------------------------


def _schema(model: type[pydantic.BaseModel]) -> dict[str, object]:
    # Section -> its field names (nested), from the real schema.
    out: dict[str, object] = {}
    for key, field in model.model_fields.items():
        ann = field.annotation
        is_model = isinstance(ann, type) and issubclass(ann, pydantic.BaseModel)
        out[key] = _schema(ann) if is_model else None
    return out


SCHEMA = _schema(Config)
JUNK_KEYS = ["bogus", "stepz", "lr ", "", "on", "yes", "1", "save", "options", "name.x"]
ENUM_WORDS = (
    "sgd adamw digits corpus synthetic npz text transformer revnet38 resnet32 halt skip cosine "
    "constant bfloat16 full query_proj mlp_hidden eval_loss auto none"
).split()

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(ENUM_WORDS),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(JUNK_KEYS + ENUM_WORDS), inner, max_size=3),
    ),
    max_leaves=8,
)


@st.composite
def configs(draw, schema=SCHEMA, depth=0):
    keys = list(schema) + JUNK_KEYS
    chosen = draw(st.lists(st.sampled_from(keys), max_size=5, unique=True))
    out = {}
    for key in chosen:
        sub = schema.get(key)
        if isinstance(sub, dict) and draw(st.booleans()):
            out[key] = draw(configs(sub, depth + 1))
        elif key == "remat" and draw(st.booleans()):
            out[key] = draw(
                st.dictionaries(
                    st.sampled_from(["save", "offload", "recompute", "default", "sav"]),
                    st.one_of(st.lists(st.sampled_from(ENUM_WORDS), max_size=3), scalars),
                    max_size=3,
                )
            )
        else:
            out[key] = draw(values)
    return out


_TMP = Path(tempfile.mkdtemp(prefix="config_fuzz_"))


def _loads_or_config_error(text: bytes, overrides=()) -> None:
    path = _TMP / "fuzz.yaml"
    path.write_bytes(text)
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        assert e.errors, str(e)
        for where, msg in e.errors:
            assert isinstance(where, str) and isinstance(msg, str) and msg, e.errors
            assert "\n" not in where and "\n" not in msg, (where, msg)
    else:
        assert isinstance(cfg, Config)


FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@FUZZ
@given(configs())
def test_fuzz_random_config_mappings(tree):
    _loads_or_config_error(yaml.safe_dump(tree, allow_unicode=True).encode())


@FUZZ
@given(
    st.lists(
        st.sampled_from(
            [
                "train:",
                "  steps: 3",
                "optim: {lr: 1e-3}",
                "\t",
                "- a",
                "&a x",
                "*a",
                "? [a]",
                ": 1",
                "data:",
                "  source: no",
                "---",
                "<<: {steps: 1}",
                "  010",
                "{",
                "}",
                "remat: full",
                "on: off",
                "model: {name: transformer}",
                "  synthetic: {image_shape: [1, 2, 3]}",
                "x: !!python/int 3",
            ]
        ),
        max_size=6,
    )
)
def test_fuzz_random_yaml_text(lines):
    _loads_or_config_error("\n".join(lines).encode())


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "train.steps",
                    "optim.lr",
                    "model.options.depth",
                    "remat",
                    "remat.save",
                    "data",
                    "data.synthetic.image_shape",
                    "x.y.z",
                    "",
                    "train..steps",
                ]
            ),
            st.sampled_from(
                ["3", "-1", "010", "yes", "~", "[a, b]", "{save: [x]}", "1e-3", "{", "a: b"]
            ),
        ),
        max_size=4,
    )
)
def test_fuzz_random_overrides(pairs):
    _loads_or_config_error(b"train: {steps: 2}\n", [f"{k}={v}" for k, v in pairs])
