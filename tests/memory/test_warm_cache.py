"""The second run: buffer tables from a process whose compilation cache another one filled.

JAX's persistent cache leaves ``xla_dump_to`` out of its key, so a compile it serves dumps no
buffer assignment: ``rn.explain_peak`` compiles apart from it. The trainer's reports (the
auto-plan's, the dry run's) print the totals and the reason when an explanation fails, and go on.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import remat_nn as rn
from remat_nn import _peak
from tests.trainer_cli import (
    ROOT,
    child_xla_flags,
    launch,
    run_in_process,
    shared_compilation_cache,
)

DEBUG = str(ROOT / "configs" / "debug.yaml")
AUTO = "remat={policy: auto, budget: 0.5}"

# A library user's session: a compile the cache keeps, then the two reports that explain a peak.
_LIBRARY_SESSION = """
import jax, jax.numpy as jnp
import remat_nn as rn
from remat_nn import _demo

def f(x):
    big = rn.name(jnp.sin(x @ x), "big")
    return jnp.sum(jnp.cos(big) * big)

x = jax.ShapeDtypeStruct((128, 128), jnp.float32)
print("compiled", rn.compiled_memory(f, x).peak_bytes)
print(rn.explain_peak(f, x))
params = _demo.init(jax.random.key(0), depth=4, width=32, hidden=128)
rates = {"flops_per_second": 1e10, "memory_bandwidth": 1e10, "measure": False}
print(rn.plan_for_budget(_demo.loss, params, jnp.ones((16, 32)), budget=0.6, **rates))
"""


def _cache_env(cache: Path) -> dict[str, str]:
    # Every compile kept, however quick: the second process finds all of the first's.
    return {
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def no_models() -> None:
    """What the children register: nothing (the configs' models are the registry's own)."""


def test_explain_peak_and_the_planner_report_in_a_second_process(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags()}
    env.update(_cache_env(tmp_path / "jax_cache"))
    for process in ("first", "second"):
        done = subprocess.run(
            [sys.executable, "-c", _LIBRARY_SESSION],
            cwd=ROOT,
            env=env,
            text=True,
            capture_output=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{process} process:\n{done.stderr[-3000:]}"
        out = done.stdout
        assert "equals XLA's temp + argument + output - alias" in out, out
        assert "big" in out and "largest temp buffers at the chosen plan's peak" in out, out
    assert any((tmp_path / "jax_cache").iterdir())  # the second process read a warm cache


def test_explain_peak_compiles_apart_from_the_cache_and_leaves_it_on(tmp_path):
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    cache = tmp_path / "jax_cache"
    with shared_compilation_cache(str(cache)):
        jax.jit(lambda a: jnp.sin(a) @ a).lower(x).compile()
        kept = sorted(cache.iterdir())
        assert rn.explain_peak(lambda a: jnp.cos(a) @ a, x).difference == 0
        assert sorted(cache.iterdir()) == kept  # the explained compile is not written
        jax.jit(lambda a: jnp.tanh(a) @ a).lower(x).compile()
        assert len(list(cache.iterdir())) == len(kept) + 1  # the next compile is


@pytest.mark.slow  # three processes, each planning: about 30 CPU-s
def test_auto_plan_in_three_processes_on_one_cache(tmp_path):
    # The auto-plan's report explains the chosen plan's peak in a run on a cold cache, in a run
    # on the cache it filled, and in a dry run on it, which also explains the step's peak. (A
    # dry run on a cold cache explains as the tests in-process do: test_model_plans.py.)
    for process, flags in (("cold run", []), ("warm run", []), ("warm dry run", ["--dry-run"])):
        argv = [
            "--config",
            DEBUG,
            *flags,
            AUTO,
            "train.steps=1",
            "train.plot=false",
            f"run_dir={tmp_path / process.replace(' ', '_')}",
        ]
        proc = launch(
            argv, register="tests.memory.test_warm_cache:no_models", env=_cache_env(tmp_path / "c")
        )
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{process}:\n{out[-3000:]}"
        assert "largest temp buffers at the chosen plan's peak" in out, (process, out)
        assert "no buffers" not in out, (process, out)
        if flags:
            assert "largest buffers at XLA's peak (rn.explain_peak, +0 B" in out, out


def test_a_failing_explainer_stops_no_run(tmp_path, monkeypatch):
    def fails(*args, **kwargs):
        raise ValueError("an XLA dump this parser does not read")

    monkeypatch.setattr(_peak, "explain_peak", fails)  # the planner's deferred explanation
    monkeypatch.setattr(rn, "explain_peak", fails)  # the dry run's
    argv = ["--config", DEBUG, "--dry-run", AUTO, "train.plot=false", f"run_dir={tmp_path}"]
    code, out = run_in_process(argv)
    assert code == 0, out
    why = "rn.explain_peak failed: ValueError: an XLA dump this parser does not read)"
    assert f"(no buffers at the chosen plan's peak: {why}" in out
    assert f"(no buffers at the peak: {why}" in out
    assert "temp: " in out.split("XLA compiled memory of the train step", 1)[1]  # the totals
