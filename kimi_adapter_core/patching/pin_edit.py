"""Rewrite the ``pin:`` blocks of a spec's patches in the YAML text, keeping everything else.

Editing lines in place (instead of re-dumping the YAML) keeps comments, key order, flow lists and
wrapping exactly as the author wrote them; only the pin lines of the listed patches change. Entry
positions come from the positioned loader (``Spec.positions``).
"""

from __future__ import annotations

import json

from ..spec.model import Pin, Spec


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _is_content(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _field_lines(pin: Pin, first: str, rest: str) -> list[str]:
    """The pinned fields, ``first`` before the first line and ``rest`` before the others."""
    fields = [
        ("transformers", pin.release),
        ("signature", pin.signature),
        ("source_sha256", pin.source_sha256),
    ]
    present = [(key, value) for key, value in fields if value is not None]
    return [
        f"{first if i == 0 else rest}{key}: {json.dumps(value)}\n" for i, (key, value) in enumerate(present)
    ]


def _pin_lines(pins: tuple[Pin, ...], indent: str) -> list[str]:
    """A ``pin:`` block: one source as a mapping, a per-release pin as a list of them."""
    lines = [f"{indent}pin:\n"]
    if len(pins) == 1 and pins[0].release is None:
        return lines + _field_lines(pins[0], f"{indent}  ", f"{indent}  ")
    for pin in pins:
        lines += _field_lines(pin, f"{indent}  - ", f"{indent}    ")
    return lines


def _entry_end(lines: list[str], start: int, key_indent: int) -> int:
    """Index after the entry's last content line (trailing comments/blanks stay outside)."""
    end = start + 1
    last_content = start
    while end < len(lines):
        line = lines[end]
        if _is_content(line):
            if _indent(line) < key_indent:
                break
            last_content = end
        end += 1
    return last_content + 1


def rewrite_pins(text: str, spec: Spec, pins: dict[str, tuple[Pin, ...]]) -> str:
    """``text`` with each patch ``id`` in ``pins`` carrying exactly those pins."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    edits: list[tuple[int, int, list[str]]] = []
    for patch in spec.patches:
        if patch.id not in pins:
            continue
        line_no, col = spec.positions[patch.where]
        start, key_indent = line_no - 1, col - 1
        end = _entry_end(lines, start, key_indent)
        block = _pin_lines(pins[patch.id], " " * key_indent)
        pin_at = next(
            (
                i
                for i in range(start, end)
                if _indent(lines[i]) == key_indent and lines[i].lstrip().startswith("pin:")
            ),
            None,
        )
        if pin_at is None:
            edits.append((end, end, block))
            continue
        pin_end = pin_at + 1
        while pin_end < end and (not _is_content(lines[pin_end]) or _indent(lines[pin_end]) > key_indent):
            pin_end += 1
        edits.append((pin_at, pin_end, block))
    for begin, finish, block in sorted(edits, reverse=True):
        lines[begin:finish] = block
    return "".join(lines)
