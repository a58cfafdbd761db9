"""Copy kadapt's own Python source into generated modules, so there is one source of truth.

Two uses: the extraction runtime module is embedded whole (its body verbatim, its imports hoisted
to the top of the generated file so the result stays a well-formed module), and each builtin patch
implementation is embedded with ``inspect.getsource`` together with whatever it needs from its own
module — helpers are copied too, modules and third-party names become imports, plain constants
become assignments. Anything that would only resolve with kadapt installed is refused.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import KadaptError

_OWN_PACKAGE = "kimi_adapter_core"


@dataclass(frozen=True)
class EmbeddedModule:
    """A module split for embedding: hoisted import lines, then the body exactly as written."""

    imports: tuple[str, ...]
    body: str
    summary: str
    names: frozenset[str]  # top-level names the body binds (imports included)
    definitions: frozenset[str]  # top-level functions, classes and assignments (imports left out)
    source: str  # where it comes from, e.g. "kimi_adapter_core/upstream.py" (the generated comment)


def split_module(path: Path, *, provided: frozenset[str] = frozenset()) -> EmbeddedModule:
    """Split ``path`` into its leading imports and the rest; ``__future__`` imports are dropped
    (the generated module declares its own) and the docstring becomes ``summary``. A relative import
    is refused unless every name it binds is ``provided`` (the generated module defines its own, as it
    does ``KadaptError`` for the embedded binder); such an import is dropped."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    lines = source.splitlines(keepends=True)
    statements = list(tree.body)
    summary = ""
    if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
        summary = str(statements[0].value.value).strip().splitlines()[0]
        statements.pop(0)
    imports: list[str] = []
    body_start = len(lines)
    for node in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not (
                isinstance(node, ast.ImportFrom)
                and (node.module == "__future__" or _provides(node, provided))
            ):
                imports.append("".join(lines[node.lineno - 1 : node.end_lineno]).strip())
            continue
        body_start = _first_line(node) - 1
        break
    for node in statements:
        if isinstance(node, ast.ImportFrom) and node.level and not _provides(node, provided):
            raise KadaptError(
                f"{path.name} uses a relative import and cannot be embedded in a generated module"
            )
    names = frozenset(_defined_names(statements))
    imported = frozenset(
        _defined_names([n for n in statements if isinstance(n, (ast.Import, ast.ImportFrom))])
    )
    body = "".join(lines[body_start:]).strip("\n") + "\n"
    return EmbeddedModule(tuple(imports), body, summary, names, names - imported, _package_path(path))


def _provides(node: ast.ImportFrom, provided: frozenset[str]) -> bool:
    """Whether relative import ``node`` binds only names the generated module defines itself."""
    return bool(node.level) and all(alias.asname is None and alias.name in provided for alias in node.names)


def _package_path(path: Path) -> str:
    """``path`` from kadapt's package folder on (``kimi_adapter_core/upstream.py``), for provenance."""
    parts = path.resolve().parts
    return "/".join(parts[len(parts) - 1 - parts[::-1].index(_OWN_PACKAGE) :])


def _first_line(node: ast.stmt) -> int:
    decorators = getattr(node, "decorator_list", None) or []
    return min([node.lineno, *(d.lineno for d in decorators)])


def _defined_names(statements: list[ast.stmt]) -> list[str]:
    names: list[str] = []
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.extend(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.extend((a.asname or a.name).split(".")[0] for a in node.names)
    return names


@dataclass
class EmbeddedCallables:
    """Source of builtin implementations plus the imports and helpers they need, in order.

    ``provided`` names the kadapt modules embedded whole in the same generated file (``upstream``):
    what a callable uses from one of them is already defined there, so it is neither copied nor refused.
    """

    provided: dict[str, frozenset[str]] = field(default_factory=dict)  # module -> names its body defines
    imports: set[str] = field(default_factory=set)
    constants: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # name -> source, dependency order

    def add(self, func: Callable[..., Any], *, what: str) -> str:
        """Embed ``func`` (and its helpers); return the name it is defined under."""
        func = inspect.unwrap(func)
        if not isinstance(func, types.FunctionType):
            raise KadaptError(f"{what}: only plain functions can be embedded, got {type(func).__name__}")
        name = func.__name__
        if name in self.sources:
            return name
        source = textwrap.dedent(inspect.getsource(func))
        self.sources[name] = ""  # reserve: breaks cycles between mutually recursive helpers
        for global_name in sorted(_global_names(source)):
            self._resolve(global_name, func, what=what)
        self.sources.pop(name)
        self.sources[name] = source.strip("\n") + "\n"
        return name

    def _resolve(self, name: str, func: types.FunctionType, *, what: str) -> None:
        if name not in func.__globals__:
            return  # a builtin, a parameter or a local: nothing to carry over
        obj = func.__globals__[name]
        if name in self.provided.get(getattr(obj, "__module__", ""), ()):
            return  # defined by a module embedded whole beside it
        if isinstance(obj, types.ModuleType):
            self._require_standalone(obj.__name__, what=what, name=name)
            self.imports.add(_module_import(obj.__name__, name))
        elif isinstance(obj, types.FunctionType) and obj.__module__ == func.__module__:
            self.add(obj, what=what)
        elif isinstance(obj, (types.FunctionType, type)):
            self._require_standalone(obj.__module__, what=what, name=name)
            alias = "" if obj.__qualname__ == name else f" as {name}"
            self.imports.add(f"from {obj.__module__} import {obj.__qualname__}{alias}")
        elif obj is None or isinstance(obj, (bool, int, float, str, tuple)):
            self.constants[name] = obj
        else:
            raise KadaptError(
                f"{what}: cannot embed global '{name}' ({type(obj).__name__}) used by {func.__name__}"
            )

    @staticmethod
    def _require_standalone(module: str, *, what: str, name: str) -> None:
        if module == _OWN_PACKAGE or module.startswith(_OWN_PACKAGE + "."):
            raise KadaptError(
                f"{what}: uses '{name}' from {module}; a generated module must import without kadapt"
            )


def _module_import(module: str, name: str) -> str:
    """``import torch`` / ``from torch import nn`` / ``import numpy as np``: the usual spelling."""
    if module == name:
        return f"import {module}"
    parent, _, leaf = module.rpartition(".")
    if parent and leaf == name:
        return f"from {parent} import {leaf}"
    return f"import {module} as {name}"


def _global_names(source: str) -> set[str]:
    """Names a function reads that it does not bind itself (a superset is fine: unknowns are skipped)."""
    tree = ast.parse(source)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
