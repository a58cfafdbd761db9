"""Deterministic Python and Markdown spellings of spec values, used as Jinja filters.

Templates never call ``repr`` on arbitrary objects: a value that is not plain data (what YAML and
JSON produce) is a bug in a context builder, so it raises instead of printing an address.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

COMMENT_WIDTH = 108  # ruff's line length (110) with a margin; comments are never reflowed by ruff


def py_literal(value: Any) -> str:
    """Python source for plain data; mapping keys sorted so output never depends on dict order."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return f'float("{value}")'
        return repr(value)
    if isinstance(value, dict):
        items = ", ".join(f"{py_literal(k)}: {py_literal(value[k])}" for k in sorted(value, key=str))
        return "{" + items + "}"
    if isinstance(value, list):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(py_literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    raise TypeError(f"not plain data, cannot be rendered as a Python literal: {type(value).__name__}")


def py_docstring_text(text: object) -> str:
    """Spec text made inert inside a generated module's triple-quoted docstring.

    Backslashes and quotes are escaped (no ``\"\"\"`` can close the docstring early) and line breaks
    or other control characters become escapes, so the text stays one line of the docstring.
    """
    escaped = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in escaped)


def py_comment(text: str, indent: int = 0) -> str:
    """``text`` as ``# `` comment lines wrapped to the line length; continuation lines keep ``indent``.

    The first line is not indented (the template places it); ruff format never wraps comments, so
    a long ``why`` would otherwise break the line-length rule in generated code.
    """
    lines = textwrap.wrap(" ".join(str(text).split()), width=COMMENT_WIDTH - indent - 2) or [""]
    return ("\n" + " " * indent).join(f"# {line}" for line in lines)
