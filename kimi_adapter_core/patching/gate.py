"""Call-time gate: a patched method runs its patched behaviour only for modules a spec claimed.

Class patches are process-wide, and classes are shared between models (Kimi-K2.5's text backbone
*is* transformers' ``DeepseekV3*``). So a patch never changes a class unconditionally: the class
attribute becomes a dispatcher that asks, per call, whether the receiving module belongs to a model
built for the spec (``claim_model``) or is being built right now (``building``). Everything else
gets the original, untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

_claims: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_building: contextvars.ContextVar[str | None] = contextvars.ContextVar("kadapt_building", default=None)
_counting: contextvars.ContextVar[bool] = contextvars.ContextVar("kadapt_counting", default=True)


def claim_model(model: Any, spec_name: str) -> int:
    """Claim every submodule of ``model`` for ``spec_name``; return how many were claimed."""
    count = 0
    for module in model.modules():
        _claims.setdefault(module, set()).add(spec_name)
        count += 1
    return count


def is_claimed(obj: Any, spec_name: str) -> bool:
    try:
        return spec_name in _claims.get(obj, ())
    except TypeError:  # unhashable or not weak-referenceable: never ours
        return False


@contextlib.contextmanager
def building(spec_name: str) -> Iterator[None]:
    """Calls made while a model is being built for ``spec_name`` count as claimed."""
    token = _building.set(spec_name)
    try:
        yield
    finally:
        _building.reset(token)


def owns_call(spec_name: str, args: tuple[Any, ...]) -> bool:
    """True when the call's receiver (first positional argument) belongs to ``spec_name``."""
    if _building.get() == spec_name:
        return True
    return bool(args) and is_claimed(args[0], spec_name)


class Reach:
    """How many calls (or attribute reads) a patch's own behaviour served: 0 after a run means the
    patch was installed but had no effect, which the ledger then says."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def hit(self) -> None:
        if _counting.get():
            self.count += 1


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Calls that check the model rather than make the artifacts (the contact-point probe) do not
    count as reaching a patch."""
    token = _counting.set(False)
    try:
        yield
    finally:
        _counting.reset(token)


def via_cell(cell: list[Callable[..., Any]]) -> Callable[..., Any]:
    """Call whatever function ``cell`` holds now (carrying its metadata for ``inspect``)."""

    @functools.wraps(cell[0])
    def call_original(*args: Any, **kwargs: Any) -> Any:
        return cell[0](*args, **kwargs)

    return call_original


def gated(
    spec_name: str, cell: list[Callable[..., Any]], patched: Callable[..., Any], reach: Reach
) -> Callable[..., Any]:
    """A function that calls ``patched`` for the spec's own modules (counted in ``reach``) and
    ``cell[0]`` otherwise.

    ``cell`` holds the original; it is a one-slot list so that a gate stacked under this one can be
    unlinked later (see ``changes.Change.undo``). The dispatcher carries the original's metadata
    (name, signature via ``__wrapped__``), so tools inspecting the class see the upstream method.
    """

    @functools.wraps(cell[0])
    def dispatcher(*args: Any, **kwargs: Any) -> Any:
        if owns_call(spec_name, args):
            reach.hit()
            return patched(*args, **kwargs)
        return cell[0](*args, **kwargs)

    dispatcher.__kadapt_cell__ = cell  # type: ignore[attr-defined]
    dispatcher.__kadapt_gate__ = spec_name  # type: ignore[attr-defined]
    return dispatcher


class GatedAttribute:
    """Non-data descriptor: ``value`` on the spec's claimed instances, the old attribute elsewhere.

    Instance assignments still win (no ``__set__``), exactly like a plain class attribute.
    """

    def __init__(
        self, spec_name: str, name: str, value: Any, original: Any, has_original: bool, reach: Reach
    ) -> None:
        self.spec_name = spec_name
        self.name = name
        self.value = value
        self.original = original
        self.has_original = has_original
        self.reach = reach

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is not None and (
            _building.get() == self.spec_name or is_claimed(instance, self.spec_name)
        ):
            self.reach.hit()
            return self.value
        if not self.has_original:
            if instance is None:
                return self
            raise AttributeError(f"{type(instance).__name__!r} object has no attribute {self.name!r}")
        if hasattr(self.original, "__get__"):
            return self.original.__get__(instance, owner)
        return self.original
