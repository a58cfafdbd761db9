"""Binding graph weights to the real checkpoint: names, dtypes, ties and quantized storage.

The graph reads each weight under the model's parameter path; the IR lists it under the checkpoint's
name (``weight_renames``), with the dtype the checkpoint stores, a ``tied`` list when one tensor has
several names, and a ``quantization`` block when the spec says the checkpoint packs it (the graph
still computes in the ABI dtype: a runtime dequantizes while loading).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ...errors import KadaptError
from ...spec.model import QuantScheme
from .graph import WEIGHT, Graph, TensorType, dtype_name
from .naming import rename_weight


def keep_fp32_names(model: nn.Module) -> set[str]:
    """transformers' ``_keep_in_fp32_modules(_strict)`` of every sub-model (e.g. the router bias)."""
    names: set[str] = set()
    for module in model.modules():
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            names.update(getattr(module, attr, None) or ())
    return names


def cast_to_abi_dtype(modules: Iterable[nn.Module], dtype: torch.dtype, keep_fp32: set[str]) -> int:
    """Bring parameters and persistent buffers to the ABI dtype, as a checkpoint load would.

    Names listed in ``keep_fp32`` stay float32 (transformers loads them that way); non-persistent
    buffers (rotary ``inv_freq``) keep their dtype because they are computed, not loaded. Returns the
    number of tensors changed; on the meta device this costs nothing.
    """
    changed = 0
    for root in modules:
        for module_name, module in root.named_modules():
            tensors = [(n, p, True) for n, p in module.named_parameters(recurse=False)]
            tensors += [
                (n, b, False)
                for n, b in module.named_buffers(recurse=False)
                if n not in module._non_persistent_buffers_set
            ]
            for name, tensor, is_param in tensors:
                if not tensor.is_floating_point():
                    continue
                path = f"{module_name}.{name}" if module_name else name
                want = torch.float32 if keep_fp32 & set(path.split(".")) else dtype
                if tensor.dtype == want:
                    continue
                if is_param:
                    tensor.data = tensor.data.to(want)
                else:
                    module._buffers[name] = tensor.to(want)
                changed += 1
    return changed


def tied_names(model: nn.Module, paths: Iterable[str]) -> dict[str, list[str]]:
    """For each of ``paths``, the other names under which the model holds the same tensor."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(tensor), []).append(name)
    for name, tensor in model.named_buffers(remove_duplicate=False):
        by_tensor.setdefault(id(tensor), []).append(name)
    groups = {name: group for group in by_tensor.values() if len(group) > 1 for name in group}
    return {path: [n for n in groups[path] if n != path] for path in paths if path in groups}


def quantization_block(
    name: str, weight: TensorType, schemes: tuple[QuantScheme, ...], compute_dtype: str
) -> dict[str, Any] | None:
    """How the checkpoint stores ``name`` if a scheme covers it: packed words plus group scales."""
    for scheme in schemes:
        if not fnmatch.fnmatchcase(name, scheme.modules) or len(weight.shape) < 2:
            continue
        word_bits = torch.iinfo(getattr(torch, scheme.packed_dtype)).bits
        *outer, inner = weight.shape
        if inner % scheme.group_size or (inner * scheme.bits) % word_bits:
            raise KadaptError(
                f"quantization {scheme.id}: {name} {list(weight.shape)} does not split into groups of "
                f"{scheme.group_size} / {scheme.packed_dtype} words of {scheme.bits}-bit values"
            )
        return {
            "scheme": scheme.id,
            "bits": scheme.bits,
            "group_size": scheme.group_size,
            "pack_dim": len(weight.shape) - 1,
            "packed": {"shape": [*outer, inner * scheme.bits // word_bits], "dtype": scheme.packed_dtype},
            "scale": {"shape": [*outer, inner // scheme.group_size], "dtype": scheme.scale_dtype},
            "compute_dtype": compute_dtype,
        }
    return None


def weight_entries(
    graph: Graph,
    *,
    renames: tuple[tuple[str, str], ...],
    ties: dict[str, list[str]],
    schemes: tuple[QuantScheme, ...],
    compute_dtype: str,
) -> list[dict[str, Any]]:
    """The IR's ``weights`` list: one entry per checkpoint tensor the graph reads, in order of first use."""
    entries = []
    seen: dict[str, str] = {}
    first_use = {ref.key: None for node in graph.nodes for ref in node.inputs if ref.kind == WEIGHT}
    for path in first_use:
        weight = graph.weights[path]
        name = rename_weight(path, renames)
        if name in seen:
            raise KadaptError(f"weight_renames map both {seen[name]} and {path} to {name}")
        seen[name] = path
        entry: dict[str, Any] = {"name": name, "shape": list(weight.shape), "dtype": weight.dtype}
        if path in ties:
            entry["tied"] = [rename_weight(other, renames) for other in ties[path]]
        quant = quantization_block(name, weight, schemes, compute_dtype)
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
