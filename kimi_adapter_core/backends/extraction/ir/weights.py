"""Binding graph weights to the real checkpoint: names, dtypes, ties and quantized storage.

The graph reads each weight under the model's parameter path; the IR lists it under the checkpoint's
name (``weight_renames``), with the dtype the checkpoint stores, a ``tied`` list when one tensor has
several names, and a ``quantization`` block - its weight map entry in short - when the checkpoint stores
it quantized (the graph still computes in the ABI dtype: a runtime dequantizes while loading).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from .... import upstream
from ....checkpoint.naming import rename_weight
from ....checkpoint.tensors import TensorType, dtype_name
from ....checkpoint.weight_map import ir_quantization
from ....errors import KadaptError
from .graph import WEIGHT, Graph


def tied_names(model: nn.Module, paths: Iterable[str]) -> dict[str, list[str]]:
    """For each of ``paths``, the other names under which the model holds the same tensor."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(tensor), []).append(name)
    for name, tensor in model.named_buffers(remove_duplicate=False):
        by_tensor.setdefault(id(tensor), []).append(name)
    groups = {name: group for group in by_tensor.values() if len(group) > 1 for name in group}
    return {path: [n for n in groups[path] if n != path] for path in paths if path in groups}


def weight_entries(
    graph: Graph,
    *,
    renames: tuple[tuple[str, str], ...],
    ties: dict[str, list[str]],
    weight_map: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """The IR's ``weights`` list: one entry per checkpoint tensor the graph reads, in order of first use.

    ``weight_map`` is the weight map document written beside the IR; a weight whose checkpoint sources
    are stored quantized carries that map entry in short as ``quantization`` (``ir_quantization``)."""
    entries = []
    seen: dict[str, str] = {}
    mapped = weight_map["weights"]
    first_use = {ref.key: None for node in graph.nodes for ref in node.inputs if ref.kind == WEIGHT}
    for path in first_use:
        weight = graph.weights[path]
        name = rename_weight(path, renames)
        if name in seen:
            raise KadaptError(f"weight_renames map both {seen[name]} and {path} to {name}")
        seen[name] = path
        source = mapped.get(name)
        if source is None or source["shape"] != list(weight.shape):
            found = "no entry" if source is None else f"shape {source['shape']}"
            raise KadaptError(
                f"the {graph.kind} graph reads {name} {list(weight.shape)}, the weight map has {found}"
            )
        entry: dict[str, Any] = {"name": name, "shape": list(weight.shape), "dtype": weight.dtype}
        if path in ties:
            entry["tied"] = [rename_weight(other, renames) for other in ties[path]]
        quant = ir_quantization(name, source)
        if quant is not None:
            entry["quantization"] = quant
        entries.append(entry)
    return entries


def model_tensor_types(model: nn.Module) -> dict[str, TensorType]:
    """Shape and dtype of every parameter and buffer of ``model`` by path."""
    types = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        types[name] = TensorType(tuple(tensor.shape), dtype_name(tensor.dtype))
    return types


def buffer_value(model: nn.Module, path: str) -> Any:
    """Non-persistent buffer ``path`` of ``model`` as a CPU tensor: its own value, or on the meta device
    the one transformers' ``_init_weights`` gives it (``upstream.rebuild_buffer``; None: none does)."""
    tensor = model.get_buffer(path)
    return tensor.detach().cpu() if tensor.device.type != "meta" else upstream.rebuild_buffer(model, path)
