"""Safe YAML loading that remembers where every value came from.

PyYAML's ``safe_load`` forgets positions and silently keeps the last of two duplicate keys. Here
SafeLoader only *composes* the node graph; we build plain Python (dict, list, str, int, float,
bool, None) ourselves, record a 1-based ``(line, col)`` per breadcrumb, and refuse anything a
spec should never contain: duplicate keys, non-core tags (``!!python/object`` is reported, never
constructed), merge keys, non-string keys, several documents. Problems come back as diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .diagnostics import Diagnostic, Location, join_breadcrumb

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {f"{_CORE}{name}" for name in ("str", "int", "float", "bool", "null")}
# Unquoted dates resolve to timestamps; a spec wants them as the text that was written.
_TEXT_TAGS = {f"{_CORE}timestamp"}


# libyaml's composer is ~10x faster than the pure-Python one and gives the same marks; both only
# compose nodes here (construction is ours), so neither ever builds a Python object from a tag.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass
class LoadedYaml:
    """The constructed document (``None`` if loading failed), its positions and the problems found."""

    data: Any = None
    positions: dict[str, Location] = field(default_factory=dict)
    diagnostics: list[Diagnostic] = field(default_factory=list)


def load_yaml(path: str | Path, display: str | None = None) -> LoadedYaml:
    """Read ``path`` (UTF-8) and load its single YAML document; ``display`` names it in diagnostics."""
    name = display if display is not None else str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        return LoadedYaml(
            diagnostics=[Diagnostic(name, 1, 1, "", f"cannot read: {exc.strerror or exc}", code="io")]
        )
    return load_yaml_bytes(raw, name)


def load_yaml_bytes(raw: bytes, name: str) -> LoadedYaml:
    """Load one YAML document from ``raw``; never raises for bad input."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line, col = _offset_position(raw, exc.start)
        message = f"not valid UTF-8 (byte 0x{raw[exc.start]:02x}); save the spec as UTF-8"
        return LoadedYaml(diagnostics=[Diagnostic(name, line, col, "", message, code="encoding")])
    loader = _SafeLoader(text)
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        return LoadedYaml(diagnostics=[_syntax_diagnostic(name, exc)])
    except yaml.YAMLError as exc:  # unmarked reader errors, e.g. control characters
        return LoadedYaml(diagnostics=[Diagnostic(name, 1, 1, "", f"YAML error: {exc}", code="yaml-syntax")])
    finally:
        loader.dispose()
    if root is None:
        return LoadedYaml(diagnostics=[Diagnostic(name, 1, 1, "", "spec file is empty", code="empty")])
    builder = _Builder(name)
    data = builder.build(root, "")
    return LoadedYaml(data, builder.positions, builder.diagnostics)


def _offset_position(raw: bytes, offset: int) -> Location:
    line_start = raw.rfind(b"\n", 0, offset) + 1
    return raw.count(b"\n", 0, offset) + 1, offset - line_start + 1


def _syntax_diagnostic(name: str, exc: yaml.MarkedYAMLError) -> Diagnostic:
    mark = exc.problem_mark or exc.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    if isinstance(exc, yaml.composer.ComposerError) and "another document" in (exc.problem or ""):
        return Diagnostic(
            name, line, col, "", "a spec file holds one YAML document; found a second", code="multi-doc"
        )
    message = exc.problem or str(exc)
    if exc.context:
        context = exc.context
        if exc.context_mark and exc.context_mark is not mark:
            context += f" started at {exc.context_mark.line + 1}:{exc.context_mark.column + 1}"
        message = f"{message} ({context})"
    return Diagnostic(name, line, col, "", f"YAML syntax error: {message}", code="yaml-syntax")


class _Builder:
    """Constructs plain data from composed nodes, collecting positions and problems."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.positions: dict[str, Location] = {}
        self.diagnostics: list[Diagnostic] = []
        self._constructor = SafeConstructor()
        self._active: set[int] = set()  # nodes being built: an alias back to one is a cycle

    def _error(self, node: Node, breadcrumb: str, message: str, code: str) -> None:
        mark = node.start_mark
        self.diagnostics.append(
            Diagnostic(self.name, mark.line + 1, mark.column + 1, breadcrumb, message, code=code)
        )

    def build(self, node: Node, breadcrumb: str, mark_node: Node | None = None) -> Any:
        """Build ``node``; its position is that of ``mark_node`` (the key, for mapping values)."""
        start = (mark_node or node).start_mark
        self.positions.setdefault(breadcrumb, (start.line + 1, start.column + 1))
        if id(node) in self._active:
            self._error(node, breadcrumb, "recursive alias: a node cannot contain itself", "yaml-alias")
            return None
        if isinstance(node, ScalarNode):
            return self._scalar(node, breadcrumb)
        if node.tag not in (f"{_CORE}seq", f"{_CORE}map"):
            self._error(node, breadcrumb, _tag_message(node.tag), "yaml-tag")
            return None
        self._active.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                return [self.build(item, join_breadcrumb(breadcrumb, i)) for i, item in enumerate(node.value)]
            assert isinstance(node, MappingNode)
            return self._mapping(node, breadcrumb)
        finally:
            self._active.discard(id(node))

    def _scalar(self, node: ScalarNode, breadcrumb: str) -> Any:
        if node.tag in _TEXT_TAGS:
            return node.value
        if node.tag not in _SCALAR_TAGS:
            self._error(node, breadcrumb, _tag_message(node.tag), "yaml-tag")
            return None
        return self._constructor.yaml_constructors[node.tag](self._constructor, node)

    def _mapping(self, node: MappingNode, breadcrumb: str) -> dict[str, Any]:
        result: dict[str, Any] = {}
        first_seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == f"{_CORE}merge":
                self._error(
                    key_node,
                    breadcrumb,
                    "merge keys (<<) are not supported; write the keys out",
                    "yaml-merge",
                )
                continue
            key = self.build(key_node, breadcrumb) if isinstance(key_node, ScalarNode) else None
            if not isinstance(key, str):
                shown = key_node.value if isinstance(key_node, ScalarNode) else "a collection"
                self._error(key_node, breadcrumb, f"keys must be strings; quote {shown!r}", "yaml-key")
                continue
            child = join_breadcrumb(breadcrumb, key)
            line = key_node.start_mark.line + 1
            if key in first_seen:
                message = f"duplicate key {key!r} (first defined on line {first_seen[key]})"
                self._error(key_node, child, message, "duplicate-key")
                continue
            first_seen[key] = line
            result[key] = self.build(value_node, child, mark_node=key_node)
        return result


def _tag_message(tag: str) -> str:
    shown = "!!" + tag[len(_CORE) :] if tag.startswith(_CORE) else tag
    return f"tag {shown} is not allowed: specs hold only strings, numbers, booleans, null, lists and mappings"
