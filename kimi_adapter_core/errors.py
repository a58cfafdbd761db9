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


class Refusal(KadaptError):
    """Something kadapt does not model, refused before any work: ``code`` is one of ``REFUSALS``.

    The message starts with ``refused (code):`` so a reader (and the family matrix) can tell a
    documented refusal from any other error.
    """

    def __init__(self, code: str, message: str, *, location: str | None = None) -> None:
        if code not in REFUSALS:
            raise ValueError(f"unknown refusal code {code!r}; known: {', '.join(REFUSALS)}")
        super().__init__(f"refused ({code}): {message}", location=location)
        self.code = code


# The documented list (docs/families.md explains each): what kadapt refuses, and why.
REFUSALS = {
    "outside-layers": "math outside the decoder layers (embedding scale, logit scale, soft-capping...) "
    "that the wrappers do not reproduce",
    "stack-differs": "the decoder layers, called by the wrappers with the ABI's masks, positions and cache, "
    "give other hidden states than the model's own forward gives them",
}
