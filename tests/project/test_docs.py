"""Every code block of README.md and docs/*.md: Python runs, YAML parses, shell commands exist.

- ```` ```python ```` blocks run in order, README.md's in one namespace; each docs/ page's run in
  a copy of the namespace the README's leave (so a page may use ``loss``, ``params``, ``x``, ...,
  as its first block says). A block that must not run is fenced ```` ```python notest ```` (none
  is, today); indented blocks (inside a list item) are dedented.
- ```` ```yaml ```` blocks parse with the trainer's strict reader's base (``yaml.safe_load``).
- ```` ```bash ```` blocks: every ``python -m <module>`` names a module of this repository or an
  installed one, and every ``configs/*.yaml`` they name exists.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^( *)```([^\n]*)\n(.*?)^\1```", flags=re.S | re.M)


def blocks(path: Path) -> list[tuple[str, str, int]]:
    """(info string, dedented body, line) of each fenced block of ``path``."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        indent, info, body = m.groups()
        lines = [line[len(indent) :] for line in body.splitlines()]
        found.append((info.strip(), "\n".join(lines) + "\n", text.count("\n", 0, m.start()) + 1))
    return found


def run_python(path: Path, namespace: dict) -> int:
    ran = 0
    for info, body, line in blocks(path):
        if info != "python":
            continue
        code = compile(textwrap.dedent(body), f"{path.name}:{line}", "exec")
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, namespace)
        ran += 1
    return ran


@contextlib.contextmanager
def module_namespace(name: str, start: dict | None = None):
    # flax modules are dataclasses, which look their module up in sys.modules.
    module = types.ModuleType(name)
    module.__dict__.update({k: v for k, v in (start or {}).items() if not k.startswith("__")})
    sys.modules[name] = module
    try:
        yield module.__dict__
    finally:
        del sys.modules[name]


@pytest.fixture(scope="module")
def readme_namespace(tmp_path_factory):
    # Blocks that write files (the peak explainer's timeline) write them in a temporary folder.
    with contextlib.chdir(tmp_path_factory.mktemp("readme")):
        with module_namespace("readme_blocks") as namespace:
            assert run_python(ROOT / "README.md", namespace) >= 6
            yield namespace


def test_readme_python_blocks_run(readme_namespace):
    assert {"loss", "params", "x", "report", "stack"} <= readme_namespace.keys()


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_python_blocks_run(page, readme_namespace):
    with module_namespace(f"doc_blocks_{page.stem}", readme_namespace) as namespace:
        run_python(page, namespace)


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_yaml_and_shell_blocks(page):
    for info, body, line in blocks(page):
        where = f"{page.name}:{line}"
        if info == "yaml":
            assert yaml.safe_load(body) is not None, where
        elif info == "bash":
            for module in re.findall(r"python -m ([\w.]+)", body):
                top = module.split(".")[0]
                local = (ROOT / top).is_dir() or (ROOT / f"{top}.py").exists()
                assert local or importlib.util.find_spec(top), f"{where}: python -m {module}"
            for config in re.findall(r"configs/[\w.-]+\.yaml", body):
                assert (ROOT / config).exists(), f"{where}: {config}"
        else:
            assert info in ("", "python", "python notest"), f"{where}: unknown fence {info!r}"


def test_walkthrough_sections_are_in_the_trainer_page():
    text = (ROOT / "docs" / "trainer.md").read_text()
    assert "\n## Train on your data\n" in text and "\n## Train your model\n" in text
