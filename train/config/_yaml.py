"""The YAML reader: a strict safe loader, dotted ``key.sub=value`` overrides, config files.

On top of ``yaml.safe_load``: YAML 1.2 floats (``1e-3``), and as errors with their dotted path
(all collected, not the first only): duplicate keys, non-string keys, YAML 1.1 booleans
(``yes``/``no``/``on``/``off``) where the value is not meant as a string, octal-looking and
base-60 numbers, recursive or exploding aliases, tabs, several documents and bytes that are not
UTF-8. A YAML 1.1 boolean at a path where the schema wants a string (``wants_string``, e.g.
``train.progress: on``) is that string, as in YAML 1.2.

>>> tree, errors = read_yaml("optim: {lr: 1e-3}\\ntrain: {plot: yes, progress: on}\\n", "<text>",
...                          wants_string=lambda path: path == "train.progress")
>>> tree
{'optim': {'lr': 0.001}, 'train': {'plot': True, 'progress': 'on'}}
>>> errors  # doctest: +ELLIPSIS
[('train.plot', "'yes' is the boolean true in YAML 1.1 but the string 'yes' in YAML 1.2; ...")]
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from train.config._errors import ConfigError

__all__ = ["YamlLoader", "apply_overrides", "read_text", "read_yaml"]


class YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats such as ``1e-3`` as floats.

    YAML 1.1 (PyYAML) requires a dot in a float, so ``lr: 1e-3`` would be the string ``"1e-3"``.
    """


_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)
    |[-+]?(?:[0-9][0-9_]*)\.[0-9_]*
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))

# Plain scalars YAML 1.1 (PyYAML) and YAML 1.2 read differently: rejected, never guessed.
_BOOL_TAG, _INT_TAG, _FLOAT_TAG = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
_OCTAL_LIKE = re.compile(r"^[-+]?0[0-9_]+$")  # 010: octal 8 in YAML 1.1, decimal 10 in 1.2
_MAX_NODES = 100_000  # alias expansion ("billion laughs") stops here

_TAB_HINT = "YAML does not allow tabs for indentation; indent with spaces"


def _yaml_error(e: yaml.YAMLError) -> str:
    # PyYAML's messages span several lines (with a snippet and a caret): one line here.
    if isinstance(e, yaml.MarkedYAMLError):
        parts = [p for p in (e.context, e.problem) if p]
        mark = e.problem_mark or e.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        text = " ".join(", ".join(parts).split()) + where
        if "'\\t'" in text:
            text += f"; {_TAB_HINT}"
        return f"not valid YAML: {text}"
    return "not valid YAML: " + " ".join(str(e).split())


class _Builder:
    """Builds Python values from a composed YAML node tree, collecting errors by dotted path.

    On top of ``yaml.load``: duplicate keys (PyYAML keeps the last one silently), non-string
    keys, ``yes``/``no``/``on``/``off`` booleans, octal-looking and sexagesimal numbers, and
    recursive or exploding aliases are errors with the dotted path of the value.
    """

    def __init__(
        self,
        loader: YamlLoader,
        prefix: str = "",
        wants_string: Callable[[str], bool] | None = None,
    ):
        self.loader = loader
        self.prefix = prefix
        self.wants_string = wants_string or (lambda path: False)
        self.errors: list[tuple[str, str]] = []
        self.nodes = 0
        self.flattened: set[int] = set()

    def error(self, path: str, msg: str) -> None:
        self.errors.append((path or self.prefix, msg))

    def build(self, node: yaml.Node, path: str, stack: tuple[int, ...] = ()) -> Any:
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            raise _TooLarge
        if id(node) in stack:
            self.error(path, "a YAML alias refers to its own anchor (a recursive value)")
            return None
        stack = (*stack, id(node))
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, stack)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(n, _join(path, str(i)), stack) for i, n in enumerate(node.value)]
        return self._scalar(node, path)

    def _scalar(self, node: yaml.ScalarNode, path: str) -> Any:
        value = self.loader.construct_object(node, deep=True)
        text = node.value
        if node.tag == _BOOL_TAG and text.lower() not in ("true", "false"):
            if self.wants_string(path):
                return text  # YAML 1.2's reading, and the only one a string setting can mean
            self.error(
                path,
                f"{text!r} is the boolean {str(value).lower()} in YAML 1.1 but the string "
                f"{text!r} in YAML 1.2; write {str(value).lower()} for a boolean, or quote it "
                f"({text!r}) for a string",
            )
        elif node.tag == _INT_TAG and _OCTAL_LIKE.match(text):
            self.error(
                path,
                f"{text} has a leading zero: octal {value} in YAML 1.1, decimal "
                f"{int(text.replace('_', ''))} in YAML 1.2; write it without the leading zero "
                "(or quote it for a string)",
            )
        elif node.tag in (_INT_TAG, _FLOAT_TAG) and ":" in text:
            self.error(
                path,
                f"{text} is the base-60 number {value} in YAML 1.1; quote it for a string",
            )
        return value

    def _mapping(self, node: yaml.MappingNode, path: str, stack: tuple[int, ...]) -> Any:
        if id(node) not in self.flattened:
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                    continue
                key = key_node.value
                line = key_node.start_mark.line + 1
                if key in first_line:
                    self.error(
                        _join(path, key),
                        f"duplicate key (lines {first_line[key]} and {line}); YAML would keep "
                        "only the last value. Fix: remove one of them",
                    )
                else:
                    first_line[key] = line
            self.loader.flatten_mapping(node)  # `<<: *anchor` merges, as yaml.safe_load does
            self.flattened.add(id(node))
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.error(path, "a key must be a plain name, got a list or mapping as a key")
                continue
            key = self.loader.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                self.error(
                    _join(path, key_node.value),
                    f"key {key_node.value!r} is read as {type(key).__name__} {key!r}, not a "
                    f"name; quote it ('{key_node.value}') or use an option name",
                )
                continue
            out[key] = self.build(value_node, _join(path, key), stack)
        return out


class _TooLarge(Exception):
    pass


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def read_yaml(
    text: str,
    source: str,
    prefix: str = "",
    *,
    wants_string: Callable[[str], bool] | None = None,
) -> tuple[Any, list[tuple[str, str]]]:
    """Parses ``text``; returns the value and the errors found (dotted paths under ``prefix``).

    ``wants_string(dotted_path)`` says where a YAML 1.1 boolean (``on``, ``yes``, ...) is read as
    the string it spells instead of being an error.

    Raises:
      ConfigError: the text is not YAML at all (syntax, several documents, too deep or large).
    """
    loader = YamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, []
        builder = _Builder(loader, prefix, wants_string)
        value = builder.build(node, prefix)
        return value, builder.errors
    except yaml.YAMLError as e:
        raise ConfigError(source, [(prefix, _yaml_error(e))]) from None
    except RecursionError:
        raise ConfigError(source, [(prefix, "not valid YAML: nested too deeply")]) from None
    except _TooLarge:
        raise ConfigError(
            source, [(prefix, f"YAML aliases expand to more than {_MAX_NODES} values")]
        ) from None
    finally:
        loader.dispose()


def _parse_value(
    text: str, key: str, wants_string: Callable[[str], bool] | None
) -> tuple[Any, list[tuple[str, str]]]:
    # An override's value is YAML, checked like a file's; what is not YAML stays a string.
    try:
        return read_yaml(text, "<override>", key, wants_string=wants_string)
    except ConfigError:
        return text, []


def apply_overrides(
    tree: dict[str, Any],
    overrides: Iterable[str],
    *,
    wants_string: Callable[[str], bool] | None = None,
) -> list[tuple[str, str]]:
    """Sets ``key.sub=value`` overrides in ``tree`` in place; returns errors for malformed ones.

    Values are YAML (``3``, ``1e-3``, ``true``, ``[a, b]``, ``{save: [x]}``); ``key.sub=null``
    sets None; ``wants_string`` as :func:`read_yaml`'s.
    """
    errors: list[tuple[str, str]] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not p for p in key.split(".")):
            errors.append((key or item, f"cannot read override {item!r}; expected key.sub=value"))
            continue
        *parents, leaf = key.split(".")
        node = tree
        for i, p in enumerate(parents):
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                where = ".".join(parents[: i + 1])
                errors.append((key, f"{where} is {child!r}, not a section; cannot set {key}"))
                break
            node = child
        else:
            node[leaf], value_errors = _parse_value(value, key, wants_string)
            errors += value_errors
    return errors


def read_text(p: Path, source: str) -> str:
    # Every way a config path can fail to be a readable UTF-8 file is a ConfigError.
    if p.is_dir():
        raise ConfigError(source, [("", f"{str(p)!r} is a directory, not a YAML config file")])
    if not p.is_file():
        raise ConfigError(source, [("", f"no such config file {str(p)!r}")])
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(source, [("", f"cannot read {str(p)!r}: {e.strerror or e}")]) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        not_utf8 = (
            f"not UTF-8 text: byte 0x{data[e.start]:02x} at line {line} (offset {e.start}). "
            "Fix: save the file as UTF-8"
        )
        raise ConfigError(source, [("", not_utf8)]) from None
