"""The project's shape, kept by a test: no import cycle among its modules, no long function in
remat_nn/ and train/, no private name imported across packages.

Imports are read from the source (module-level and function-local alike), so a cycle hidden by a
deferred import counts. A private name is a module or attribute whose last dotted part starts
with ``_`` (``remat_nn._memory``, ``from remat_nn.invertible import _walk``); a package may use
its own private names, other packages use the public API. Exceptions are listed below, each with
its reason.

Run: python -m pytest tests/project/test_architecture.py -q -p no:xdist
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("remat_nn", "models", "train", "benchmarks")
MAX_FUNCTION_LINES = 80  # lines of a function without its docstring, in remat_nn/ and train/
LONG_FUNCTIONS: dict[str, str] = {
    # "path.py:function": "why it stays long" (none today)
}
_ANALYSIS = "the invertible benchmark times rn.invertible's analysis itself, apart from tracing"
_JAX = "remat_nn._jax_internals is the one module that imports JAX's private API; not re-exported"
_SKETCHES = (
    "the invertible benchmark's memory target: how many bytes the forward pass's sketches take "
    "(which values rn.invertible sketches, and their size), to tell them from a stored "
    "activation; a measuring tool"
)
PRIVATE_IMPORTS: dict[tuple[str, str], str] = {
    # (importing package, imported private module or name): why
    ("benchmarks", "remat_nn.invertible._analysis.analyze"): _ANALYSIS,
    ("benchmarks", "remat_nn.invertible._api._trace"): _ANALYSIS,
    ("benchmarks", "remat_nn.invertible._vjp"): "the drift table (invertible_drift) measures the "
    "walk's gradient where its checks refuse it, by staging no check: a measuring tool",
    ("benchmarks", "remat_nn.invertible._sketch"): _SKETCHES,
    ("benchmarks", "remat_nn.invertible._scan_sketch.sketched"): _SKETCHES,
    ("benchmarks", "remat_nn._timing.timing_rounds"): "one implementation of paired timing rounds "
    "(the planner's race and the benchmarks); a measuring tool, not part of the library's API",
    ("models", "remat_nn._jax_internals.saved_residuals"): _JAX,
    ("train", "remat_nn._jax_internals.sub_jaxprs"): _JAX,
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path) -> list[str]:
    """Every dotted name ``module`` imports (``from a.b import c`` gives ``a.b.c``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names += [f"{base}.{a.name}" for a in node.names]
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name in _imports(module, path):
            target = name
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                edges[module].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _function_lengths(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            doc = 0
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    doc = (first.end_lineno or first.lineno) - first.lineno + 1
            length = (node.end_lineno or node.lineno) - node.lineno + 1 - doc
            out.append((length, node.name))
    return out


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_cycle_detection_finds_a_cycle():
    """The checker itself: a two-module and a three-module circle are found, a chain is not."""
    edges = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert _cycles(edges) == [["a", "b"], ["c", "d", "e"]]


def test_no_function_over_the_stated_length():
    long = {}
    for module, path in _modules().items():
        if module.split(".")[0] not in ("remat_nn", "train"):
            continue
        for length, name in _function_lengths(path):
            key = f"{path.relative_to(ROOT)}:{name}"
            if length > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                long[key] = length
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"
    stale = set(LONG_FUNCTIONS) - {
        f"{p.relative_to(ROOT)}:{n}"
        for p in _modules().values()
        for length, n in _function_lengths(p)
        if length > MAX_FUNCTION_LINES
    }
    assert not stale, f"LONG_FUNCTIONS lists functions that are no longer long: {stale}"


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def test_no_private_import_across_packages():
    found = set()
    for module, path in _modules().items():
        package = module.split(".")[0]
        for name in _imports(module, path):
            top = name.split(".")[0]
            if top in PACKAGES and top != package and _private(name):
                found.add((package, name))
    unexpected = sorted(found - set(PRIVATE_IMPORTS))
    assert unexpected == [], f"private names imported across packages: {unexpected}"
    stale = set(PRIVATE_IMPORTS) - found
    assert not stale, f"PRIVATE_IMPORTS lists imports that are gone: {stale}"
