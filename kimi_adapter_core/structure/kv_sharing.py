"""Layers that reuse an earlier layer's keys and values within one forward (Gemma-4's KV sharing).

A config with ``num_kv_shared_layers = n`` makes its last ``n`` layers attend with their own queries over
the keys and values the last earlier layer of the same layer type computed in the same call (that layer
caches them; the sharing layers cache nothing and have no key or value projection). transformers 5.24
derives this in ``Gemma4TextConfig.kv_sharing_modes``; kadapt keeps the rule as data
(``config_keys.yaml``: ``kv_sharing``), so a config object and its JSON describe one structure. A stack
all of whose layers share (an assistant model that reads another model's cache) is refused: the ABI has
no input for another model's keys and values. The sharing layers may have a dense MLP twice as wide
(``mlp_widths``: Gemma-4's ``use_double_wide_mlp``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import Refusal
from .reader import MISSING, Reader, locate, tables


def kv_sharing_rule(model_type: Any) -> dict[str, Any] | None:
    """The model type's KV-sharing rule (``config_keys.yaml`` ``kv_sharing``), or None."""
    return tables()["kv_sharing"].get(model_type)


def shared_in_prefix(model_type: Any, section: Mapping[str, Any], total: int, keep: int) -> dict[str, int]:
    """The KV-sharing count of a stack cut to its first ``keep`` of ``total`` layers, under the family's
    key (``{}`` for a family that shares nothing, or a stack not cut): the sharing layers are the last
    ones, so the prefix keeps those past ``total - shared``."""
    rule = kv_sharing_rule(model_type)
    shared = section.get(rule["key"]) if rule is not None else None
    if isinstance(shared, bool) or not isinstance(shared, int) or shared <= 0 or keep >= total:
        return {}
    assert rule is not None
    return {rule["key"]: max(0, keep - (total - shared))}


def kv_sources(read: Reader, types: Sequence[Any] | None, num_layers: int) -> tuple[int | None, ...]:
    """Per layer the earlier layer whose keys and values it reuses (None: it computes and caches its own)."""
    rule = kv_sharing_rule(read.raw("model_type"))
    shared = read.raw(rule["key"]) if rule is not None else MISSING
    if shared in (MISSING, None, 0):
        return (None,) * num_layers
    where = locate(read.spec, "gate")
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 < shared <= num_layers:
        raise Refusal(
            "kv-shared-layers",
            f"{read.where}: {rule['key']} is {shared!r}; expected 0..{num_layers} (the last layers that "
            "reuse an earlier layer's keys and values)",
            location=where,
        )
    if shared == num_layers:
        raise Refusal(
            "kv-shared-layers",
            f"{read.where}: {rule['key']} = {shared} makes every layer reuse keys and values it does not "
            "compute (an assistant model reading another model's cache); kadapt's ABI has no input for "
            "another model's keys and values",
            location=where,
        )
    if types is None:
        types = [None] * num_layers
    first = num_layers - shared
    sources: list[int | None] = [None] * first
    for index in range(first, num_layers):
        producers = [j for j in range(first) if types[j] == types[index]]
        if not producers:
            raise Refusal(
                "kv-shared-layers",
                f"{read.where}: layer {index} ({types[index]}) reuses the keys and values of the last "
                f"earlier layer of its type, but none of the first {first} layers is one",
                location=where,
            )
        sources.append(producers[-1])
    return tuple(sources)


def mlp_widths(
    read: Reader, sources: Sequence[int | None], kinds: Sequence[str], width: int
) -> tuple[int | None, ...]:
    """Per layer its dense MLP width where it differs from the stack's ``width`` (None: the stack's): the
    rule's ``wide`` key, true, doubles it on the KV-sharing layers (Gemma-4's ``use_double_wide_mlp``)."""
    rule = kv_sharing_rule(read.raw("model_type"))
    wide = rule.get("wide") if rule is not None else None
    if wide is None or read.raw(wide) in (MISSING, None, False):
        return (None,) * len(sources)
    return tuple(
        2 * width if source is not None and kind == "dense" else None
        for source, kind in zip(sources, kinds, strict=True)
    )
