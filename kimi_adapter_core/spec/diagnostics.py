"""Located findings about a spec file, and the error that carries them to the user.

Every stage (YAML, schema, semantic checks) reports ``Diagnostic`` objects instead of raising, so
that ``kadapt validate`` can show all problems of a file at once, each pointing at a line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from ..errors import KadaptError

Location = tuple[int, int]  # 1-based (line, column)


class Severity(str, Enum):
    """Errors make a spec invalid; warnings only do so under ``--strict``."""

    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class Diagnostic:
    """One finding. ``breadcrumb`` is the spec path (``patches[3].target``; ``""`` is the root)."""

    file: str
    line: int
    col: int
    breadcrumb: str
    message: str
    severity: Severity = Severity.ERROR
    code: str = "error"

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def render(self) -> str:
        """``file:line:col: breadcrumb: message``, with ``warning:`` before the message of a warning."""
        where = f"{self.breadcrumb}: " if self.breadcrumb else ""
        level = "warning: " if self.severity is Severity.WARNING else ""
        return f"{self.file}:{self.line}:{self.col}: {where}{level}{self.message}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["severity"] = self.severity.value
        return data


def sort_diagnostics(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Sort by file and position and drop exact duplicates (one schema error can surface twice)."""
    return sorted(set(diagnostics), key=lambda d: (d.file, d.line, d.col, d.breadcrumb, d.message))


class Locator:
    """Turns breadcrumbs into diagnostics for one file, using the loader's position table."""

    def __init__(self, file: str, positions: dict[str, Location]) -> None:
        self.file = file
        self.positions = positions

    def position(self, breadcrumb: str) -> Location:
        """Position of ``breadcrumb``, or of its nearest recorded ancestor (a key absent from the file)."""
        while breadcrumb not in self.positions and breadcrumb:
            breadcrumb = parent_breadcrumb(breadcrumb)
        return self.positions.get(breadcrumb, (1, 1))

    def at(self, breadcrumb: str, message: str, code: str, severity: Severity = Severity.ERROR) -> Diagnostic:
        line, col = self.position(breadcrumb)
        return Diagnostic(self.file, line, col, breadcrumb, message, severity, code)


def join_breadcrumb(parent: str, key: str | int) -> str:
    """Child breadcrumb: ``a.b`` for a mapping key, ``a[3]`` for a sequence index."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def parent_breadcrumb(breadcrumb: str) -> str:
    cut = max(breadcrumb.rfind("."), breadcrumb.rfind("["))
    return breadcrumb[:cut] if cut > 0 else ""


class SpecInvalid(KadaptError):
    """A spec with errors; the message lists every error, one rendered diagnostic per line."""

    def __init__(self, diagnostics: list[Diagnostic]) -> None:
        self.diagnostics = diagnostics
        errors = [d for d in diagnostics if d.is_error]
        lines = "\n".join(d.render() for d in errors)
        noun = "error" if len(errors) == 1 else "errors"
        super().__init__(f"invalid spec ({len(errors)} {noun}):\n{lines}")
