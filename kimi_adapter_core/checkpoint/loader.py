"""Reference reader of a weight map: real checkpoint files in, the graphs' weights out.

Needs torch and safetensors only, so a runtime can copy it (with ``guard``).
``load_weights(map, checkpoint)`` reads every source tensor the map names from a checkpoint directory
(``model.safetensors.index.json`` or the ``*.safetensors`` files themselves), dequantizes per the
storage block, rebuilds each graph weight with the map's ops and casts it to the graph's dtype.

Both inputs may come from anywhere: ``guard`` checks the map's structure and storage
geometry before any file is opened, confines every shard to the checkpoint folder, and compares each
stored tensor's dtype and shape with the map before its data is read. Anything wrong is one
``KadaptError`` naming the file and the tensor or key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import KadaptError
from .guard import (
    DTYPES,
    FP4_BLOCK,
    FP4_E2M1,
    FP8_BLOCK,
    MXFP4,
    PACK_QUANTIZED,
    SCALE_INV_FORMS,
    Folder,
    MapReader,
    add_names,
    check_stored,
    read_json,
    regular_file,
)


class Checkpoint:
    """Lazily opened safetensors shards of one checkpoint directory, by tensor name.

    Shards come from the folder's index, else from its ``*.safetensors`` files (a name in two of them
    is ambiguous, so an error); either way each resolves inside the folder to a regular file."""

    def __init__(
        self, directory: Path | str, base_model_prefix: str = "", aliases: Mapping[str, str] | None = None
    ) -> None:
        folder = Folder(directory)
        self.root = folder.root
        self.base_model_prefix = base_model_prefix
        self.aliases = dict(aliases or {})
        self._handles: dict[Path, Any] = {}
        indexed = folder.indexed()
        if indexed is not None:
            self.files = indexed
        else:
            self.files = {}
            for shard in folder.shards():
                add_names(self.files, self._handle(shard).keys(), shard)
        if not self.files:
            raise KadaptError(f"{directory}: no safetensors checkpoint (no index, no *.safetensors)")

    def _handle(self, file: Path) -> Any:
        """The open safetensors ``file``; a file that is not one is an error naming it."""
        if file not in self._handles:
            from safetensors import SafetensorError, safe_open

            try:
                self._handles[file] = safe_open(str(file), "pt")
            except (SafetensorError, OSError) as exc:
                raise KadaptError(f"{file}: not a readable safetensors file ({exc})") from exc
        return self._handles[file]

    def resolve(self, name: str, forms: tuple[str, ...] = ()) -> str:
        """The name tensor ``name`` is stored under: ``name``, one of its other ``forms`` or its
        ``aliases`` entry, each also without the base model's prefix - the names transformers' loader
        accepts (a checkpoint of the base model: DeepSeek-V4-Flash's ``layers.0...`` for
        ``model.layers.0...``, ``embed.weight`` for ``model.embed_tokens.weight``). Present under two of
        them, which is the checkpoint's tensor is ambiguous: an error."""
        prefix = f"{self.base_model_prefix}." if self.base_model_prefix else ""
        names = (name, *forms, *(self.aliases[n] for n in (name, *forms) if n in self.aliases))
        candidates = [*names, *(n[len(prefix) :] for n in names if prefix and n.startswith(prefix))]
        present = [n for n in dict.fromkeys(candidates) if n in self.files]
        if not present:
            raise KadaptError(f"{self.root}: checkpoint has no tensor {name}")
        if len(present) > 1:
            raise KadaptError(
                f"{self.root}: tensor {name} is stored under {len(present)} names ({', '.join(present)}): "
                "which one is the checkpoint's is ambiguous"
            )
        return present[0]

    def get(self, name: str, dtype: str, shape: list[int], forms: tuple[str, ...] = ()) -> torch.Tensor:
        """Tensor ``name`` (or its other ``forms``, ``resolve``), checked from the file's header to be
        stored ``dtype`` of ``shape`` first."""
        from safetensors import SafetensorError

        name = self.resolve(name, forms)
        file = self.files[name]
        handle = self._handle(file)
        try:
            stored = handle.get_slice(name)
        except SafetensorError as exc:
            raise KadaptError(f"{file}: has no tensor {name}, though the index says it does ({exc})") from exc
        check_stored(stored.get_dtype(), stored.get_shape(), file, name, dtype, shape)
        return handle.get_tensor(name)


# OCP e2m1 (FP4) values by their 4-bit code: sign bit 3, then exponent and mantissa
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_int(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """compressed-tensors' dense packing undone: value ``i`` of a row is at bits ``bits*i``, offset coded."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], -1)[..., :columns] - (1 << (bits - 1))


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Bytes of two e2m1 codes each (low nibble first) -> float32 values, the last dim twice as wide."""
    e2m1 = torch.tensor(E2M1, dtype=torch.float32)
    return torch.stack((e2m1[(codes & 0x0F).long()], e2m1[(codes >> 4).long()]), dim=-1).flatten(-2)


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``[E, out, in/32, 16]`` blocks and ``[E, out, in/32]`` e8m0 scales -> ``[E, in, out]``."""
    values = torch.ldexp(_e2m1(blocks.to(torch.uint8)), (scales.to(torch.int32) - 127)[..., None])
    return values.flatten(-2).transpose(1, 2).contiguous()


def _fp4_e2m1(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's FP4 expert weight: int8 ``[out, in/2]`` (two e2m1 codes a byte, low nibble first)
    times one scale per ``FP4_BLOCK`` inputs of a row -> float32 ``[out, in]``."""
    return _e2m1(weight.view(torch.uint8)) * scale.to(torch.float32).repeat_interleave(FP4_BLOCK, dim=-1)


def _forms(name: str, suffix: str) -> tuple[str, ...]:
    """Other names of storage tensor ``name + suffix``: an FP8 scale as transformers' loader reads it."""
    if suffix != "_scale_inv" or not name.endswith(".weight"):
        return ()
    return tuple(name.removesuffix(".weight") + form for form in SCALE_INV_FORMS)


def _read(checkpoint: Checkpoint, name: str, group: Mapping[str, Any]) -> torch.Tensor:
    """Source tensor ``name`` of ``group`` (checked by ``MapReader``), dequantized per its storage."""
    storage = group.get("storage")
    if storage is None:
        return checkpoint.get(name, group["dtype"], group["shape"])
    bases = (name, checkpoint.aliases[name]) if name in checkpoint.aliases else (name,)
    parts = {
        role: checkpoint.get(
            name + t["suffix"],
            t["dtype"],
            t["shape"],
            (*(b + t["suffix"] for b in bases[1:]), *(f for b in bases for f in _forms(b, t["suffix"]))),
        )
        for role, t in storage["tensors"].items()
    }
    if storage["format"] == MXFP4:
        return _mxfp4(parts["blocks"], parts["scales"])
    if storage["format"] == FP4_E2M1:
        return _fp4_e2m1(parts["weight"], parts["scale"])
    rows, cols = group["shape"]
    if storage["format"] == PACK_QUANTIZED:
        shape = [int(v) for v in parts["shape"].tolist()]
        if shape != [rows, cols]:
            held = name + storage["tensors"]["shape"]["suffix"]
            raise KadaptError(
                f"{checkpoint.files[held]}: tensor {held} holds {shape}, the weight map says {[rows, cols]}"
            )
        q = unpack_int(parts["packed"], storage["bits"], cols).to(torch.float32)
        scale = parts["scale"].to(torch.float32).repeat_interleave(storage["group_size"], dim=-1)[:, :cols]
        return q * scale
    assert storage["format"] == FP8_BLOCK  # the only other format MapReader lets through
    br, bc = storage["block"]
    scale = parts["scale"].to(torch.float32)
    scale = scale.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return parts["weight"].to(torch.float32) * scale


def permute_for_rope(tensor: torch.Tensor, heads: int, *, inverse: bool = False) -> torch.Tensor:
    """Rows of each head from interleaved rope pairs to two halves (``inverse``: back): dim 0 viewed as
    ``[heads, half, 2]`` (inverse: ``[heads, 2, half]``), its last two axes swapped."""
    rows = tensor.shape[0]
    half = rows // heads // 2
    head_shape = (2, half) if inverse else (half, 2)
    return tensor.reshape(heads, *head_shape, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def _single(state: list[Any], op: Mapping[str, Any]) -> torch.Tensor:
    """The one tensor ``op`` (transpose, chunk, split, permute_for_rope) works on."""
    if len(state) != 1 or isinstance(state[0], list):
        raise ValueError(f"{op['op']} needs one tensor, the ops so far leave {len(state)} groups")
    return state[0]


def _dim(dim: int, rank: int) -> int:
    """``dim`` checked to index a rank-``rank`` result, as torch counts (negative from the end)."""
    if not -rank <= dim < rank:
        raise ValueError(f"dim {dim} is out of range for {rank} dims")
    return dim


def _chunk(tensor: torch.Tensor, op: Mapping[str, Any]) -> torch.Tensor:
    size = tensor.shape[_dim(op["dim"], tensor.dim())]
    if size % op["chunks"]:
        raise ValueError(f"{size} does not split into {op['chunks']} equal parts on dim {op['dim']}")
    return torch.chunk(tensor, op["chunks"], dim=op["dim"])[op["index"]]


def _split(tensor: torch.Tensor, op: Mapping[str, Any]) -> torch.Tensor:
    size = tensor.shape[_dim(op["dim"], tensor.dim())]
    if size != sum(op["sizes"]):
        raise ValueError(f"{size} does not split into parts of {op['sizes']} on dim {op['dim']}")
    return torch.split(tensor, op["sizes"], dim=op["dim"])[op["index"]]


def _rope(tensor: torch.Tensor, op: Mapping[str, Any]) -> torch.Tensor:
    rows = tensor.shape[0] if tensor.dim() else 0
    if not rows or rows % (2 * op["heads"]):
        raise ValueError(f"{rows} rows do not split into {op['heads']} heads of rope pairs")
    return permute_for_rope(tensor, op["heads"], inverse=op["inverse"])


def _applied(state: list[Any], op: Mapping[str, Any]) -> list[Any]:
    """``state`` (one tensor, or a list of tensors, per source group) after ``op`` (checked by
    ``MapReader``); dims and sizes that do not fit the tensors are a ``ValueError``, as are torch's
    own shape errors a ``RuntimeError``."""
    kind = op["op"]
    if kind == "stack":
        groups = [g if isinstance(g, list) else [g] for g in state]
        return [torch.stack(g, dim=_dim(op["dim"], g[0].dim() + 1)) for g in groups]
    if kind == "concat":
        if any(isinstance(g, list) for g in state):
            raise ValueError("concat needs one tensor per source group (stack a group's tensors first)")
        return [torch.cat(state, dim=_dim(op["dim"], state[0].dim()))]
    tensor = _single(state, op)
    if kind == "transpose":
        return [tensor.transpose(*(_dim(d, tensor.dim()) for d in op["dims"]))]
    if kind == "chunk":
        return [_chunk(tensor, op)]
    if kind == "split":
        return [_split(tensor, op)]
    return [_rope(tensor, op)]


def _shapes(state: list[Any]) -> str:
    return ", ".join(
        str([list(t.shape) for t in g]) if isinstance(g, list) else str(list(g.shape)) for g in state
    )


def combine(
    groups: list[list[torch.Tensor]], ops: list[Mapping[str, Any]], where: str = "weight map"
) -> torch.Tensor:
    """Apply the weight map's ops to the source groups (see weight_map.RULES); ``where`` names the
    weight for errors. An op whose dims or sizes do not fit the tensors it meets is a ``KadaptError``."""
    state: list[Any] = [g if len(g) > 1 else g[0] for g in groups]
    for i, op in enumerate(ops):
        try:
            state = _applied(state, op)
        except (ValueError, RuntimeError) as exc:
            reason = str(exc).splitlines()[0]  # torch appends C++ frames to some messages
            raise KadaptError(
                f"{where}.ops[{i}] ({op['op']}) cannot apply to {_shapes(state)}: {reason}"
            ) from exc
    if len(state) != 1 or isinstance(state[0], list):
        raise KadaptError(f"{where}: the ops leave {len(state)} tensors, not one")
    return state[0]


def _document(weight_map: Mapping[str, Any] | Path | str) -> tuple[Any, str]:
    """The weight map document and how messages name it (its file, when given one)."""
    if isinstance(weight_map, (str, Path)):
        path = regular_file(weight_map, "weight map")
        return read_json(path, "weight map"), str(weight_map)
    return weight_map, "weight map"


def load_weights(
    weight_map: Mapping[str, Any] | Path | str, checkpoint: Path | str
) -> dict[str, torch.Tensor]:
    """Every graph weight of ``weight_map``, built from the checkpoint directory ``checkpoint``."""
    doc, source = _document(weight_map)
    reader = MapReader(source)
    weights = reader.weights(doc)  # the whole map checked before any checkpoint file opens
    store = Checkpoint(Path(checkpoint), reader.base_model_prefix(doc), reader.aliases(doc))
    out = {}
    for name, entry in weights.items():
        where = f"{source}: weights[{name!r}]"
        groups = [[_read(store, t, group) for t in group["tensors"]] for group in entry["sources"]]
        tensor = combine(groups, entry["ops"], where)
        if list(tensor.shape) != entry["shape"]:
            raise KadaptError(
                f"{where}: checkpoint tensors build {list(tensor.shape)}, the graph reads {entry['shape']}"
            )
        out[name] = tensor.to(DTYPES[entry["dtype"]])
    return out
