"""Patch targets: ``pkg.module:Class.attr`` or ``remote:module_file:Class.attr``.

Resolution imports the module, walks to the owner (class or module) and reads the attribute
statically (``inspect.getattr_static``) so that staticmethod/classmethod wrappers and inherited
attributes are seen as they are stored, which is what restoring needs.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import KadaptError

REMOTE_PREFIX = "remote:"


@dataclass(frozen=True)
class TargetRef:
    """A parsed target string."""

    text: str
    module: str  # import path, or the remote code file's stem ("modeling_kimi_k25")
    owner_path: tuple[str, ...]  # attributes from the module down to the owner ("Class",)
    attr: str
    remote: bool

    @property
    def owner_name(self) -> str:
        return ".".join(self.owner_path) or self.module


def parse_target(text: str) -> TargetRef:
    remote = text.startswith(REMOTE_PREFIX)
    body = text[len(REMOTE_PREFIX) :] if remote else text
    module, sep, qualname = body.partition(":")
    parts = qualname.split(".") if qualname else []
    if not sep or not module or not parts or not all(p.isidentifier() for p in parts):
        raise KadaptError(
            f"bad patch target {text!r}: expected 'package.module:Class.attribute' "
            "or 'remote:module_file:Class.attribute'"
        )
    return TargetRef(text, module, tuple(parts[:-1]), parts[-1], remote)


@dataclass(frozen=True)
class Resolved:
    """An owner object and the attribute as stored (``raw``), or no attribute at all."""

    ref: TargetRef
    owner: Any  # class or module
    raw: Any  # static attribute value (function, staticmethod, ...) or None when missing
    exists: bool
    own: bool  # stored in owner.__dict__ (False: inherited, or missing)

    def function(self) -> Callable[..., Any]:
        """The plain function behind ``raw`` (unwrapping staticmethod/classmethod)."""
        func = getattr(self.raw, "__func__", self.raw)
        if not callable(func):
            raise KadaptError(
                f"patch target {self.ref.text} is not a function (found {type(self.raw).__name__})"
            )
        return func


def close_names(name: str, candidates: list[str]) -> str:
    matches = difflib.get_close_matches(name, candidates, n=5, cutoff=0.5)
    return f"; close names: {', '.join(matches)}" if matches else ""


def _walk(ref: TargetRef, module: Any) -> Any:
    node = module
    for i, name in enumerate(ref.owner_path):
        if not hasattr(node, name):
            where = ".".join(ref.owner_path[:i]) or ref.module
            public = [n for n in dir(node) if not n.startswith("_")]
            raise KadaptError(f"patch target {ref.text}: {where} has no {name!r}{close_names(name, public)}")
        node = getattr(node, name)
    return node


def resolve_in(ref: TargetRef, module: Any, *, must_exist: bool = True) -> Resolved:
    """Resolve ``ref`` inside an already imported module."""
    owner = _walk(ref, module)
    try:
        raw = inspect.getattr_static(owner, ref.attr)
    except AttributeError:
        if must_exist:
            names = [n for n in dir(owner) if not n.startswith("__")]
            hint = close_names(ref.attr, names)
            raise KadaptError(
                f"patch target {ref.text}: {ref.owner_name} has no attribute {ref.attr!r}{hint}"
            ) from None
        return Resolved(ref, owner, None, False, False)
    return Resolved(ref, owner, raw, True, ref.attr in vars(owner))


def import_module(ref: TargetRef) -> Any:
    try:
        return importlib.import_module(ref.module)
    except ImportError as exc:
        raise KadaptError(f"patch target {ref.text}: cannot import {ref.module}: {exc}") from exc
