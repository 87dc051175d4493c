"""flax's own remat tests, unchanged, pass against remat_nn's nn.remat and nnx.remat.

`make setup` downloads the flax sdist pinned in requirements.lock from PyPI and extracts its
tests/linen/linen_transforms_test.py and tests/nnx/transforms_test.py into .venv/upstream/
(nothing downloads at test time). Each file runs in a subprocess with flax's remat patched to
remat_nn's (tests/remat/flax_upstream_plugin.py): flax.linen.remat and flax.linen.checkpoint to
nn.remat, flax.nnx.remat to remat_nn.nnx.remat.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAX = re.search(r"^flax==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M).group(1)
UPSTREAM = Path(sys.prefix) / "upstream" / f"flax-{FLAX}" / "tests"

# (file, the tests of it that call the patched remat, how many of them pass today)
SUITES = {
    # remat_scan is flax's own; remat, decorated, static_argnums x2, setup_calls x2, instance error.
    "linen": (
        "linen/linen_transforms_test.py",
        "remat and not remat_scan or setup_calls or lift_instance_error",
        6,
    ),
    # nnx.remat in graph and tree mode, with scan, with state updates; bound-method error.
    "nnx": ("nnx/transforms_test.py", "remat", 19),
}


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_flax_remat_tests_pass_with_remat_nn(suite: str) -> None:
    path, select, least = SUITES[suite]
    test_file = UPSTREAM / path
    assert test_file.exists(), f"{test_file} is missing: run `make setup` (it fetches the sdist)."
    env = {**os.environ, "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{ROOT}"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(test_file),
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "flax_upstream_plugin",
            "-k",
            select,
            "-c",
            os.devnull,
            "--rootdir",
            str(test_file.parent),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=test_file.parent,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    assert passed >= least, tail
