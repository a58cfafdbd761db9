"""Dotted/indexed config paths such as ``vision_config.merge_kernel_size[0]``.

Config bridges name fields the way a reader of ``config.json`` sees them. The same path is walked
over the raw JSON mapping (before the config class exists) and over the built config object (for
private fields such as ``_attn_implementation`` that config classes drop from their kwargs).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import KadaptError

_TOKEN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)|\[(-?\d+)\]|(\.)")

Step = str | int  # a mapping key / attribute name, or a sequence index


def parse(path: str) -> tuple[Step, ...]:
    """Split ``a.b[0].c`` into ``("a", "b", 0, "c")``; reject anything else with a clear error."""
    steps: list[Step] = []
    pos = 0
    expect_name = True
    while pos < len(path):
        match = _TOKEN.match(path, pos)
        if match is None:
            raise KadaptError(f"bad config path {path!r} at character {pos + 1}")
        name, index, dot = match.groups()
        if dot:
            if expect_name:
                raise KadaptError(f"bad config path {path!r}: empty segment at character {pos + 1}")
            expect_name = True
        elif name:
            if not expect_name:
                raise KadaptError(f"bad config path {path!r}: missing '.' before {name!r}")
            steps.append(name)
            expect_name = False
        else:
            if expect_name:
                raise KadaptError(f"bad config path {path!r}: index without a field at character {pos + 1}")
            steps.append(int(index))
        pos = match.end()
    if expect_name:
        raise KadaptError(f"bad config path {path!r}: it must end with a field name or an index")
    return tuple(steps)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


def _child(node: Any, step: Step) -> Any:
    if isinstance(step, int):
        if isinstance(node, (list, tuple)) and -len(node) <= step < len(node):
            return node[step]
        return MISSING
    if isinstance(node, dict):
        return node.get(step, MISSING)
    return (
        MISSING if node is None or isinstance(node, (str, int, float, list)) else getattr(node, step, MISSING)
    )


def get(root: Any, path: str) -> Any:
    """Value at ``path`` in a dict tree or config object, or ``MISSING``."""
    node = root
    for step in parse(path):
        node = _child(node, step)
        if node is MISSING:
            return MISSING
    return node


def _parent(root: Any, path: str, *, create: bool) -> tuple[Any, Step]:
    steps = parse(path)
    node = root
    for step in steps[:-1]:
        nxt = _child(node, step)
        if nxt is MISSING or nxt is None:
            if not create or not isinstance(node, dict) or isinstance(step, int):
                raise KadaptError(f"config path {path!r}: {step!r} does not exist")
            nxt = node[step] = {}
        node = nxt
    return node, steps[-1]


def set_(root: Any, path: str, value: Any) -> None:
    """Set ``path`` (creating missing intermediate mappings in a dict tree)."""
    parent, last = _parent(root, path, create=True)
    if isinstance(last, int):
        if not isinstance(parent, list) or not -len(parent) <= last < len(parent):
            raise KadaptError(f"config path {path!r}: index {last} is out of range or not in a list")
        parent[last] = value
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        setattr(parent, last, value)


def delete(root: Any, path: str) -> None:
    """Remove a mapping key (dict trees only: renames happen before the config class exists)."""
    parent, last = _parent(root, path, create=False)
    if not isinstance(parent, dict) or isinstance(last, int):
        raise KadaptError(f"config path {path!r}: only mapping keys can be removed")
    parent.pop(last, None)
