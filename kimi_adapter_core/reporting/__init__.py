"""Rendering validation results for people (text) and tools (JSON), behind one interface."""

from __future__ import annotations

from .base import FileReport, Reporter
from .json_reporter import JsonReporter
from .text_reporter import TextReporter

REPORTERS: dict[str, type[Reporter]] = {"text": TextReporter, "json": JsonReporter}


def reporter_for(name: str) -> Reporter:
    """The reporter registered as ``name`` (``text`` or ``json``)."""
    return REPORTERS[name]()


__all__ = ["REPORTERS", "FileReport", "JsonReporter", "Reporter", "TextReporter", "reporter_for"]
