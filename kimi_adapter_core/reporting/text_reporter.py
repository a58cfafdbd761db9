"""Compiler-style output: one ``file:line:col: breadcrumb: message`` line each, then a summary."""

from __future__ import annotations

from collections.abc import Sequence

from .base import FileReport


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


class TextReporter:
    def render(self, reports: Sequence[FileReport], strict: bool) -> str:
        lines = [d.render() for report in reports for d in report.diagnostics]
        diagnostics = [d for report in reports for d in report.diagnostics]
        errors = sum(d.is_error for d in diagnostics)
        invalid = sum(not report.valid(strict) for report in reports)
        summary = ", ".join(
            (
                _count(len(reports), "spec") + " checked",
                f"{invalid} invalid",
                _count(errors, "error"),
                _count(len(diagnostics) - errors, "warning"),
            )
        )
        return "\n".join([*lines, summary])
