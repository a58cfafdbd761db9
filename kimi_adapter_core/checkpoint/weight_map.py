"""The weight map: for every graph weight, the checkpoint tensors, their storage and the ops that build it.

Written next to the IR as ``<prefix>_weight_map.json``; a runtime reads it to load real checkpoint
weights into the graphs (``weight_loader.load_weights`` is the reference reader). Every graph of an
extraction reads weights by the same names, so one map serves prefill, decode and the vision graph.
Storage follows the config of the checkpoint given (``checkpoint_storage``); the IR's per-weight
``quantization`` is this map's entry in short (``ir_quantization``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..errors import KadaptError
from ..spec.model import Spec
from .layout import CheckpointSource, checkpoint_sources
from .naming import rename_weight
from .storage import CheckpointStorage, checkpoint_storage, quantization_config_of
from .tensors import TensorType

FORMAT, VERSION = "kadapt-weight-map", 1

RULES = {
    "load": (
        "for each weight: read every source tensor (dequantizing per its storage), apply ops in order, "
        "cast to the weight's dtype; the result has the weight's shape"
    ),
    "ops": {
        "stack": "stack the tensors of each source group along dim (one tensor per group)",
        "concat": "concatenate the groups' tensors, in source order, along dim",
        "transpose": "swap the two dims of the single tensor",
        "chunk": "split the single tensor into `chunks` equal parts along dim and keep part `index`",
        "permute_for_rope": (
            "view dim 0 of the single tensor as [heads, rows/heads/2, 2] ([heads, 2, rows/heads/2] when "
            "inverse), swap those last two axes, flatten back (interleaved rope pairs to halves)"
        ),
    },
    "storage": (
        "absent: the tensor is stored under its name with the source's dtype; otherwise the tensor name plus "
        "each storage tensor's suffix, combined as 'dequantize' says"
    ),
    "names": (
        "a tensor the checkpoint lacks is read under the forms transformers' loader accepts: its name "
        "without the leading `base_model_prefix.`, its `aliases` entry (the base model's name where "
        "transformers renames it), and a `_scale_inv` storage tensor of `X.weight` as `X.scale` or "
        "`X.qscale_weight`; a tensor present under two of its forms is ambiguous"
    ),
}
# ops the weight map learnt after its first models: a document states their rules only when it uses
# them, so the maps of every model without them stay the bytes they were
LATER_OPS = {
    "split": "split the single tensor along dim into consecutive parts of `sizes` and keep part `index`",
}


def _rules(entries: Mapping[str, Any]) -> dict[str, Any]:
    """``RULES``, with the rules of the later ops ``entries`` use."""
    used = {op["op"] for entry in entries.values() for op in entry["ops"]}
    later = {kind: rule for kind, rule in LATER_OPS.items() if kind in used}
    return {**RULES, "ops": {**RULES["ops"], **later}} if later else RULES


def _source_entry(source: CheckpointSource, dtype: str, stored: CheckpointStorage) -> list[dict[str, Any]]:
    """The weight map's ``sources`` of one graph weight; every source has the weight's logical dtype."""
    groups = []
    for group in source.groups:
        storages = [stored.storage(name, group.shape, source.linear) for name in group.tensors]
        if any(storage != storages[0] for storage in storages[1:]):
            raise KadaptError(f"weight map: the tensors of {group.pattern} are stored in different formats")
        entry: dict[str, Any] = {"tensors": list(group.tensors), "shape": list(group.shape), "dtype": dtype}
        if group.pattern:
            entry["pattern"] = group.pattern
        if storages[0] is not None:
            entry["storage"] = storages[0]
        groups.append(entry)
    return groups


def weight_map_document(
    spec: Spec,
    model: nn.Module,
    weights: Mapping[str, TensorType],
    *,
    model_name: str,
    renames: tuple[tuple[str, str], ...],
) -> dict[str, Any]:
    """The weight map of ``weights`` (the graphs' weights by model path) for ``model`` built from ``spec``."""
    sources = checkpoint_sources(model, weights, renames)
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    qc, found_in = quantization_config_of(text, config)
    head = _head_source(sources, _head_path(weights)).removesuffix(".weight")
    stored = checkpoint_storage(
        qc, found_in, spec.quantization, head=head, locate=lambda i: spec.locate(f"quantization[{i}]")
    )
    entries: dict[str, Any] = {}
    for path in sorted(weights):
        tensor = weights[path]
        source = sources[path]
        entries[rename_weight(path, renames)] = {
            "shape": list(tensor.shape),
            "dtype": tensor.dtype,
            "sources": _source_entry(source, tensor.dtype, stored),
            "ops": list(source.ops),
        }
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": model_name,
        "base_model_prefix": getattr(model, "base_model_prefix", "") or "",
        "aliases": dict(sorted((s.groups[0].tensors[0], s.alias) for s in sources.values() if s.alias)),
        "quantization": stored.found_in,
        "notes": list(stored.notes),
        "rules": _rules(entries),
        # distinct tensors: one fused checkpoint tensor may build several weights (q, k, v from wqkv)
        "checkpoint_tensors": len({t for e in entries.values() for g in e["sources"] for t in g["tensors"]}),
        "weights": entries,
    }


def _head_path(weights: Mapping[str, TensorType]) -> str:
    """The output head among ``weights`` (the first, in their order), which no storage quantizes."""
    return next((p for p in weights if p.endswith("lm_head.weight")), "lm_head.weight")


def _head_source(sources: Mapping[str, CheckpointSource], head: str) -> str:
    """The checkpoint tensor the output head is read from - the name a quantization rule sees, which a
    conversion mapping may rename (DeepSeek-V4 stores ``lm_head.weight`` as ``head.weight``)."""
    source = sources.get(head)
    if source is None or len(source.groups) != 1 or len(source.groups[0].tensors) != 1:
        return head
    return source.groups[0].tensors[0]


def same_document(weights: Mapping[str, TensorType], other: Mapping[str, TensorType]) -> bool:
    """Whether ``weight_map_document`` of ``weights`` and of ``other`` are the same document (same
    spec, model and renames): the same weights by path and type, and the same head among them."""
    return dict(weights) == dict(other) and _head_path(weights) == _head_path(other)


def ir_quantization(name: str, entry: Mapping[str, Any]) -> dict[str, Any] | None:
    """The IR's ``quantization`` of graph weight ``name``: its weight map ``entry`` (the map's key is
    ``name``) in short - every source group's first tensor, count, shape and storage block, and the
    ops - or None when every source is stored as is. Read from the map, never computed beside it, so
    the IR cannot describe a storage the map does not (a stacked packed tensor no checkpoint holds)."""
    if not any("storage" in group for group in entry["sources"]):
        return None
    sources = []
    for group in entry["sources"]:
        source: dict[str, Any] = {"first": group["tensors"][0], "count": len(group["tensors"])}
        if "pattern" in group:
            source["pattern"] = group["pattern"]
        source["shape"] = group["shape"]
        if "storage" in group:
            source["storage"] = group["storage"]
        sources.append(source)
    return {"weight_map": name, "sources": sources, "ops": entry["ops"]}
