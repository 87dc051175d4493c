"""``python -m train`` in a fresh process, with a test module's model registered first.

Shared by the fault, run and multi-process tests: the child sees the CPU platform with
``devices`` fake devices, the suite's ``XLA_FLAGS`` (:data:`TEST_XLA_FLAGS`) in place of the
parent's, no fault point unless given, and its combined stdout and stderr on ``proc.stdout``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# XLA:CPU's code generation at -O0, in the test process (conftest.py) and every process a test
# starts, so a child computes bit for bit what the parent does and compiles in a third of the time.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def launch(
    argv: list[str],
    *,
    register: str,
    devices: int = 1,
    env: dict[str, str] | None = None,
    **popen_kwargs,
) -> subprocess.Popen:
    """Starts ``python -m train argv`` after calling ``register`` ("module:function" in tests/)."""
    module, function = register.split(":")
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; "
        f"import {module}; {module}.{function}(); from train.__main__ import main; "
        f"raise SystemExit(main({argv!r}))"
    )
    child_env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), "JAX_PLATFORMS": "cpu"}
    child_env["XLA_FLAGS"] = TEST_XLA_FLAGS
    child_env.pop("REMAT_NN_FAULT", None)
    child_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=child_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **popen_kwargs,
    )
