"""Atomic file output: a reader sees the old file or the whole new one, never a partial write.

The data goes to a hidden temp file beside the target (same file system), is flushed and fsynced,
and only then renamed over the target with ``os.replace``. If anything stops the write, including
``KeyboardInterrupt`` (Ctrl-C) or ``SystemExit``, the temp file is removed and the target is left
as it was. The temp file's name is chosen before it is created, so an interrupt at any point,
even inside the call that creates it, still finds and removes it.

Every ``OSError`` of kadapt's own file operations (creating, writing, flushing, syncing, closing,
renaming; a full disk is ``ENOSPC``, a file-size limit ``EFBIG``) is the user error
``cannot write <target>: <why>`` (``cannot_write``), after the temp file is removed. Errors of the
caller's own code (the block of ``atomic_open``, the chunks of ``write_new``) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from .errors import KadaptError

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
_ATTEMPTS = 100


def temp_path(target: Path) -> Path:
    """A fresh hidden name beside ``target``: ``.<name>.<random>.tmp``."""
    return target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")


def write_error(target: Path | str, exc: OSError) -> KadaptError:
    """The user error for ``exc`` raised while writing ``target``: ``cannot write <target>: <why>``."""
    return KadaptError(f"cannot write {target}: {exc.strerror or exc}")


@contextlib.contextmanager
def cannot_write(target: Path) -> Iterator[None]:
    """An ``OSError`` inside the block becomes the user error ``cannot write <target>: <why>``."""
    try:
        yield
    except OSError as exc:
        raise write_error(target, exc) from exc


def make_parent(target: Path) -> None:
    """Create ``target``'s folder (and its parents) if missing."""
    with cannot_write(target):
        target.parent.mkdir(parents=True, exist_ok=True)


def rename_over(temp: Path, target: Path) -> None:
    """Rename the finished ``temp`` over ``target`` (atomic on one file system)."""
    with cannot_write(target):
        os.replace(temp, target)


def _sync(handle: IO, target: Path) -> None:
    """Flush ``handle`` and fsync its file: the data is on disk before any rename."""
    with cannot_write(target):
        handle.flush()
        os.fsync(handle.fileno())


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8"
) -> Iterator[IO]:
    """Open a temp file beside ``path``; rename it over ``path`` only if the block succeeds."""
    target = Path(path)
    make_parent(target)
    binary = "b" in mode
    tmp: Path | None = None  # set *before* the file exists: an interrupt can never orphan it
    try:
        with cannot_write(target):
            for _ in range(_ATTEMPTS):
                tmp = temp_path(target)
                try:
                    fd = os.open(tmp, _CREATE, 0o666)  # 0o666 minus the umask, like any new file
                    break
                except FileExistsError:
                    tmp = None  # someone else's file: never remove it
            else:
                raise FileExistsError(f"no free temporary name beside it after {_ATTEMPTS} tries")
            handle = _fdopen(fd, mode, None if binary else encoding)
        with _closed(handle, target):
            yield handle  # the caller's errors pass through unchanged (and the temp file goes)
            _sync(handle, target)
        rename_over(tmp, target)
        tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@contextlib.contextmanager
def _closed(handle: IO, target: Path) -> Iterator[None]:
    """Close ``handle`` after the block. After a failure the close's own error (the buffer it flushes
    may hit the same full disk) is dropped, so the block's error is the one reported; after success
    it is ``cannot write <target>``."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            handle.close()
        raise
    with cannot_write(target):
        handle.close()


def _write_chunks(handle: IO, chunks: Iterable[str], target: Path) -> None:
    """Write each chunk: the chunks' own errors pass through, the writes' become ``cannot write``."""
    write = handle.write
    for chunk in chunks:
        try:
            write(chunk)
        except OSError as exc:
            raise write_error(target, exc) from exc


def _fdopen(fd: int, mode: str, encoding: str | None) -> IO:
    try:
        return os.fdopen(fd, mode, encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


def write_new(path: Path, chunks: Iterable[str], *, target: Path) -> int:
    """Write ``chunks`` as UTF-8 to ``path`` beside ``target`` (its folder created if missing), a name
    that must not exist yet (someone else's file is never overwritten), flushed and fsynced; returns
    its size. For a temp name chosen beforehand (``backends/extraction/write.Staging``): removing it
    on failure is the chooser's job, which knows the name even when the writer was a process that
    died. Errors creating and syncing it name ``target``, the file ``path`` is renamed over; the
    chunks' own errors pass through unchanged (as in ``atomic_open``); every other ``OSError``, a
    full disk included, is ``cannot write <target>``."""
    make_parent(target)
    with cannot_write(target):
        handle = _fdopen(os.open(path, _CREATE, 0o666), "w", "utf-8")
    with _closed(handle, target):
        _write_chunks(handle, chunks, target)
        _sync(handle, target)
        with cannot_write(target):
            return os.fstat(handle.fileno()).st_size


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_open(path, "w") as handle, cannot_write(Path(path)):
        handle.write(text)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_open(path, "wb", encoding=None) as handle, cannot_write(Path(path)):
        handle.write(data)
