"""Errors that reach the user as a message, never as a traceback.

Anything raised as a ``KadaptError`` is a user-facing problem (bad spec, bad size, unwritable
directory, drifted upstream code). The CLI prints ``error: <message>`` and exits with
``exit_code``; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class KadaptError(Exception):
    """A user error: printed as one located message, exit status ``exit_code``."""

    exit_code = 1

    def __init__(self, message: str, *, location: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.location = location  # "file:line:col" when the error points at a spec node

    def __str__(self) -> str:
        return f"{self.location}: {self.message}" if self.location else self.message


class UsageError(KadaptError):
    """Bad command-line usage (exit 2, like click's own usage errors)."""

    exit_code = 2
