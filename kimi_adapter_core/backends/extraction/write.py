"""Write the output files all or nothing.

Each file goes to a temp file beside its target; the renames happen only after every file was
written completely, so a failure (disk full, a bug while serialising the second graph) leaves the
previous outputs untouched and no partial JSON behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

from ...atomic import atomic_open


def write_all(files: dict[Path, Iterable[str]]) -> dict[Path, int]:
    """Write each path's text chunks; returns the byte size of each file."""
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(atomic_open(path, "w")) for path in files}
        for path, chunks in files.items():
            handles[path].writelines(chunks)
    return {path: path.stat().st_size for path in files}
