"""Upstream drift pins: the signature and source hash a patch was written against.

A patch that replaces or wraps upstream code silently goes wrong when upstream changes that code.
Pinning ``inspect.signature`` and the sha256 of the dedented source turns that into a refusal at
apply time, pointing at the spec line; ``kadapt pin`` recomputes the pins after a review.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from ..errors import KadaptError
from ..spec.model import Pin


def signature_of(func: Callable[..., Any]) -> str:
    return str(inspect.signature(func))


def source_sha256(func: Callable[..., Any]) -> str:
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError) as exc:
        raise KadaptError(f"cannot read the source of {getattr(func, '__qualname__', func)}: {exc}") from exc
    return hashlib.sha256(textwrap.dedent(source).encode("utf-8")).hexdigest()


def compute(func: Callable[..., Any]) -> Pin:
    return Pin(signature=signature_of(func), source_sha256=source_sha256(func))


def verify(pin: Pin, func: Callable[..., Any], *, target: str, location: str) -> None:
    """Raise ``KadaptError`` showing expected vs found for every pinned field that drifted."""
    problems = []
    if pin.signature is not None and (found := signature_of(func)) != pin.signature:
        problems.append(f"  signature expected {pin.signature}\n  signature found    {found}")
    if pin.source_sha256 is not None and (found := source_sha256(func)) != pin.source_sha256:
        problems.append(f"  source_sha256 expected {pin.source_sha256}\n  source_sha256 found    {found}")
    if problems:
        raise KadaptError(
            f"upstream drift: {target} no longer matches its pin\n"
            + "\n".join(problems)
            + "\n  review the patch against the new upstream code, then run `kadapt pin --write`",
            location=location,
        )
