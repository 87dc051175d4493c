"""The trainer's "Train on your data" / "Train your model" walk-through, executed.

The config, the model file and the commands are read from docs/trainer.md, so the page cannot
drift from what works. The test writes a tiny CIFAR-10 directory in the real python-pickle
format, then runs the README's commands in this process (``run_in_process``) with only these
changes, for a few-second run: the data path and scale overrides of :data:`TINY` (data.path,
batch, steps, cadence, one device), and ``--stop-after 3`` in place of the README's 1000.
"""

from __future__ import annotations

import json
import pickle
import re
import shlex
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from tests.trainer_cli import run_in_process
from train.data import _pipeline as pipeline_lib

ROOT = Path(__file__).resolve().parents[2]
STEPS, STOP = 6, 3
TINY = [
    "data.batch_size=8",
    f"train.steps={STEPS}",
    "train.eval_every=3",
    "train.log_every=1",
    "train.plot=false",
    "checkpoint.every=3",
    "mesh.data=1",  # the suite has 8 fake devices; one is enough here
]


def readme_section(title: str) -> str:
    text = (ROOT / "docs" / "trainer.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def fenced(section: str, lang: str) -> list[str]:
    """The section's ```lang blocks, dedented."""
    blocks = re.findall(rf"^( *)```{lang}\n(.*?)^\1```", section, flags=re.S | re.M)
    return ["\n".join(line[len(indent) :] for line in body.splitlines()) for indent, body in blocks]


def write_cifar(root: Path, *, train_per_file: int, files: int, test: int) -> None:
    """CIFAR-10's python format: pickled dicts of uint8 rows (R, G, B planes) and labels."""
    rng = np.random.default_rng(0)
    root.mkdir()
    names = [f"data_batch_{i + 1}" for i in range(files)] + ["test_batch"]
    for name in names:
        n = test if name == "test_batch" else train_per_file
        batch = {
            b"batch_label": name.encode(),
            b"labels": rng.integers(0, 10, n).tolist(),
            b"data": rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8),
            b"filenames": [f"{name}_{i}.png".encode() for i in range(n)],
        }
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))


def saved(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    with warnings.catch_warnings():
        # Orbax takes the shardings from the checkpoint: the same single CPU device here.
        warnings.filterwarnings("ignore", "Sharding info not provided", UserWarning)
        tree = ocp.PyTreeCheckpointer().restore(run_dir / "checkpoints" / str(step) / "state")
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def metrics(run_dir: Path) -> list[dict]:
    timing = {"steps_per_sec", "examples_per_sec"}  # wall-clock, not part of what is computed
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in lines]


def test_readme_walkthrough_trains_stops_and_resumes_bitwise(tmp_path, monkeypatch):
    data_section = readme_section("Train on your data")
    model_section = readme_section("Train your model")
    (config_text,) = [b for b in fenced(data_section, "yaml") if b.startswith("# my_cifar.yaml")]
    (commands,) = fenced(data_section, "bash")
    (model_file,) = [b for b in fenced(model_section, "python") if b.startswith("# my_model.py")]
    (model_snippet,) = [b for b in fenced(model_section, "yaml") if b.startswith("model:")]

    # The user's files, as the README says: my_cifar.yaml with the model section replaced, and
    # my_model.py next to it, in the working directory.
    config = yaml.safe_load(config_text)
    assert config["model"] == {"name": "resnet32"}  # what "Replace the model: section" replaces
    config["model"] = yaml.safe_load(model_snippet)["model"]
    (tmp_path / "my_cifar.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "my_model.py").write_text(model_file + "\n")
    write_cifar(tmp_path / "cifar", train_per_file=20, files=2, test=16)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # `python -m train` puts the working dir there

    argvs = [shlex.split(line, comments=True) for line in commands.splitlines() if line.strip()]
    assert [a[:3] for a in argvs] == [["python", "-m", "train"]] * 3, commands
    dry_run, stop, resume = (a[3:] for a in argvs)
    assert "--dry-run" in dry_run and "--stop-after" in stop and resume == dry_run[:-1]
    stop[stop.index("--stop-after") + 1] = str(STOP)
    tiny = [f"data.path={tmp_path / 'cifar'}", *TINY]

    crops = []  # the training batches go through the crop/flip augmentation
    crop_flip = pipeline_lib.crop_flip
    monkeypatch.setattr(
        pipeline_lib, "crop_flip", lambda x, *a, **k: crops.append(len(x)) or crop_flip(x, *a, **k)
    )
    # The four runs compile the same programs: once, through the suite's compilation cache.
    code, out = run_in_process(dry_run + tiny)
    assert code == 0 and "model my_model:build" in out and "40 train / 16 test" in out, out
    assert not (tmp_path / "runs" / "my_cifar" / "checkpoints").exists()
    code, out = run_in_process(stop + tiny)
    assert code == 0 and f"step {STOP:>6}/{STEPS}" in out and "resumed from" not in out, out
    assert set(crops) == {8} and STOP <= len(crops) <= STOP + 2  # + 2 batches prefetched
    code, out = run_in_process(resume + tiny)
    assert code == 0 and f"(step {STOP})" in out and f"step {STEPS:>6}/{STEPS}" in out, out
    code, out = run_in_process(resume + tiny + ["run_dir=runs/uninterrupted"])
    assert code == 0 and "resumed from" not in out, out

    resumed, reference = tmp_path / "runs" / "my_cifar", tmp_path / "runs" / "uninterrupted"
    a, b = saved(resumed, STEPS), saved(reference, STEPS)
    assert a.keys() == b.keys() and any("params" in k for k in a)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert metrics(resumed) == metrics(reference)
    assert [m["step"] for m in metrics(reference) if m["split"] == "eval"] == [3, 6]


def test_readme_model_module_errors_name_the_key_and_the_fix(tmp_path, monkeypatch):
    # The README promises exit code 2 and a message naming model.module for a module that does
    # not import or returns something other than a flax.linen.Module.
    (tmp_path / "not_a_model.py").write_text("def build(num_classes):\n    return [num_classes]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["data.source=digits", "train.steps=1", f"run_dir={tmp_path / 'run'}", "mesh.data=1"]
    code, out = run_in_process([*base, "model.module=no_such_module:build"])
    assert code == 2 and "model.module='no_such_module:build'" in out, out
    assert "cannot import" in out and "PYTHONPATH" in out, out
    code, out = run_in_process([*base, "model.module=not_a_model:build"])
    assert code == 2 and "returned a list, not a flax.linen.Module" in out, out


@pytest.fixture(autouse=True)
def _forget_user_modules():
    # Each test writes its own modules; a cached import would outlive its tmp_path.
    import sys

    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name in ("my_model", "not_a_model", "no_such_module"):
            del sys.modules[name]
