"""``python -m train`` for the tests: in a fresh process, or in the test process itself.

Shared by the fault, run and multi-process tests. :func:`launch` starts a child that sees the
CPU platform with ``devices`` fake devices, the suite's ``XLA_FLAGS`` (:func:`child_xla_flags`) in
place of the parent's, no fault point unless given, and its combined stdout and stderr on
``proc.stdout``: for the runs a test kills, that signal themselves, or that need a process of
their own (another device count, a second process). Every other run is cheaper in the test
process (:func:`run_in_process`: no interpreter, JAX and orbax start-up, compiled programs reused).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import jax
from jax.experimental.compilation_cache import compilation_cache

ROOT = Path(__file__).resolve().parents[1]

# XLA:CPU's code generation at -O0 and with its classic (LLVM IR) fusion emitters instead of the
# MLIR fusion emitters, in the test process (conftest.py) and every process a test starts, so a
# child computes bit for bit what the parent does. The suite is mostly compiles: a small
# transformer's gradient compiles in a quarter of the default time (2.6 -> 0.7 CPU-s), the whole
# suite ran in 630 s instead of 852 s (unpaired). Compiled memory moves by a few hundred bytes,
# which tests/project/test_xla_flags.py checks on the suite's kinds of program; the benchmarks' and
# the README's figures come from XLA's defaults. And the machine code of a program in one piece
# (``--xla_cpu_parallel_codegen_split_count=1``, against 32 by default): XLA:CPU splits a module
# to generate its parts on several threads, which two test workers on two cores cannot use, and
# the split itself costs (3.1 of the 15.9 s compile of the depth-32 unrolled invertible stack);
# two test modules took 60-63 CPU-s of user time instead of 67-71 (two alternating runs each).
TEST_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_parallel_codegen_split_count=1"
)


def child_xla_flags() -> str:
    """The XLA flags of a process a test starts: :data:`TEST_XLA_FLAGS`, plus the vector-code
    limit the suite itself runs under, if any (``make test-portability``), so a child computes
    the same bits as the test process on any machine."""
    isa = re.findall(r"--xla_cpu_max_isa=\S+", os.environ.get("XLA_FLAGS", ""))
    return " ".join([TEST_XLA_FLAGS, *isa])


# Fault points a run survives in the test process: an error raised (enospc), a NaN batch (nan).
# The others SIGKILL the process or send it SIGTERM / SIGINT: those runs need a child.
IN_PROCESS_FAULTS = ("enospc", "nan")


def launch(
    argv: list[str],
    *,
    register: str,
    devices: int = 1,
    env: dict[str, str] | None = None,
    **popen_kwargs,
) -> subprocess.Popen:
    """Starts ``python -m train argv`` after calling ``register`` ("module:function", the module
    dotted from the repository's root, e.g. ``tests.train.tiny_models:register_train_mlp``)."""
    module, function = register.split(":")
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}]; import importlib; "
        f"importlib.import_module({module!r}).{function}(); "
        "from train.__main__ import exit_process, main; "
        f"exit_process(main({argv!r}))"
    )
    child_env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), "JAX_PLATFORMS": "cpu"}
    child_env["XLA_FLAGS"] = child_xla_flags()
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


def run_in_process(argv: list[str], *, fault: str | None = None) -> tuple[int, str]:
    """``python -m train argv`` in this process: (exit code, stdout and stderr interleaved).

    The model must be registered here. ``fault`` (``REMAT_NN_FAULT``, restored afterwards) may
    name only :data:`IN_PROCESS_FAULTS`. A bug in the trainer raises here (a child would exit 1
    with the traceback). The run must leave the process as it found it: its SIGTERM / SIGINT
    handlers and JAX's config are checked afterwards (the run directory's lock it releases
    itself: a later run in the directory would exit 5 otherwise).
    """
    from train.__main__ import main

    points = {item.partition("@")[0].strip() for item in (fault or "").split(",") if item.strip()}
    if not points <= set(IN_PROCESS_FAULTS):
        raise ValueError(
            f"run_in_process: fault {fault!r} kills or signals the process. Fix: run it in a "
            f"child (launch); in this process only {', '.join(IN_PROCESS_FAULTS)}."
        )
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    config = dict(jax.config.values)
    out = io.StringIO()
    with _fault_variable(fault), _unraisable_printed():
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(list(argv))
            finally:
                gc.collect()  # what the run left behind is collected (and printed) in the run
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers, "signal handlers left"
    changed = {k for k, v in jax.config.values.items() if config.get(k, v) != v}
    assert not changed, f"the run changed JAX's config: {sorted(changed)}"
    return code, out.getvalue()


@contextlib.contextmanager
def _unraisable_printed() -> Iterator[None]:
    # Orbax leaves the other reads of a checkpoint it cannot read pending; their coroutines raise
    # when collected ("Exception ignored in ..."). A child prints that on stderr and goes on, so
    # does a run here (pytest's hook would make each a failing warning of whichever test runs).
    hook = sys.unraisablehook
    sys.unraisablehook = sys.__unraisablehook__
    try:
        yield
    finally:
        sys.unraisablehook = hook


@contextlib.contextmanager
def _fault_variable(value: str | None) -> Iterator[None]:
    # train.faults reads the variable once per process (functools.cache): cleared on the way in
    # and out.
    from train import faults

    with mock.patch.dict(os.environ):  # the environment as it was, on the way out
        os.environ.pop(faults.ENV, None)
        if value is not None:
            os.environ[faults.ENV] = value
        faults._parsed.cache_clear()
        try:
            yield
        finally:
            faults._parsed.cache_clear()


@contextlib.contextmanager
def shared_compilation_cache(path: str) -> Iterator[str]:
    """JAX's persistent compilation cache at ``path`` for this process and every child it starts.

    Every entry is kept (no minimum compile time or size), so a run compiles a program another
    run here or in a child already compiled only once. Restored on exit (the cache is re-read
    from the previous directory).
    """
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {n: getattr(jax.config, n) for n in names}
    for n, v in zip(names, (path, 0.0, -1), strict=True):
        jax.config.update(n, v)
    compilation_cache.reset_cache()  # JAX opens the cache directory once: open this one
    env = {"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    try:
        with mock.patch.dict(os.environ, env):  # restored on exit
            yield path
    finally:
        for n, v in before.items():
            jax.config.update(n, v)
        compilation_cache.reset_cache()
