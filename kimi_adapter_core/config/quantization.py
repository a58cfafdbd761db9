"""The ``quantization_config`` each backend reads: the shipped config's, as that backend's bridges leave it.

A spec may hand one backend another checkpoint than the published one: an extraction bridge that drops
``quantization_config`` reads a dequantized copy dense, while plan/simulate still size the published,
quantized one. Plain ``validate``, ``plan`` and the deprecation of schemes hold the spec's
``quantization`` schemes against what each backend reads, not against the raw JSON. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..checkpoint.storage import quantization_config_of
from ..errors import KadaptError
from ..spec.model import BACKENDS, Spec
from ..structure.of_spec import raw_text_section
from .bridges import bridged


@dataclass(frozen=True)
class QuantizationView:
    """One ``quantization_config`` as the ``backends`` listed read it (None: they read the checkpoint
    dense)."""

    backends: tuple[str, ...]
    config: dict[str, Any] | None
    where: str  # "text config quantization_config", naming the backends when bridges change it for some
    shipped: bool  # the shipped config's own, no bridge changed it


def backend_quantization(spec: Spec, raw: dict[str, Any]) -> tuple[QuantizationView, ...]:
    """Each distinct ``quantization_config`` the backends read from ``raw`` (the shipped config), in
    ``BACKENDS`` order; one view when no bridge touches it, none when the shipped one is no mapping. A
    bridge that cannot run, or writes no mapping there, leaves the shipped config's: the bridge checks
    report that bridge."""
    try:
        shipped = _quantization_config(spec, raw)
    except KadaptError:
        return ()  # plain validate reports the shipped config's unreadable quantization_config
    seen: dict[str, tuple[list[str], tuple[dict[str, Any] | None, str]]] = {}
    for backend in BACKENDS:
        try:
            found = _quantization_config(spec, bridged(spec, raw, backend))
        except KadaptError:
            found = shipped
        key = json.dumps(found, sort_keys=True, default=repr)
        seen.setdefault(key, ([], found))[0].append(backend)
    views = []
    for backends, (config, where) in seen.values():
        own = (config, where) == shipped
        if len(seen) > 1 or not own:  # name who reads it once the backends read different ones
            verb = "reads" if len(backends) == 1 else "read"
            after = "" if own else " after the config bridges"
            where += f" (as {' and '.join(backends)} {verb} it{after})"
        views.append(QuantizationView(tuple(backends), config, where, own))
    return tuple(views)


def backend_quantization_config(
    spec: Spec, raw: dict[str, Any], backend: str
) -> tuple[dict[str, Any] | None, str]:
    """The ``quantization_config`` ``backend`` reads from ``raw``, and where it was found (as
    ``quantization_config_of`` says it, plus the backends when bridges changed it)."""
    [view] = [view for view in backend_quantization(spec, raw) if backend in view.backends]
    return view.config, view.where


def _quantization_config(spec: Spec, raw: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    _, text = raw_text_section(spec, raw)
    for holder in (text or {}, raw):
        found = holder.get("quantization_config")
        if found and not isinstance(found, Mapping):
            raise KadaptError(f"quantization_config is {type(found).__name__}, not a mapping")
    return quantization_config_of(text or {}, raw)
