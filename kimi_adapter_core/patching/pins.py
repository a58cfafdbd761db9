"""Upstream drift pins: the signature and source hash a patch was written against.

A patch that replaces or wraps upstream code silently goes wrong when upstream changes that code.
Pinning ``inspect.signature`` and the sha256 of the dedented source turns that into a refusal at
apply time, pointing at the spec line; ``kadapt pin`` recomputes the pins after a review.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import KadaptError
from ..spec.model import Pin
from . import portable


def _unreadable(func: Callable[..., Any], exc: Exception) -> KadaptError:
    return KadaptError(f"cannot read the source of {getattr(func, '__qualname__', func)}: {exc}")


def compute(func: Callable[..., Any]) -> Pin:
    try:
        return Pin(signature=portable.signature_of(func), source_sha256=portable.source_sha256(func))
    except (OSError, TypeError) as exc:
        raise _unreadable(func, exc) from exc


def drift(pin: Pin, func: Callable[..., Any]) -> list[tuple[str, str, str]]:
    """``(field, expected, found)`` for every pinned field ``func`` no longer matches."""
    try:
        return portable.pin_drift(func, pin.signature, pin.source_sha256)
    except (OSError, TypeError) as exc:
        raise _unreadable(func, exc) from exc


def verify(pin: Pin, func: Callable[..., Any], *, target: str, location: str) -> None:
    """Raise ``KadaptError`` showing expected vs found for every pinned field that drifted."""
    problems = [
        f"  {field} expected {expected}\n  {field} found    {found}"
        for field, expected, found in drift(pin, func)
    ]
    if problems:
        raise KadaptError(
            f"upstream drift: {target} no longer matches its pin\n"
            + "\n".join(problems)
            + "\n  review the patch against the new upstream code, then run `kadapt pin --write`",
            location=location,
        )
