"""Upstream drift pins: the signature and source hash a patch was written against.

A patch that replaces or wraps upstream code silently goes wrong when upstream changes that code.
Pinning ``inspect.signature`` and the sha256 of the dedented source turns that into a refusal at
apply time, pointing at the spec line; ``kadapt pin`` recomputes the pins after a review. A patch
reviewed against several releases' sources (DeepSeek-V4's compressors: 5.23's take
``past_key_values``, 5.24's ``cache``) lists one pin per release, and applies where any matches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from packaging.version import Version

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


def matching(pins: tuple[Pin, ...], func: Callable[..., Any]) -> Pin | None:
    """The first of ``pins`` (the sources a patch was reviewed against) ``func`` matches, else None."""
    return next((pin for pin in pins if not drift(pin, func)), None)


def repinned(pins: tuple[Pin, ...], fresh: Pin, release: str) -> tuple[Pin, ...]:
    """A patch's pins after a review of the installed source (``fresh``, from ``release``): the
    one-source form (or none) becomes ``fresh``; a per-release pin that already accepts it is kept, else
    it gains (or replaces) ``release``'s entry, pinning the fields its other entries pin, in release
    order."""
    if not any(pin.release for pin in pins):
        return (fresh,)
    if any(
        pin.signature in (None, fresh.signature) and pin.source_sha256 in (None, fresh.source_sha256)
        for pin in pins
    ):
        return pins
    entry = Pin(
        fresh.signature if any(pin.signature for pin in pins) else None,
        fresh.source_sha256 if any(pin.source_sha256 for pin in pins) else None,
        release,
    )
    kept = [pin for pin in pins if pin.release != release]
    return tuple(sorted([*kept, entry], key=lambda pin: Version(pin.release or "0")))


def describe(pin: Pin) -> str:
    """How a pin is named in findings: its release, or "its pin" in the one-source form."""
    return f"its transformers {pin.release} pin" if pin.release else "its pin"


def verify(pins: tuple[Pin, ...], func: Callable[..., Any], *, target: str, location: str) -> None:
    """Raise ``KadaptError`` unless ``func`` matches one of ``pins``, showing expected vs found for
    every pinned field of each (a per-release pin: each release's)."""
    if matching(pins, func) is not None:
        return
    problems = []
    for pin in pins:
        heading = [f"  against {describe(pin)}:"] if pin.release else []
        problems += heading + [
            f"  {field} expected {expected}\n  {field} found    {found}"
            for field, expected, found in drift(pin, func)
        ]
    what = "its pin" if len(pins) == 1 and not pins[0].release else "any of its pins"
    raise KadaptError(
        f"upstream drift: {target} no longer matches {what}\n"
        + "\n".join(problems)
        + "\n  review the patch against the new upstream code, then run `kadapt pin --write`",
        location=location,
    )
