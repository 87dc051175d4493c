"""``python -m train`` in a fresh process, with a test module's model registered first.

Shared by the fault, run and multi-process tests: the child sees the CPU platform with
``devices`` fake devices, none of the parent's ``XLA_FLAGS`` or fault point unless given, and
its combined stdout and stderr on ``proc.stdout``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    child_env.pop("XLA_FLAGS", None)
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
