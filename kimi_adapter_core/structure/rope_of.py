"""The rotary embedding a config describes: one for every layer, one per layer type, or one per label.

transformers 5 keeps ``rope_parameters`` per layer type for families whose sliding and full layers
rotate differently (Gemma-3, OLMo-3, ...): ``{"full_attention": {...}, "sliding_attention": {...}}``;
DeepSeek-V4 nests them under labels its ``layer_types`` never names (``{"main", "compress"}``): ``rope``.
Read through ``derive``'s reader, so a config object and its raw JSON describe the rope alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from .rope import BY_LABEL, PER_LAYER_TYPE, Rope


class Reader(Protocol):
    """What rope reads of ``derive.Reader``: facts by name (``rope_parameters``, ``rope_theta``) and raw
    config keys (``layer_types``)."""

    def get(self, fact: str, default: Any = None) -> Any: ...

    def raw(self, key: str) -> Any: ...


def rope_of(read: Reader) -> Rope:
    """One rope, or one per layer type when ``rope_parameters`` nests a mapping per layer type (as
    transformers 5 keeps Gemma-3's and OLMo-3's), or per label when none of its keys is a type of the
    config's ``layer_types`` (DeepSeek-V4's); a missing theta is the config's ``rope_theta``, as
    transformers fills it."""
    params = read.get("rope_parameters")
    if params is None and read.get("rope_theta") is None:
        # transformers 5 gives every config class that rotates a rope_parameters; a config without
        # any rope key (Kimi-Linear's NoPE MLA, Mamba/SSM stacks) has no rope
        return Rope("none", None)
    params = params or {}
    nested = _rope_by_layer_type(read, params)
    if not nested:
        return _rope_kind(read, params, with_factor=False)
    by_layer_type = tuple((name, _rope_kind(read, nested[name], with_factor=True)) for name in sorted(nested))
    types = read.raw("layer_types")
    named = set(types) if isinstance(types, (list, tuple)) else set()
    labelled = bool(named) and not named & nested.keys()  # keyed by labels, not by the layers' types
    return Rope(type=BY_LABEL if labelled else PER_LAYER_TYPE, theta=None, by_layer_type=by_layer_type)


def _rope_by_layer_type(read: Reader, params: Mapping[str, Any]) -> dict[str, Mapping[str, Any] | None]:
    """Layer type -> its rope mapping when ``params`` is nested: the keys holding a mapping, and those
    the config's ``layer_types`` names that hold null (no rope there); empty for a flat mapping."""
    if not any(isinstance(value, Mapping) for value in params.values()):
        return {}
    types = read.raw("layer_types")
    named = set(types) if isinstance(types, (list, tuple)) else set()
    return {
        str(key): value
        for key, value in params.items()
        if isinstance(value, Mapping) or (value is None and key in named)
    }


def _rope_kind(read: Reader, params: Mapping[str, Any] | None, *, with_factor: bool) -> Rope:
    """One rope mapping (null: ``none``): its type, theta (else the config's ``rope_theta``) and,
    ``with_factor``, its scaling factor when that is a number."""
    if params is None:
        return Rope("none", None)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta") or read.get("rope_theta")
    factor = params.get("factor") if with_factor else None
    number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    return Rope(
        type=str(rope_type),
        theta=float(theta) if theta is not None else None,
        factor=float(factor) if number else None,
    )
