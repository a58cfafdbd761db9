"""Put rendered files on disk, or compare them with what is there (``--check``)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from ..atomic import atomic_write_text
from .common import Rendered

DIFF_LINES = 20  # per stale file: enough to see what changed, short enough to read in a CI log


@dataclass(frozen=True)
class Drift:
    path: str
    status: str  # "missing" | "stale"
    diff: str


def write_all(files: list[Rendered], out: Path) -> list[Path]:
    """Write each file atomically; unchanged files are left alone (their mtime too)."""
    written = []
    for item in files:
        target = out / item.path
        if target.is_file() and target.read_text(encoding="utf-8") == item.text:
            continue
        atomic_write_text(target, item.text)
        written.append(target)
    return written


def check_all(files: list[Rendered], out: Path) -> list[Drift]:
    """Files under ``out`` that are missing or differ from the rendering, with a short diff."""
    drifts = []
    for item in files:
        target = out / item.path
        if not target.is_file():
            drifts.append(Drift(str(item.path), "missing", ""))
            continue
        current = target.read_text(encoding="utf-8")
        if current != item.text:
            diff = difflib.unified_diff(
                current.splitlines(),
                item.text.splitlines(),
                f"{item.path} (on disk)",
                f"{item.path} (generated)",
                lineterm="",
                n=1,
            )
            lines = list(diff)
            more = f"\n... {len(lines) - DIFF_LINES} more diff lines" if len(lines) > DIFF_LINES else ""
            drifts.append(Drift(str(item.path), "stale", "\n".join(lines[:DIFF_LINES]) + more))
    return drifts
