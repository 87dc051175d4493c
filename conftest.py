"""Strict test settings shared by the whole suite (STYLE.md habit 11).

- The CPU platform with 8 fake devices, so sharding and donation paths run on a laptop or CI and
  a machine with an accelerator runs the same tests (``JAX_PLATFORMS=cpu`` reaches the
  subprocesses tests start, too).
- ``jax_numpy_rank_promotion="raise"``: implicit rank promotion is a bug in this code base.
- Warnings are errors (pyproject.toml); each ignore there carries its reason.
- JAX's persistent compilation cache in a temporary directory, every entry kept: an in-process
  run (``train.loop.run``) never writes one into the repository or the user's cache, and a
  program built again from another closure is read, not compiled.
- XLA:CPU's code generation at ``-O0``, with the classic fusion emitters, each program's code
  generated in one piece (``TEST_XLA_FLAGS``, in this process and the ones tests start): the
  suite checks values, gradients and compiled memory; these flags change how fused loops become
  machine code, not what remat_nn saves, and a compile takes a quarter to a half of the time
  (the suite is mostly compiles).
  tests/project/test_xla_flags.py checks that compiled temp stays within 1% of a flagless
  process's on the suite's kinds of program.
- ``jax_upgrade_flags``: runs a test twice, as JAX is today and with the upgrade flags that
  become its defaults (``jax_remat3``, ``jax_custom_vjp3``).
"""

import collections
import os

import jax
import pytest

from tests.trainer_cli import TEST_XLA_FLAGS, shared_compilation_cache

# Before any backend is initialised (importing jax initialises none).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
os.environ["JAX_PLATFORMS"] = "cpu"
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

_UPGRADE_FLAGS = ("jax_remat3", "jax_custom_vjp3")

# --doctest-modules imports every module under testpaths to look for doctests. This plugin
# patches flax's remat (for flax's own tests, run in a subprocess by
# tests/remat/test_flax_upstream.py): imported here, it would make every comparison with
# flax.linen.remat / flax.nnx.remat in this process compare remat_nn with itself.
collect_ignore = ["tests/remat/flax_upstream_plugin.py"]


@pytest.fixture(scope="session", autouse=True)
def compile_cache_in_tmp(tmp_path_factory):
    """Points JAX's compilation cache at a temporary directory for the whole session (one per
    xdist worker), for this process and every process a test starts.

    Every entry is kept, however quick its compile: tests build the same programs from
    different closures (a model's step, a stack's gradient), which JAX's in-memory caches, keyed
    by the function, compile again; this cache, keyed by the program, compiles each once (in
    three test modules 995 of 2,305 compiles hit it and XLA's compile time fell from 55 s to
    47 s; whole runs of the suite, which vary by about 5% here, took 700 s and 737 s against
    763 s before). Not shared between the workers: JAX's cache locks its files only with
    eviction on, which needs ``filelock``.

    The trainer sets ``jax_compilation_cache_dir`` from ``train.compile_cache`` only when it is
    unset, so with this set no test run writes a cache where the config says (by default the
    user's cache directory). Set before the first compile: JAX decides once per process whether
    it uses the cache.
    """
    with shared_compilation_cache(str(tmp_path_factory.mktemp("jax_cache"))):
        yield


@pytest.fixture(params=["default", "remat3+custom_vjp3"])
def jax_upgrade_flags(request):
    """Runs the test with JAX's defaults, then with ``jax_remat3`` and ``jax_custom_vjp3`` on."""
    before = {flag: getattr(jax.config, flag) for flag in _UPGRADE_FLAGS}
    wanted = {flag: request.param != "default" for flag in _UPGRADE_FLAGS}
    _set_flags(wanted)
    try:
        yield request.param
    finally:
        _set_flags(before)


def _set_flags(values: dict[str, bool]) -> None:
    # Both flags are part of JAX's jit key and trace context: nothing traced under one setting
    # is reused under the other, so no cache needs clearing.
    for flag, value in values.items():
        jax.config.update(flag, value)


def pytest_collection_modifyitems(config, items):
    """The modules that hold a test marked ``slow`` first, then the others, most tests first;
    each module's tests in their order.

    ``make test`` hands whole modules to its two workers (``--dist loadscope``), longest first
    where it can tell, so that what is left at the end is short. xdist's own order
    (``--loadscope-reorder``, turned off in the Makefile) is most tests first, which starts the
    quick benchmarks (two tests, two minutes) among the last modules. Measured, one run each:
    with the slow modules first (the others in collection order) the suite's wall time exceeded
    half its tests' summed time by 43 s, against 56-57 s in xdist's order."""

    def module(item):  # the file, as loadscope scopes it (doctests included)
        return item.nodeid.split("::")[0]

    count = collections.Counter(module(item) for item in items)
    slow = {module(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (module(item) not in slow, -count[module(item)], module(item)))
