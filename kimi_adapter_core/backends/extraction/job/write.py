"""Write the output files all or nothing.

Each file goes to a hidden temp file beside its target, named before anything is written; the renames
happen only after every file was written completely, so a failure (disk full, a bug while serialising
the second graph, a forked writer that died) leaves the previous outputs untouched and no partial
JSON behind. The files may be written by several processes (``forked``: each export process writes
its own graphs) and are renamed by the one that chose the names.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ....atomic import rename_over, temp_path, write_new


class Staging:
    """Temp names for ``targets``, chosen now: ``write`` fills some of them (in this process or a
    forked one), ``commit`` renames them all over their targets, ``discard`` removes whatever exists."""

    def __init__(self, targets: Iterable[Path]) -> None:
        self.temps = {target: temp_path(target) for target in targets}

    def write(self, files: Mapping[Path, Iterable[str]]) -> dict[Path, int]:
        """Write each target's text chunks to its temp file; the byte size of each. The disk refusing
        (full, a size limit) is the user error ``cannot write TARGET: why`` (``atomic.write_new``)."""
        return {
            target: write_new(self.temps[target], chunks, target=target) for target, chunks in files.items()
        }

    def commit(self) -> None:
        """Rename every temp file over its target (each must have been written)."""
        for target, temp in self.temps.items():
            rename_over(temp, target)

    def discard(self) -> None:
        """Remove every temp file that exists (after a failure; after ``commit`` there are none)."""
        for temp in self.temps.values():
            with contextlib.suppress(OSError):
                os.unlink(temp)


def write_all(files: dict[Path, Iterable[str]]) -> dict[Path, int]:
    """Write each path's text chunks, all or nothing; returns the byte size of each file."""
    staging = Staging(files)
    try:
        sizes = staging.write(files)
        staging.commit()
    finally:
        staging.discard()
    return sizes
