"""What every reporter receives, and the interface it implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..spec.diagnostics import Diagnostic


@dataclass(frozen=True)
class FileReport:
    """The diagnostics of one checked file. Under ``strict`` a warning makes the file invalid too."""

    path: str
    diagnostics: tuple[Diagnostic, ...]

    def valid(self, strict: bool) -> bool:
        return not any(d.is_error or strict for d in self.diagnostics)


class Reporter(Protocol):
    def render(self, reports: Sequence[FileReport], strict: bool) -> str:
        """The whole output for ``reports``, without a trailing newline."""
        ...
