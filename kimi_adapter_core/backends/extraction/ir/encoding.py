"""JSON encoding of operator attributes that torch's dispatcher accepts back unchanged.

pytorch-ir writes ``torch.float32``/``device('meta')`` attributes as strings (or fails to write them)
and its executor then passes those strings to the op, which rejects them. ATen's own boxed
representation of ``ScalarType``, ``Layout`` and ``MemoryFormat`` is an integer, and ``torch.ops``
accepts those integers and device strings directly, so that is what the IR stores: the saved JSON
runs as is, and the ``enums`` table in the metadata names every code.

Imports only torch: generated extraction modules embed this file verbatim for their ``save_ir``, so
kadapt's writer and theirs encode attributes the same way.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# TorchScript enum values (c10::Layout, c10::MemoryFormat); stable across releases.
LAYOUT_CODES = {torch.strided: 0, torch.sparse_coo: 1}
MEMORY_FORMAT_CODES = {
    torch.contiguous_format: 0,
    torch.preserve_format: 1,
    torch.channels_last: 2,
    torch.channels_last_3d: 3,
}


@functools.cache
def dtype_codes() -> dict[torch.dtype, int]:
    """c10::ScalarType code of every dtype this torch knows, read back from the dispatcher."""
    codes: dict[torch.dtype, int] = {}
    probe = torch.empty(0, device="meta")  # no allocation, no per-dtype CPU warnings
    for code in range(64):
        if code == 8:  # complex32: allocating it makes c10 print an "experimental" warning
            continue
        try:
            dtype = torch.ops.aten._to_copy.default(probe, dtype=code).dtype
        except (RuntimeError, TypeError):
            continue
        codes.setdefault(dtype, code)
    return codes


def enum_tables() -> dict[str, dict[str, str]]:
    """Code -> name tables written into the IR metadata so readers can decode attributes."""

    def table(codes: dict[Any, int]) -> dict[str, str]:
        return {
            str(code): str(item).removeprefix("torch.")
            for item, code in sorted(codes.items(), key=lambda x: x[1])
        }

    return {
        "dtype": table(dtype_codes()),
        "layout": table(LAYOUT_CODES),
        "memory_format": table(MEMORY_FORMAT_CODES),
    }


def encode(value: Any, *, device: str) -> Any:
    """A JSON value the op accepts in place of ``value``; meta devices become ``device``.

    Non-finite floats stay floats (masking fill values); ``irjson`` writes them as ``±1e400``.
    """
    if isinstance(value, torch.dtype):
        return dtype_codes()[value]
    if isinstance(value, torch.layout):
        return LAYOUT_CODES[value]
    if isinstance(value, torch.memory_format):
        return MEMORY_FORMAT_CODES[value]
    if isinstance(value, torch.device):
        return device if value.type == "meta" else str(value)
    if isinstance(value, (list, tuple)):
        return [encode(item, device=device) for item in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"cannot encode operator attribute {value!r} ({type(value).__name__}) in the IR")
