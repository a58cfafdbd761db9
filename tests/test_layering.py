"""The package's architecture holds: layers, independent backends, no import cycle, modules of one concern.

The layers are data (``[tool.importlinter]`` in pyproject.toml, explained in docs/architecture.md);
import-linter checks them over every import statement, lazy imports inside functions included. The
cycle check uses the same import graph (grimp's) at module level, where a cycle means a module
whose import can re-enter itself half-initialised.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import warnings
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "kimi_adapter_core"
MAX_LINES = 500
# the marker a longer module's docstring carries, followed by why it stays one module
LONG_MODULE_REASON = "Why one module:"


def test_the_import_contracts_hold() -> None:
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True, no_logo=True)
    assert code == 0, report.getvalue()


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph("kimi_adapter_core")
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def _long_modules_without_reason() -> list[str]:
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if LONG_MODULE_REASON not in doc:
            missing.append(f"{path.relative_to(REPO)} ({text.count(chr(10))} lines)")
    return missing


def test_a_module_over_500_lines_says_why_at_its_top() -> None:
    assert _long_modules_without_reason() == []


def test_every_package_says_what_it_owns() -> None:
    for init in sorted(PACKAGE.rglob("__init__.py")):
        assert ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))), init.relative_to(REPO)
    folders = {p.parent for p in PACKAGE.rglob("*.py")}
    assert sorted(str(f.relative_to(REPO)) for f in folders if not (f / "__init__.py").exists()) == []


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        (
            "kimi_adapter_core.backends.extraction.weight_loader",
            "kimi_adapter_core.checkpoint.loader",
            "load_weights",
        ),
        (
            "kimi_adapter_core.backends.extraction.symbolic",
            "kimi_adapter_core.backends.extraction.runtime.symbolic",
            "bind_ir",
        ),
    ],
)
def test_the_previous_public_paths_still_import_and_say_where_to(old: str, new: str, name: str) -> None:
    """The README's API of the previous release keeps working for one release, with a warning."""
    import sys

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{old} moved to {new}; the old path goes in the next release"
    ]
