"""Spec and config text on a generated Markdown page: escaped so it renders as the text it is.

Spec and config text is untrusted (a spec is downloaded like a checkpoint), so it must render as the
text it is, never as HTML, a link or image, or a new Markdown block; the docs template calls these for
every value it prints (``ESCAPES``), and each leaves the shipped specs' text as it was.
"""

from __future__ import annotations

import re
import string
from typing import Any

from .literals import py_literal

# Spec and config text reaches the page only through the functions below (the template calls them):
# it is untrusted (a spec is downloaded like a checkpoint), so it must render as the text it is, never
# as HTML, a link or image, or a new Markdown block. Each leaves the shipped specs' text as it was.
EMPTY = "\u2014"  # an em dash: the cell has no value
# Characters that are markup anywhere in a line: HTML, code spans, table cells, headings, images,
# strikethrough, backslash escapes themselves. Emphasis (* _) and brackets stay: they cannot inject
# anything once links are broken, and the shipped text uses them.
_TEXT_ESCAPES = {
    "\\": "\\\\",
    "`": "\\`",
    "|": "\\|",
    "<": "&lt;",
    ">": "&gt;",
    "&": "&amp;",
    "#": "\\#",
    "!": "\\!",
    "~": "\\~",
}
_LINK = re.compile(r"\](?=[(\[:])")  # "](" "][" "]:": an inline link or image, a reference, a definition
_BLOCK_START = re.compile(r"^(?:[-+*=_]|\d{1,9}(?=[.)]))")  # a list, thematic break or ordered list
# text a backtick code span shows as it is, in a table cell too (backslashes are literal in code spans)
_CODE_SAFE = re.compile(r"[^`|]*")
_REFERENCED = frozenset(string.punctuation)  # shown as character references inside a <code> element
_MERMAID_ESCAPES = {'"': "#quot;", "<": "#lt;", ">": "#gt;", "`": "#96;"}


def _one_line(value: Any) -> str:
    """``value`` as text on one line: line breaks and other control characters become spaces."""
    return "".join(ch if ch.isprintable() else " " for ch in str(value))


def md_text(value: Any) -> str:
    """Inline Markdown that renders as ``value``'s text: HTML characters as entities, markup escaped,
    ``](``/``][``/``]:`` broken so no link, image or link definition forms, on one line."""
    escaped = "".join(_TEXT_ESCAPES.get(ch, ch) for ch in _one_line(value))
    return _LINK.sub("]\\\\", escaped)


def md_paragraph(value: Any) -> str:
    """``md_text`` that starts a line: nothing at its start opens a list, a rule or a code block."""
    text = md_text(value).strip()
    return _BLOCK_START.sub(lambda m: m.group() + "\\" if m.group().isdigit() else "\\" + m.group(), text)


def md_cell(value: Any) -> str:
    """One table cell of spec text (``md_text``); a list joined with commas, nothing an em dash."""
    if isinstance(value, (list, tuple)):
        return ", ".join(md_cell(v) for v in value) if value else EMPTY
    if value is None or value == "":
        return EMPTY
    return md_text(value)


def md_code(value: Any) -> str:
    """A value as inline code (not a str: its Python literal; a list joined with commas, None an em
    dash). Text a code span cannot show as it is (a backtick, a pipe in a table cell, a line break)
    becomes a ``<code>`` element of character references: literal in every Markdown parser."""
    if value is None:
        return EMPTY
    if isinstance(value, (list, tuple)):
        return ", ".join(md_code(v) for v in value) if value else EMPTY
    text = value if isinstance(value, str) else py_literal(value)
    if text and _CODE_SAFE.fullmatch(text) and text.isprintable():
        return f"`{text}`"
    shown = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return "<code>" + "".join(f"&#{ord(ch)};" if ch in _REFERENCED else ch for ch in shown) + "</code>"


def comment_text(value: Any) -> str:
    """Text inside an HTML comment: on one line, and no ``--`` that could end the comment."""
    return _one_line(value).replace("--", "- -")


def mermaid_label(value: Any) -> str:
    """Text inside a quoted Mermaid node label: no quote ends it, no HTML or Markdown in it."""
    return "".join(_MERMAID_ESCAPES.get(ch, ch) for ch in _one_line(value))


# The escapes the template calls by name (the spec's own identity arrives escaped: ``render_docs``).
ESCAPES = {"text": md_text, "cell": md_cell, "code": md_code}
