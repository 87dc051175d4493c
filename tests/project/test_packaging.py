"""The wheel: only ``remat_nn`` in site-packages, a core that installs and imports without flax.

The wheel is built from a copy of the clone's files (tracked and new, as ``git ls-files`` lists
them: train/, models/, benchmarks/ and configs/ included) by ``pip wheel`` without build isolation,
with the setuptools pinned in requirements.lock (nothing downloads at test time).
It is then installed into a fresh venv that sees only the core's dependencies: the venv has no
system site-packages, and each distribution ``jax``, ``numpy`` and ``pyyaml`` need (recursively,
from their metadata) is linked in from this interpreter's site-packages, nothing else. flax is not
there, so ``import remat_nn.nn`` must fail with the fix.
"""

from __future__ import annotations

import email.parser
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import remat_nn

ROOT = Path(__file__).resolve().parents[2]
CORE = {"jax", "numpy", "pyyaml"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in listed:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, src / name)
    assert (src / "train" / "__main__.py").exists() and (src / "configs").is_dir()
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index"]
        + ["--no-build-isolation", str(src), "-w", str(out)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("remat_nn-*.whl")
    return whl


def _metadata(whl: Path) -> email.message.Message:
    with zipfile.ZipFile(whl) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(z.read(meta).decode())


def test_wheel_holds_only_remat_nn_with_license_and_types(wheel):
    with zipfile.ZipFile(wheel) as z:
        files = z.namelist()
    top = {f.split("/")[0] for f in files}
    assert top == {"remat_nn", f"remat_nn-{remat_nn.__version__}.dist-info"}, top
    assert "remat_nn/py.typed" in files
    assert "remat_nn/nn/__init__.py" in files and "remat_nn/nnx/__init__.py" in files
    license_file = f"remat_nn-{remat_nn.__version__}.dist-info/licenses/LICENSE"
    with zipfile.ZipFile(wheel) as z:
        assert "Apache License" in z.read(license_file).decode()
    meta = _metadata(wheel)
    assert meta["Version"] == remat_nn.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    assert {r.name.lower() for r in reqs if r.marker is None} == CORE
    extras = {r.name.lower() for r in reqs if r.marker and r.marker.evaluate({"extra": "flax"})}
    assert "flax" in extras


def _closure(names: set[str]) -> list[md.Distribution]:
    # The installed distributions `names` need, their own requirements included (no extras).
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        dist = md.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for r in map(Requirement, dist.requires or []):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return list(seen.values())


def _fresh_venv_with_core(root: Path) -> Path:
    venv.create(root, with_pip=False, system_site_packages=False, symlinks=True)
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    for dist in _closure(CORE):
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if top not in ("..", "__pycache__") and not (site / top).exists():
                (site / top).symlink_to(base / top)
    return python


def test_fresh_venv_without_flax_imports_the_core(wheel, tmp_path):
    python = _fresh_venv_with_core(tmp_path / "venv")
    target = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
        + ["--target", target, str(wheel)],
        check=True,
        capture_output=True,
    )
    script = f"""
import sys
import jax, jax.numpy as jnp
import remat_nn as rn
assert rn.__file__.startswith({target!r}), rn.__file__
assert rn.__version__ == {remat_nn.__version__!r}
f = rn.checkpoint(lambda x: jnp.sin(rn.name(jnp.sin(x), "h")).sum(), policy="save=h")
assert float(abs(jax.grad(f)(1.0) - jnp.cos(jnp.sin(1.0)) * jnp.cos(1.0))) < 1e-6
for mod in ("flax", "optax", "orbax", "pydantic", "train", "models", "benchmarks"):
    try:
        __import__(mod)
    except ImportError:
        pass
    else:
        raise AssertionError(mod + " is importable in the fresh venv")
for sub in ("nn", "nnx"):
    try:
        __import__("remat_nn." + sub)
    except ImportError as e:
        assert "pip install 'remat_nn[flax]'" in str(e), e
    else:
        raise AssertionError("remat_nn." + sub + " imported without flax")
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    run = subprocess.run(
        [python, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
