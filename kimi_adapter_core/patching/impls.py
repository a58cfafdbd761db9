"""Resolve ``impl`` strings: ``builtin:name`` from the catalogue, or ``package.module:callable``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..builtins.registry import BUILTINS, resolve
from ..errors import KadaptError
from .targets import close_names

BUILTIN_PREFIX = "builtin:"


def resolve_impl(text: str) -> Callable[..., Any]:
    """Import the implementation named by ``text``; unknown names list the closest known ones."""
    if text.startswith(BUILTIN_PREFIX):
        name = text[len(BUILTIN_PREFIX) :]
        if name not in BUILTINS:
            hint = close_names(name, sorted(BUILTINS)) or f"; known builtins: {', '.join(sorted(BUILTINS))}"
            raise KadaptError(f"unknown builtin {name!r}{hint}")
        try:
            return resolve(name)
        except (ImportError, AttributeError) as exc:
            raise KadaptError(f"builtin {name!r} is registered but cannot be imported: {exc}") from exc
    module_name, sep, attribute = text.partition(":")
    if not sep or not module_name or not attribute:
        raise KadaptError(f"bad impl {text!r}: expected 'builtin:name' or 'package.module:callable'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise KadaptError(f"impl {text}: cannot import {module_name}: {exc}") from exc
    node: Any = module
    for part in attribute.split("."):
        if not hasattr(node, part):
            names = [n for n in dir(node) if not n.startswith("_")]
            raise KadaptError(f"impl {text}: {module_name} has no {part!r}{close_names(part, names)}")
        node = getattr(node, part)
    if not callable(node):
        raise KadaptError(f"impl {text} is not callable")
    return node
