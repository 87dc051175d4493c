"""Fixtures shared by the model tests."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest


@pytest.fixture
def user_model(tmp_path, monkeypatch) -> Iterator[Callable[[str, str], list[str]]]:
    """``user_model(name, source)``: writes ``source`` as the module ``name`` on the import path
    (a user's ``model.module``) and returns the overrides of a 2-step digits run in ``tmp_path``.
    The module is forgotten afterwards, so the next test imports its own."""
    names: list[str] = []

    def write(name: str, source: str) -> list[str]:
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return [
            "data.source=digits",
            "data.batch_size=16",
            "train.steps=2",
            "train.eval_every=2",
            "train.plot=false",
            "checkpoint.every=2",
            "mesh.data=1",
            f"run_dir={tmp_path / 'run'}",
        ]

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name in names:
        sys.modules.pop(name, None)
