"""flax's own remat tests, unchanged, pass against remat_nn's nn.remat.

`make setup` downloads the flax sdist pinned in requirements.lock from PyPI and extracts its
tests/linen/linen_transforms_test.py into .venv/upstream/ (nothing downloads at test time). The
file runs in a subprocess with flax.linen.remat and flax.linen.checkpoint patched to nn.remat.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAX = re.search(r"^flax==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M).group(1)
UPSTREAM = Path(sys.prefix) / "upstream" / f"flax-{FLAX}" / "tests" / "linen"
# Every test of that file that calls nn.remat / nn.checkpoint (remat_scan is flax's own).
SELECT = "remat and not remat_scan or setup_calls or lift_instance_error"


def test_flax_remat_tests_pass_with_remat_nn():
    test_file = UPSTREAM / "linen_transforms_test.py"
    assert test_file.exists(), f"{test_file} is missing: run `make setup` (it fetches the sdist)."
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
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
            SELECT,
            "-c",
            os.devnull,
            "--rootdir",
            str(UPSTREAM),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=UPSTREAM,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    assert passed >= 6, tail  # remat, decorated, static_argnums x2, setup_calls x2, instance error
