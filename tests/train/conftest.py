"""Fixtures shared by the trainer tests (the tiny models themselves: tiny_models.py)."""

from __future__ import annotations

import pytest

from tests.trainer_cli import shared_compilation_cache


@pytest.fixture(scope="module")
def module_compile_cache(tmp_path_factory):
    """One JAX compilation cache for a test module and every child ``python -m train`` it starts.

    The runs of a module compile the same few programs, and XLA:CPU's compiles are the bulk of
    the time: through the cache each is compiled once between the process and its children.
    """
    with shared_compilation_cache(str(tmp_path_factory.mktemp("jax_cache"))) as path:
        yield path
