"""Artifacts held back until ``--verify`` passed: a hidden folder inside the output folder.

Verify proves a tiny model of the spec's architecture, so the full-size files can wait: they are
written (or restored) into ``.kadapt-unverified-*`` and renamed over their targets only after every
check passed; a failure, an error or an interrupt removes the folder, leaving the output folder as
it was."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from ....atomic import cannot_write, rename_over

HELD_PREFIX = ".kadapt-unverified-"


class Held:
    """A run's artifacts withheld from the output folder until ``--verify`` has passed.

    Verify extracts and replays its own tiny model, never the full-size files, so ``apply --verify``
    writes (or restores from the extraction cache) into a hidden folder inside the output folder, and
    ``commit`` renames the files into place (one rename each, same file system) only once verify passed.
    ``discard`` removes the folder: after a failed verify, or any error or interrupt, nothing of the run
    is in the output folder and what was there before is untouched, so no file that failed verify ever
    lies there looking like a verified one (a glob of the folder skips the hidden name too)."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        with cannot_write(output_dir):
            self.folder = Path(tempfile.mkdtemp(prefix=HELD_PREFIX, dir=output_dir))

    def commit(self, names: Iterable[str]) -> None:
        """Rename each held file ``names`` names over its namesake in the output folder."""
        for name in names:
            rename_over(self.folder / name, self.output_dir / name)
        self.discard()

    def discard(self) -> None:
        """Remove the held folder and whatever is still in it."""
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def held_until_verified(output_dir: Path) -> Iterator[Held]:
    """A ``Held`` folder in ``output_dir``, removed when the block ends however it ends (after a
    ``commit`` it is already empty)."""
    held = Held(output_dir)
    try:
        yield held
    finally:
        held.discard()
