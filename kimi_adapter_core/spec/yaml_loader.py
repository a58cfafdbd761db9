"""Safe, bounded YAML loading that remembers where every value came from.

PyYAML's ``safe_load`` forgets positions and silently keeps the last of two duplicate keys. Here
a safe parser only yields *events*; we compose the node graph ourselves (iteratively, so no input
can exhaust the Python stack), build plain Python (dict, list, str, int, float, bool, None)
ourselves, record a 1-based ``(line, col)`` per breadcrumb, and refuse anything a spec should
never contain: duplicate keys, non-core tags (``!!python/object`` is reported, never
constructed), merge keys, non-string keys, values that do not fit their explicit tag
(``!!int ''``), characters YAML forbids, several documents. Problems come back as diagnostics.

Specs are small (the largest shipped one is ~6 KB, ~500 nodes, 6 levels deep), so loading is
bounded well above any real spec; each limit, when hit, is one located ``yaml-limit`` diagnostic
naming it:

- ``MAX_FILE_BYTES``: file size, checked before reading (and again while reading).
- ``MAX_DEPTH``: nesting of mappings/sequences, in the file and once aliases are expanded.
- ``MAX_NODES``: nodes in the file (scalars, sequences, mappings), counted while parsing.
- ``MAX_ALIAS_NODES``: nodes reached through aliases (``*name``), counting every node of every
  expansion, so an alias bomb ("billion laughs") stops within milliseconds.
- ``MAX_EXPANDED_CHARS``: characters of breadcrumbs recorded plus text reached through aliases,
  so long keys over many nodes cannot blow up the position table.

Only regular files are read: a FIFO, directory or device is refused before it is opened for
reading (and re-checked on the opened descriptor, which is opened non-blocking). Composing
without recursion matters: PyYAML's C composer (``CParser.get_single_node``) recurses on the C
stack and kills the process with SIGSEGV on a spec nested ~100,000 levels deep.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import SafeConstructor
from yaml.events import (
    AliasEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
)
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.reader import ReaderError
from yaml.resolver import Resolver

from ..safe_files import FileRefused, read_regular_file
from .diagnostics import Diagnostic, Location, join_breadcrumb

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {f"{_CORE}{name}" for name in ("str", "int", "float", "bool", "null")}
# Unquoted dates resolve to timestamps; a spec wants them as the text that was written.
_TEXT_TAGS = {f"{_CORE}timestamp"}
# ``!!null`` constructs None from any text: its value must really be a null (``~``, ``null``, ``""``).
_NULL = f"{_CORE}null"
# What YAML 1.1 allows in a stream (PyYAML's reader's set); found before parsing, so located.
_NOT_PRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")

MAX_FILE_BYTES = 1 << 20  # 1 MiB
MAX_DEPTH = 32
MAX_NODES = 10_000
MAX_ALIAS_NODES = 2_000
MAX_EXPANDED_CHARS = 1 << 24

# libyaml's parser is ~10x faster than the pure-Python one and gives the same marks; either only
# yields events here (composition and construction are ours), so neither builds a Python object
# from a tag.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_RESOLVER = Resolver()


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
        raw = read_regular_file(path, MAX_FILE_BYTES, "spec file")
    except FileRefused as exc:
        return LoadedYaml(diagnostics=[Diagnostic(name, 1, 1, "", exc.message, code=exc.code)])
    except OSError as exc:
        return LoadedYaml(
            diagnostics=[Diagnostic(name, 1, 1, "", f"cannot read: {exc.strerror or exc}", code="io")]
        )
    return load_yaml_bytes(raw, name)


class _LimitExceeded(Exception):
    def __init__(self, mark: Any, message: str) -> None:
        super().__init__(message)
        self.line, self.col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        self.message = message


def load_yaml_bytes(raw: bytes, name: str) -> LoadedYaml:
    """Load one YAML document from ``raw``; never raises for bad input."""
    if len(raw) > MAX_FILE_BYTES:
        message = f"file is {len(raw):,} bytes, over the {MAX_FILE_BYTES:,}-byte limit for a spec file"
        return LoadedYaml(diagnostics=[Diagnostic(name, 1, 1, "", message, code="yaml-limit")])
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line, col = _offset_position(raw, exc.start)
        message = f"not valid UTF-8 (byte 0x{raw[exc.start]:02x}); save the spec as UTF-8"
        return LoadedYaml(diagnostics=[Diagnostic(name, line, col, "", message, code="encoding")])
    bad = _NOT_PRINTABLE.search(text)
    if bad is not None:
        line, col = _text_position(text, bad.start())
        message = f"character U+{ord(bad.group()):04X} is not allowed in YAML (control or non-character)"
        return LoadedYaml(diagnostics=[Diagnostic(name, line, col, "", message, code="yaml-character")])
    try:
        root = _compose(text)
    except _LimitExceeded as exc:
        return LoadedYaml(
            diagnostics=[Diagnostic(name, exc.line, exc.col, "", exc.message, code="yaml-limit")]
        )
    except _SecondDocument as exc:
        line, col = exc.problem_mark.line + 1, exc.problem_mark.column + 1
        message = "a spec file holds one YAML document; found a second"
        return LoadedYaml(diagnostics=[Diagnostic(name, line, col, "", message, code="multi-doc")])
    except yaml.MarkedYAMLError as exc:
        if "maximum nesting depth" in (exc.problem or ""):
            # PyYAML >= 6.0.4's scanner stops at 1,000 flow levels while looking ahead, before the
            # events reach MAX_DEPTH: the same limit, reported as ours
            mark = exc.problem_mark or exc.context_mark
            limit = _LimitExceeded(mark, f"nested more than {MAX_DEPTH} levels deep (limit for a spec file)")
            return LoadedYaml(
                diagnostics=[Diagnostic(name, limit.line, limit.col, "", limit.message, code="yaml-limit")]
            )
        return LoadedYaml(diagnostics=[_syntax_diagnostic(name, exc)])
    except ReaderError as exc:  # invalid characters the scan above did not catch
        return LoadedYaml(diagnostics=[_reader_diagnostic(name, text, exc)])
    except yaml.YAMLError as exc:  # anything else unmarked: still one line
        message = " ".join(str(exc).split())
        return LoadedYaml(
            diagnostics=[Diagnostic(name, 1, 1, "", f"YAML error: {message}", code="yaml-syntax")]
        )
    if root is None:
        return LoadedYaml(diagnostics=[Diagnostic(name, 1, 1, "", "spec file is empty", code="empty")])
    builder = _Builder(name)
    try:
        data = builder.build(root, "")
    except _LimitExceeded as exc:
        limit = Diagnostic(name, exc.line, exc.col, "", exc.message, code="yaml-limit")
        return LoadedYaml(None, builder.positions, [*builder.diagnostics, limit])
    return LoadedYaml(data, builder.positions, builder.diagnostics)


def _offset_position(raw: bytes, offset: int) -> Location:
    line_start = raw.rfind(b"\n", 0, offset) + 1
    return raw.count(b"\n", 0, offset) + 1, offset - line_start + 1


def _text_position(text: str, offset: int) -> Location:
    line_start = text.rfind("\n", 0, offset) + 1
    return text.count("\n", 0, offset) + 1, offset - line_start + 1


def _reader_diagnostic(name: str, text: str, exc: ReaderError) -> Diagnostic:
    """libyaml reports a byte offset into the UTF-8 text; PyYAML a character offset."""
    position = max(0, int(exc.position or 0))
    if _SafeLoader is not yaml.SafeLoader:
        encoded = text.encode("utf-8")
        position = len(encoded[:position].decode("utf-8", "ignore"))
    line, col = _text_position(text, min(position, len(text)))
    char = exc.character if isinstance(exc.character, int) else ord(exc.character or "\0")
    message = f"character U+{char:04X} is not allowed in YAML ({exc.reason})"
    return Diagnostic(name, line, col, "", message, code="yaml-character")


def _syntax_diagnostic(name: str, exc: yaml.MarkedYAMLError) -> Diagnostic:
    mark = exc.problem_mark or exc.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    message = exc.problem or str(exc)
    if exc.context:
        context = exc.context
        if exc.context_mark and exc.context_mark is not mark:
            context += f" started at {exc.context_mark.line + 1}:{exc.context_mark.column + 1}"
        message = f"{message} ({context})"
    message = " ".join(message.split())
    return Diagnostic(name, line, col, "", f"YAML syntax error: {message}", code="yaml-syntax")


def _compose(text: str) -> Node | None:
    """Compose the single document of ``text`` from parser events, without recursion, bounded.

    The same graph PyYAML's composer builds (aliases share the anchored node, which may contain
    itself; the builder reports that), with ``MAX_DEPTH`` and ``MAX_NODES`` enforced as events
    arrive, so an over-long or over-deep file stops early.
    """
    loader = _SafeLoader(text)
    try:
        loader.get_event()  # stream start
        if loader.check_event(StreamEndEvent):
            return None
        loader.get_event()  # document start
        root = _compose_node(loader)
        loader.get_event()  # document end
        if not loader.check_event(StreamEndEvent):
            event = loader.get_event()
            raise _SecondDocument(event.start_mark)
        return root
    finally:
        loader.dispose()


class _SecondDocument(yaml.MarkedYAMLError):
    def __init__(self, mark: Any) -> None:
        super().__init__(problem="found a second document", problem_mark=mark)


def _compose_node(loader: Any) -> Node:
    anchors: dict[str, Node] = {}
    stack: list[list[Any]] = []  # [collection node, pending mapping key or None]
    nodes = 0
    while True:
        event = loader.get_event()
        if isinstance(event, (SequenceEndEvent, MappingEndEvent)):
            value, _ = stack.pop()
            value.end_mark = event.end_mark
            if not stack:
                return value
            _attach(stack[-1], value)
            continue
        nodes += 1
        if nodes > MAX_NODES:
            raise _LimitExceeded(
                event.start_mark, f"more than {MAX_NODES:,} YAML nodes (limit for a spec file)"
            )
        if isinstance(event, AliasEvent):
            if event.anchor not in anchors:
                raise ComposerError(None, None, f"found undefined alias {event.anchor!r}", event.start_mark)
            value = _alias_use(anchors[event.anchor], event)
        else:
            anchor = event.anchor
            if anchor is not None and anchor in anchors:
                raise ComposerError(
                    f"found duplicate anchor {anchor!r}; first occurrence",
                    anchors[anchor].start_mark,
                    "second occurrence",
                    event.start_mark,
                )
            tag = event.tag
            if isinstance(event, ScalarEvent):
                if tag is None or tag == "!":
                    tag = loader.resolve(ScalarNode, event.value, event.implicit)
                value = ScalarNode(tag, event.value, event.start_mark, event.end_mark, style=event.style)
            elif isinstance(event, (SequenceStartEvent, MappingStartEvent)):
                kind = SequenceNode if isinstance(event, SequenceStartEvent) else MappingNode
                if tag is None or tag == "!":
                    tag = loader.resolve(kind, None, event.implicit)
                value = kind(tag, [], event.start_mark, None, flow_style=event.flow_style)
                if len(stack) >= MAX_DEPTH:
                    raise _LimitExceeded(
                        event.start_mark, f"nested more than {MAX_DEPTH} levels deep (limit for a spec file)"
                    )
            else:  # the parser guarantees node events here
                raise ComposerError(None, None, f"unexpected {event}", event.start_mark)
            if anchor is not None:
                anchors[anchor] = value
            if not isinstance(value, ScalarNode):
                stack.append([value, None])
                continue
        if not stack:
            return value
        _attach(stack[-1], value)


def _alias_use(target: Node, event: AliasEvent) -> Node:
    """The anchored node as used at an alias: same tag and (shared) content, the alias's marks."""
    use = copy.copy(target)
    use.start_mark, use.end_mark = event.start_mark, event.end_mark
    use.kadapt_alias = True  # type: ignore[attr-defined]
    return use


def _attach(top: list[Any], value: Node) -> None:
    """Add ``value`` to the open collection ``top``: an item, a mapping key, or that key's value."""
    if isinstance(top[0], SequenceNode):
        top[0].value.append(value)
    elif top[1] is None:
        top[1] = value
    else:
        top[0].value.append((top[1], value))
        top[1] = None


class _Builder:
    """Constructs plain data from composed nodes, collecting positions and problems."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.positions: dict[str, Location] = {}
        self.diagnostics: list[Diagnostic] = []
        self._constructor = SafeConstructor()
        self._active: set[int] = set()  # contents being built: an alias back to one is a cycle
        self._alias_nodes = 0
        self._chars = 0

    def _error(self, node: Node, breadcrumb: str, message: str, code: str) -> None:
        mark = node.start_mark
        self.diagnostics.append(
            Diagnostic(self.name, mark.line + 1, mark.column + 1, breadcrumb, message, code=code)
        )

    def _account(self, node: Node, breadcrumb: str, depth: int, alias: Node | None) -> None:
        """Enforce the limits that aliases can multiply (depth, expansion, recorded size).

        A limit is reported at the outermost alias being expanded (``alias``), else at ``node``.
        """
        mark = (alias or node).start_mark
        if depth > MAX_DEPTH:
            raise _LimitExceeded(
                mark,
                f"nested more than {MAX_DEPTH} levels deep once aliases are expanded (limit for a spec file)",
            )
        self._chars += len(breadcrumb)
        if alias is not None:
            self._alias_nodes += 1
            if self._alias_nodes > MAX_ALIAS_NODES:
                raise _LimitExceeded(
                    mark,
                    f"aliases expand to more than {MAX_ALIAS_NODES:,} nodes (limit for a spec file)",
                )
            if isinstance(node, ScalarNode):
                self._chars += len(node.value)
        if self._chars > MAX_EXPANDED_CHARS:
            raise _LimitExceeded(
                mark,
                f"expanded document exceeds {MAX_EXPANDED_CHARS:,} characters of paths and aliased text "
                "(limit for a spec file)",
            )

    def build(
        self,
        node: Node,
        breadcrumb: str,
        mark_node: Node | None = None,
        depth: int = 0,
        alias: Node | None = None,
    ) -> Any:
        """Build ``node``; its position is that of ``mark_node`` (the key, for mapping values).

        ``alias`` is the outermost alias use being expanded (``None`` outside any expansion).
        """
        if alias is None and getattr(node, "kadapt_alias", False):
            alias = node
        self._account(node, breadcrumb, depth, alias)
        start = (mark_node or node).start_mark
        self.positions.setdefault(breadcrumb, (start.line + 1, start.column + 1))
        if isinstance(node, ScalarNode):
            return self._scalar(node, breadcrumb)
        # an alias shares its anchor's content list: seeing that list again inside itself is a cycle
        content = id(node.value)
        if content in self._active:
            self._error(node, breadcrumb, "recursive alias: a node cannot contain itself", "yaml-alias")
            return None
        if node.tag not in (f"{_CORE}seq", f"{_CORE}map"):
            self._error(node, breadcrumb, _tag_message(node.tag), "yaml-tag")
            return None
        self._active.add(content)
        try:
            if isinstance(node, SequenceNode):
                return [
                    self.build(item, join_breadcrumb(breadcrumb, i), depth=depth + 1, alias=alias)
                    for i, item in enumerate(node.value)
                ]
            assert isinstance(node, MappingNode)
            return self._mapping(node, breadcrumb, depth, alias)
        finally:
            self._active.discard(content)

    def _scalar(self, node: ScalarNode, breadcrumb: str) -> Any:
        if node.tag in _TEXT_TAGS:
            return node.value
        if node.tag not in _SCALAR_TAGS:
            self._error(node, breadcrumb, _tag_message(node.tag), "yaml-tag")
            return None
        shown = "!!" + node.tag[len(_CORE) :]
        implicit = _RESOLVER.resolve(ScalarNode, node.value, (True, False))
        if node.tag == _NULL and implicit != _NULL:
            self._error(node, breadcrumb, f"{_shorten(node.value)} is not a valid {shown}", "yaml-tag-value")
            return None
        try:
            return self._constructor.yaml_constructors[node.tag](self._constructor, node)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
            # an explicit tag on text that is not of its kind (``!!int ''``), or a value of the right
            # form that Python cannot hold (an int over the 4300-digit conversion limit)
            message = f"{_shorten(node.value)} is not a valid {shown}"
            if implicit == node.tag:
                message += f": {_shorten(' '.join(str(exc).split()), 120, quote=False)}"
            self._error(node, breadcrumb, message, "yaml-tag-value")
            return None

    def _mapping(self, node: MappingNode, breadcrumb: str, depth: int, alias: Node | None) -> dict[str, Any]:
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
            key = (
                self.build(key_node, breadcrumb, depth=depth + 1, alias=alias)
                if isinstance(key_node, ScalarNode)
                else None
            )
            if not isinstance(key, str):
                shown = _shorten(key_node.value) if isinstance(key_node, ScalarNode) else "a collection"
                self._error(key_node, breadcrumb, f"keys must be strings; quote {shown}", "yaml-key")
                continue
            child = join_breadcrumb(breadcrumb, key)
            line = key_node.start_mark.line + 1
            if key in first_seen:
                message = f"duplicate key {_shorten(key)} (first defined on line {first_seen[key]})"
                self._error(key_node, child, message, "duplicate-key")
                continue
            first_seen[key] = line
            result[key] = self.build(value_node, child, mark_node=key_node, depth=depth + 1, alias=alias)
        return result


def _shorten(value: str, limit: int = 60, *, quote: bool = True) -> str:
    """``repr`` of ``value`` (or the text itself), cut to about ``limit`` characters."""
    shown = repr(value) if quote else value
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _tag_message(tag: str) -> str:
    shown = "!!" + tag[len(_CORE) :] if tag.startswith(_CORE) else tag
    return f"tag {shown} is not allowed: specs hold only strings, numbers, booleans, null, lists and mappings"
