"""Catalogue of built-in implementations: name -> ("module:attribute", one-line summary).

Kept torch-free on purpose (vLLM-registry style lazy strings): validation reads the names,
``resolve`` imports the implementation only when a spec is applied. One line per builtin.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

BUILTINS: dict[str, tuple[str, str]] = {
    # name: ("module:attribute", "what it does")
}


def resolve(name: str) -> Callable[..., Any]:
    """Import the implementation registered as ``name`` (KeyError lists nothing: callers report)."""
    module_name, _, attribute = BUILTINS[name][0].partition(":")
    return getattr(importlib.import_module(module_name), attribute)
