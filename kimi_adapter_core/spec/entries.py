"""What the semantic checks share: a section's entries with their breadcrumbs, and did-you-mean hints."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from typing import Any


def entries(raw: dict[str, Any], section: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(breadcrumb, entry)`` of every mapping in list section ``section``, however malformed the rest."""
    items = raw.get(section)
    if isinstance(items, list):
        for index, item in enumerate(items):
            if isinstance(item, dict):
                yield f"{section}[{index}]", item


def closest(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""``."""
    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {prefix + match[0]!r}?)" if match else ""
