"""Reading a file that untrusted input names: a small regular file, or a located refusal.

Specs, configs, checkpoint indexes and cache entries come from people kadapt cannot trust. A path
to a FIFO would block the read forever, a device would never end, a directory or a huge file would
give a confusing error or exhaust memory. Every such read goes through ``read_regular_file``: the
kind and size are checked before a byte is read, and again on the opened descriptor."""

from __future__ import annotations

import os
import stat


class FileRefused(Exception):
    """A path that is not a small regular file; ``code`` is the diagnostic code to report."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _check_regular(mode: int, size: int, limit: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "something else")
        raise FileRefused(f"not a regular file but {kind}; a {what} must be a regular file", "not-a-file")
    if size > limit:
        raise FileRefused(f"file is {size:,} bytes, over the {limit:,}-byte limit for a {what}", "yaml-limit")


def read_regular_file(path: str | os.PathLike[str], limit: int, what: str = "file") -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes.

    Raises ``FileRefused`` for anything else (FIFO, directory, device, too large, NUL in the
    path) before reading a byte, and ``OSError`` (``FileNotFoundError``, ...) as ``open`` would.
    The file is opened non-blocking and checked again through its descriptor, so a path swapped
    for a FIFO after the check cannot hang the read.
    """
    try:
        info = os.stat(path)
    except ValueError as exc:  # "embedded null byte"
        raise FileRefused("the path contains a NUL byte", "io") from exc
    _check_regular(info.st_mode, info.st_size, limit, what)
    flags = (
        os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    )
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        _check_regular(info.st_mode, info.st_size, limit, what)
        chunks: list[bytes] = []
        remaining = limit + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise FileRefused(f"file is over the {limit:,}-byte limit for a {what}", "yaml-limit")
    return data
