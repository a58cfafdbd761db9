"""Reference reader of a weight map: real checkpoint files in, the graphs' weights out.

Needs torch and safetensors only, so a runtime can copy it. ``load_weights(map, checkpoint)`` reads
every source tensor the map names from a checkpoint directory (``model.safetensors.index.json`` or
the ``*.safetensors`` files themselves), dequantizes per the storage block, rebuilds each graph
weight with the map's ops and casts it to the graph's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ...errors import KadaptError


class Checkpoint:
    """Lazily opened safetensors shards of one checkpoint directory, by tensor name."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            names = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / file for name, file in names.items()}
        else:
            self.files = {}
            for shard in sorted(directory.glob("*.safetensors")):
                with safe_open(str(shard), "pt") as handle:
                    self.files.update(dict.fromkeys(handle.keys(), shard))
        if not self.files:
            raise KadaptError(f"{directory}: no safetensors checkpoint (no index, no *.safetensors)")
        self._handles: dict[Path, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        file = self.files.get(name)
        if file is None:
            raise KadaptError(f"checkpoint has no tensor {name}")
        if file not in self._handles:
            self._handles[file] = self._open(str(file), "pt")
        return self._handles[file].get_tensor(name)


# OCP e2m1 (FP4) values by their 4-bit code: sign bit 3, then exponent and mantissa
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_int(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """compressed-tensors' dense packing undone: value ``i`` of a row is at bits ``bits*i``, offset coded."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], -1)[..., :columns] - (1 << (bits - 1))


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``[E, out, in/32, 16]`` blocks and ``[E, out, in/32]`` e8m0 scales -> ``[E, in, out]``."""
    e2m1 = torch.tensor(E2M1, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack((e2m1[(blocks & 0x0F).long()], e2m1[(blocks >> 4).long()]), dim=-1)
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - 127)[..., None])
    return values.flatten(-2).transpose(1, 2).contiguous()


def _read(checkpoint: Checkpoint, name: str, group: Mapping[str, Any]) -> torch.Tensor:
    storage = group.get("storage")
    if storage is None:
        return checkpoint.get(name)
    parts = {role: checkpoint.get(name + t["suffix"]) for role, t in storage["tensors"].items()}
    if storage["format"] == "mxfp4":
        return _mxfp4(parts["blocks"], parts["scales"])
    rows, cols = group["shape"]
    if storage["format"] == "compressed-tensors/pack-quantized":
        shape = tuple(int(v) for v in parts["shape"].tolist())
        if shape != (rows, cols):
            raise KadaptError(f"{name}_shape is {list(shape)}, the weight map says {[rows, cols]}")
        q = unpack_int(parts["packed"], storage["bits"], cols).to(torch.float32)
        scale = parts["scale"].to(torch.float32).repeat_interleave(storage["group_size"], dim=-1)[:, :cols]
        return q * scale
    if storage["format"] == "fp8-block":
        br, bc = storage["block"]
        scale = parts["scale"].to(torch.float32)
        scale = scale.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
        return parts["weight"].to(torch.float32) * scale
    raise KadaptError(f"{name}: storage format {storage['format']!r} is unknown")


def permute_for_rope(tensor: torch.Tensor, heads: int, *, inverse: bool = False) -> torch.Tensor:
    """Rows of each head from interleaved rope pairs to two halves (``inverse``: back): dim 0 viewed as
    ``[heads, half, 2]`` (inverse: ``[heads, 2, half]``), its last two axes swapped."""
    rows = tensor.shape[0]
    half = rows // heads // 2
    head_shape = (2, half) if inverse else (half, 2)
    return tensor.reshape(heads, *head_shape, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def combine(groups: list[list[torch.Tensor]], ops: list[Mapping[str, Any]]) -> torch.Tensor:
    """Apply the weight map's ops to the source groups (see weight_map.RULES)."""
    state: list[Any] = [g if len(g) > 1 else g[0] for g in groups]
    for op in ops:
        if op["op"] == "stack":
            state = [torch.stack(g if isinstance(g, list) else [g], dim=op["dim"]) for g in state]
        elif op["op"] == "concat":
            state = [torch.cat(state, dim=op["dim"])]
        elif op["op"] == "transpose":
            state = [state[0].transpose(*op["dims"])]
        elif op["op"] == "chunk":
            state = [torch.chunk(state[0], op["chunks"], dim=op["dim"])[op["index"]]]
        elif op["op"] == "permute_for_rope":
            state = [permute_for_rope(state[0], op["heads"], inverse=op["inverse"])]
        else:
            raise KadaptError(f"weight map op {op['op']!r} is unknown")
    if len(state) != 1 or isinstance(state[0], list):
        raise KadaptError("weight map ops leave more than one tensor")
    return state[0]


def load_weights(
    weight_map: Mapping[str, Any] | Path | str, checkpoint: Path | str
) -> dict[str, torch.Tensor]:
    """Every graph weight of ``weight_map``, built from the checkpoint directory ``checkpoint``."""
    doc = json.loads(Path(weight_map).read_text()) if isinstance(weight_map, (str, Path)) else weight_map
    store = Checkpoint(Path(checkpoint))
    out = {}
    for name, entry in doc["weights"].items():
        groups = [[_read(store, t, group) for t in group["tensors"]] for group in entry["sources"]]
        tensor = combine(groups, entry["ops"])
        if list(tensor.shape) != entry["shape"]:
            raise KadaptError(
                f"{name}: checkpoint tensors build {list(tensor.shape)}, the graph reads {entry['shape']}"
            )
        out[name] = tensor.to(getattr(torch, entry["dtype"]))
    return out
