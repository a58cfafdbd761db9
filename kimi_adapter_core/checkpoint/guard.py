"""What a checkpoint folder and a weight map must be before ``weight_loader`` reads a byte of them.

Checkpoints are downloaded from the internet and weight maps travel beside them, so the reference
loader treats both as hostile: a shard path must resolve inside the checkpoint folder to a regular
file (never ``../x``, ``/etc/passwd``, a symlink out, a FIFO or a device: nothing is opened outside,
nothing blocks); an index and a weight map must be the JSON kadapt and transformers write; every
storage block's tensors must be the geometry its own parameters imply; and each stored tensor's
dtype and shape are compared with the map from the safetensors header before its data is read, so a
tensor stored int32 where the map says float32, or int4 grouped 16 where it says 32, is refused
rather than cast into wrong weights. Each failure is one ``KadaptError`` naming the file, the key or
tensor, what was expected and what was found.

Kept apart from ``weight_loader`` so that module stays about converting; like it, this one needs
torch and safetensors only (plus kadapt's error class), so a runtime can copy both.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import KadaptError

INDEX = "model.safetensors.index.json"
PACK_QUANTIZED, FP8_BLOCK, MXFP4 = "compressed-tensors/pack-quantized", "fp8-block", "mxfp4"
FP4_E2M1 = "fp4-e2m1"
MXFP4_BLOCK = FP4_BLOCK = 32
FORMATS = (PACK_QUANTIZED, FP8_BLOCK, MXFP4, FP4_E2M1)

# The dtypes kadapt writes into a weight map (graph weights, sources, storage tensors): a map naming any
# other is refused, never resolved as an attribute of torch.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
FLOAT_SCALES = ("float32", "bfloat16", "float16")
FP8_SCALES = ("float32", "float8_e8m0fnu")  # an fp8 quantization_config's scale_fmt: float, ue8m0
# other names transformers' FP8 loader reads a ``X.weight_scale_inv`` under (its quantizer's renames):
# DeepSeek-V4-Flash ships ``X.scale``, Mistral Large 4 ``X.qscale_weight``
SCALE_INV_FORMS = (".scale", ".qscale_weight")
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
INT_BITS = (1, 2, 4, 8)  # values compressed-tensors packs whole into an int32 word
# safetensors' header dtype codes, by torch's spelling
STORED_DTYPES = {
    "F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "I64": "int64", "I32": "int32", "I16": "int16",
    "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def shown(value: Any) -> str:
    """``value`` for a message: short, and never a deep repr of a hostile nested structure."""
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list) and any(isinstance(v, (list, Mapping)) for v in value):
        return f"a nested list of {len(value)}"
    try:
        text = repr(value)
    except ValueError:  # an integer with more digits than Python converts
        return "a number too large to show"
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- files


def _regular(path: Path, where: str) -> None:
    """``path`` (already resolved) is a regular file: stat, not open, so a FIFO or device never blocks."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as exc:
        reason = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc})"
        raise KadaptError(f"{where} {reason}") from exc
    if not stat.S_ISREG(mode):
        raise KadaptError(f"{where} is not a regular file (a folder, FIFO or device is never opened)")


def _resolved(path: Path | str, where: str) -> Path:
    """``path`` with every symlink and ``..`` resolved (no file is opened)."""
    try:
        return Path(os.path.realpath(path))
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long
        raise KadaptError(f"{where} cannot be resolved ({exc})") from exc


def regular_file(path: Path | str, what: str) -> Path:
    """``path`` resolved, checked to be a regular file (a weight map given by path)."""
    resolved = _resolved(path, f"{path}: the {what}")
    _regular(resolved, f"{path}: the {what}")
    return resolved


def read_json(path: Path, what: str) -> Any:
    """The JSON document in ``path`` (a regular file), duplicate keys refused: which of two values a
    reader takes is ambiguous. Any unreadable, non-UTF-8, malformed or absurdly nested file is one
    error naming it."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    try:
        return json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=unique)
    except (
        OSError,
        ValueError,
        RecursionError,
    ) as exc:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise KadaptError(f"{path}: not a readable {what} (expected UTF-8 JSON): {exc}") from exc


def _hub_blobs(root: Path) -> Path | None:
    """The ``blobs`` folder of the Hugging Face hub cache repository whose snapshot ``root`` is, else
    None. The hub's cache stores each snapshot's files as symlinks into that repository's ``blobs``
    (``models--org--name/snapshots/<rev>/x -> ../../blobs/<hash>``): those stay in the checkpoint."""
    for parent in root.parents:
        if parent.name == "snapshots":
            repo = parent.parent
            return repo / "blobs" if repo.name.startswith(("models--", "datasets--", "spaces--")) else None
    return None


class Folder:
    """A checkpoint folder, resolved once; every file it names must resolve inside it."""

    def __init__(self, directory: Path | str) -> None:
        self.root = _resolved(directory, f"{directory}: the checkpoint folder")
        try:
            mode = os.stat(self.root).st_mode
        except (OSError, ValueError) as exc:
            raise KadaptError(f"{directory}: cannot read the checkpoint folder ({exc})") from exc
        if not stat.S_ISDIR(mode):
            raise KadaptError(
                f"{directory}: a checkpoint is a folder of safetensors files, this is not a folder"
            )
        blobs = _hub_blobs(self.root)
        self._inside = (self.root,) if blobs is None else (self.root, blobs)

    def file(self, name: Any, named_by: Path, what: str = "shard") -> Path:
        """The regular file ``name`` (relative to the folder, as ``named_by`` gives it) resolved: an
        absolute name, ``..`` or a symlink that leads out of the folder, and anything but a regular
        file, are refused before anything is opened."""
        if not isinstance(name, str) or not name:
            raise KadaptError(f"{named_by}: {what} {shown(name)} is not a file name")
        resolved = _resolved(self.root / name, f"{named_by}: {what} {name!r}")
        if not any(resolved.is_relative_to(area) for area in self._inside):
            raise KadaptError(
                f"{named_by}: {what} {name!r} resolves to {resolved}, "
                f"outside the checkpoint folder {self.root}"
            )
        _regular(resolved, f"{named_by}: {what} {name!r}")
        return resolved

    def indexed(self) -> dict[str, Path] | None:
        """Tensor name -> shard file from the folder's index, None when it has none."""
        if not os.path.lexists(self.root / INDEX):
            return None
        index = self.file(INDEX, self.root, "index")
        doc = read_json(index, "checkpoint index")
        names = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(names, dict):
            if not isinstance(doc, dict):
                found = shown(doc)
            else:
                found = f"weight_map {shown(names)}" if "weight_map" in doc else "no weight_map"
            raise KadaptError(
                f"{index}: expected a JSON object with a weight_map (tensor -> shard), found {found}"
            )
        for name, shard in names.items():
            if not isinstance(shard, str):
                raise KadaptError(
                    f"{index}: weight_map[{name!r}] is {shown(shard)}, expected a shard file name"
                )
        files = {shard: self.file(shard, index) for shard in sorted(set(names.values()))}
        return {name: files[shard] for name, shard in names.items()}

    def shards(self) -> list[Path]:
        """The folder's ``*.safetensors`` files, each confined like an index's shard."""
        return [self.file(shard.name, self.root) for shard in sorted(self.root.glob("*.safetensors"))]


def add_names(files: dict[str, Path], names: Iterable[str], shard: Path) -> None:
    """Record ``names`` as held by ``shard``; a name another shard holds too is ambiguous."""
    for name in names:
        other = files.setdefault(name, shard)
        if other != shard:
            raise KadaptError(
                f"tensor {name} is in both {other} and {shard}: which one is the checkpoint's is "
                "ambiguous (give the folder a model.safetensors.index.json)"
            )


# Stored -> map dtypes whose cast is exact (every stored value is a value of the map's type): what
# transformers' own loader does when a checkpoint stores a tensor narrower than the parameter its dtype
# plan keeps (a bf16-saved router bias loaded into the float32 parameter; transformers 5.23 saves
# DeepSeek-V3's e_score_correction_bias that way). Anything else - narrowing, integer, bool, another
# float8 - is refused.
EXACT_WIDENING = {
    ("bfloat16", "float32"),
    ("float16", "float32"),
    ("bfloat16", "float64"),
    ("float16", "float64"),
    ("float32", "float64"),
}


def check_stored(
    found_dtype: str, found_shape: list[int], file: Path, name: str, dtype: str, shape: Any
) -> None:
    """The header's dtype (a safetensors code) and shape of tensor ``name`` in ``file`` are what the
    weight map says, or a dtype that widens to it exactly: nothing is rounded, reinterpreted or
    reshaped into a weight it is not."""
    found = STORED_DTYPES.get(found_dtype, found_dtype)
    if (found != dtype and (found, dtype) not in EXACT_WIDENING) or list(found_shape) != list(shape):
        raise KadaptError(
            f"{file}: tensor {name} is stored {found} {list(found_shape)}, "
            f"the weight map says {dtype} {list(shape)}"
        )


# ---------------------------------------------------------------- weight map documents

OP_ARGS = {
    "stack": ("dim",),
    "concat": ("dim",),
    "transpose": ("dims",),
    "chunk": ("dim", "chunks", "index"),
    "split": ("dim", "sizes", "index"),
    "permute_for_rope": ("heads", "inverse"),
}


def _ceil(size: int, block: int) -> int:
    """``size / block`` rounded up, in integers (a hostile size overflows a float)."""
    return -(-size // block)


def _at(where: str, key: str) -> str:
    """Key ``key`` of the node at ``where`` ("" the document itself), as messages name it."""
    return f"{where}.{key}" if where else key


class MapReader:
    """Checks a weight map document's structure, naming ``source`` (its file) and the key."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, where: str, value: Any, expected: str) -> KadaptError:
        return KadaptError(f"{self.source}: {where or 'the document'} is {shown(value)}, expected {expected}")

    def get(self, obj: Any, key: str, where: str) -> Any:
        if not isinstance(obj, Mapping):
            raise self.error(where, obj, "an object")
        if key not in obj:
            raise KadaptError(f"{self.source}: {where or 'the document'} has no {key!r}")
        return obj[key]

    def typed(self, obj: Any, key: str, where: str, kind: type, expected: str) -> Any:
        value = self.get(obj, key, where)
        if type(value) is not kind:  # exact: a JSON true is no integer
            raise self.error(_at(where, key), value, expected)
        return value

    def integer(self, obj: Any, key: str, where: str, minimum: int | None = None) -> int:
        value = self.get(obj, key, where)
        if type(value) is not int or (minimum is not None and value < minimum):
            raise self.error(
                _at(where, key), value, "an integer" + (f" >= {minimum}" if minimum is not None else "")
            )
        return value

    def sizes(self, obj: Any, key: str, where: str, length: int | None = None, minimum: int = 0) -> list[int]:
        value = self.get(obj, key, where)
        if (
            not isinstance(value, list)
            or any(type(v) is not int or v < minimum for v in value)
            or (length is not None and len(value) != length)
        ):
            count = f"{length} " if length is not None else ""
            raise self.error(_at(where, key), value, f"a list of {count}integers >= {minimum}")
        return value

    def dtype(self, obj: Any, key: str, where: str, allowed: Iterable[str] = DTYPES) -> str:
        value = self.get(obj, key, where)
        allowed = tuple(allowed)
        if not isinstance(value, str) or value not in allowed:
            raise self.error(_at(where, key), value, f"one of {', '.join(allowed)}")
        return value

    def base_model_prefix(self, doc: Any) -> str:
        """The document's ``base_model_prefix`` (absent: none): a module name, never a path."""
        if not isinstance(doc, Mapping) or "base_model_prefix" not in doc:
            return ""
        value = doc["base_model_prefix"]
        if not isinstance(value, str) or (value and not MODULE_NAME.fullmatch(value)):
            raise self.error("base_model_prefix", value, "a module name (letters, digits, _) or ''")
        return value

    def aliases(self, doc: Any) -> dict[str, str]:
        """The document's ``aliases`` (absent: none): checkpoint tensor name -> another name of it."""
        if not isinstance(doc, Mapping) or "aliases" not in doc:
            return {}
        value = doc["aliases"]
        if not isinstance(value, dict) or not all(isinstance(v, str) and v for v in value.values()):
            raise self.error("aliases", value, "an object (tensor name -> another name of it)")
        return value

    def weights(self, doc: Any) -> dict[str, Any]:
        """The document's ``weights``, every entry checked."""
        weights = self.typed(doc, "weights", "", dict, "an object (graph weight -> entry)")
        for name, entry in weights.items():
            self.entry(entry, f"weights[{name!r}]")
        return weights

    def entry(self, entry: Any, where: str) -> None:
        self.sizes(entry, "shape", where)
        dtype = self.dtype(entry, "dtype", where)
        sources = self.typed(entry, "sources", where, list, "a list of source groups")
        if not sources:
            raise self.error(f"{where}.sources", sources, "at least one source group")
        for i, group in enumerate(sources):
            self.group(group, f"{where}.sources[{i}]", dtype)
        for i, op in enumerate(self.typed(entry, "ops", where, list, "a list of ops")):
            self.op(op, f"{where}.ops[{i}]")

    def group(self, group: Any, where: str, dtype: str) -> None:
        tensors = self.typed(group, "tensors", where, list, "a list of checkpoint tensor names")
        if not tensors or not all(isinstance(t, str) for t in tensors):
            raise self.error(f"{where}.tensors", tensors, "a non-empty list of checkpoint tensor names")
        shape = self.sizes(group, "shape", where)
        if self.dtype(group, "dtype", where) != dtype:  # the writer gives every source the weight's dtype
            raise self.error(f"{where}.dtype", group["dtype"], f"the weight's dtype {dtype}")
        if "storage" in group:
            self.storage(group["storage"], f"{where}.storage", shape)

    def op(self, op: Any, where: str) -> None:
        kind = self.get(op, "op", where)
        if not isinstance(kind, str) or kind not in OP_ARGS:
            raise self.error(f"{where}.op", kind, f"one of {', '.join(OP_ARGS)}")
        if "dim" in OP_ARGS[kind]:
            self.integer(op, "dim", where)
        if kind == "transpose":
            value = self.get(op, "dims", where)
            if not isinstance(value, list) or len(value) != 2 or any(type(v) is not int for v in value):
                raise self.error(f"{where}.dims", value, "a list of 2 integers")
        if kind == "chunk":
            chunks = self.integer(op, "chunks", where, minimum=1)
            index = self.integer(op, "index", where, minimum=0)
            if index >= chunks:
                raise self.error(f"{where}.index", index, f"below chunks ({chunks})")
        if kind == "split":
            sizes = self.sizes(op, "sizes", where)
            index = self.integer(op, "index", where, minimum=0)
            if index >= len(sizes):
                raise self.error(f"{where}.index", index, f"below the number of sizes ({len(sizes)})")
        if kind == "permute_for_rope":
            self.integer(op, "heads", where, minimum=1)
            self.typed(op, "inverse", where, bool, "true or false")

    def storage(self, storage: Any, where: str, shape: list[int]) -> None:
        """A storage block: its parameters make sense for the source's ``shape`` and its ``tensors`` are
        exactly the roles, dtypes and shapes those parameters imply (``checkpoint_storage`` writes them)."""
        kind = self.get(storage, "format", where)
        tensors = self.typed(storage, "tensors", where, dict, "an object (role -> stored tensor)")
        if kind == PACK_QUANTIZED:
            implied = self._pack_quantized(storage, where, shape)
        elif kind == FP8_BLOCK:
            implied = self._fp8_block(storage, where, shape)
        elif kind == MXFP4:
            implied = self._mxfp4(storage, where, shape)
        elif kind == FP4_E2M1:
            implied = self._fp4_e2m1(storage, where, shape)
        else:
            raise self.error(f"{where}.format", kind, f"one of {', '.join(FORMATS)}")
        if set(tensors) != set(implied):
            found = ", ".join(sorted(map(str, tensors))) or "none"
            raise KadaptError(
                f"{self.source}: {where}.tensors has the roles {found}, expected {', '.join(implied)}"
            )
        for role, (dtype, sizes) in implied.items():
            part = f"{where}.tensors.{role}"
            self.typed(tensors[role], "suffix", part, str, "a tensor name suffix")
            recorded = (self.dtype(tensors[role], "dtype", part), self.get(tensors[role], "shape", part))
            if recorded != (dtype, sizes):
                raise KadaptError(
                    f"{self.source}: {part} is {recorded[0]} {shown(recorded[1])}, "
                    f"its storage parameters imply {dtype} {sizes}"
                )

    def _matrix(self, shape: list[int], where: str, rank: int) -> list[int]:
        if len(shape) != rank or 0 in shape:
            raise KadaptError(
                f"{self.source}: {where} stores a source of shape {shape}, expected {rank} positive sizes"
            )
        return shape

    def _pack_quantized(self, storage: Any, where: str, shape: list[int]) -> dict[str, tuple[str, list[int]]]:
        rows, cols = self._matrix(shape, where, 2)
        bits = self.get(storage, "bits", where)
        if type(bits) is not int or bits not in INT_BITS:
            raise self.error(f"{where}.bits", bits, f"one of {', '.join(map(str, INT_BITS))}")
        group = self.integer(storage, "group_size", where, minimum=1)
        if cols % group:
            raise self.error(f"{where}.group_size", group, f"a divisor of the source's {cols} columns")
        if storage.get("symmetric") is not True:
            raise self.error(f"{where}.symmetric", storage.get("symmetric"), "true (symmetric quantization)")
        scale = self.dtype(
            self.get(storage["tensors"], "scale", f"{where}.tensors"),
            "dtype",
            f"{where}.tensors.scale",
            FLOAT_SCALES,
        )
        return {
            "packed": ("int32", [rows, _ceil(cols * bits, 32)]),
            "scale": (scale, [rows, cols // group]),
            "shape": ("int64", [2]),
        }

    def _fp8_block(self, storage: Any, where: str, shape: list[int]) -> dict[str, tuple[str, list[int]]]:
        rows, cols = self._matrix(shape, where, 2)
        block_rows, block_cols = self.sizes(storage, "block", where, length=2, minimum=1)
        return {
            "weight": ("float8_e4m3fn", [rows, cols]),
            "scale": (self._scale_dtype(storage, where), [_ceil(rows, block_rows), _ceil(cols, block_cols)]),
        }

    def _scale_dtype(self, storage: Any, where: str) -> str:
        scale = self.get(storage["tensors"], "scale", f"{where}.tensors")
        return self.dtype(scale, "dtype", f"{where}.tensors.scale", FP8_SCALES)

    def _fp4_e2m1(self, storage: Any, where: str, shape: list[int]) -> dict[str, tuple[str, list[int]]]:
        rows, cols = self._matrix(shape, where, 2)
        if self.get(storage, "block", where) != FP4_BLOCK or type(storage["block"]) is not int:
            raise self.error(f"{where}.block", storage["block"], str(FP4_BLOCK))
        if cols % FP4_BLOCK:
            raise KadaptError(f"{self.source}: {where}: {cols} inputs do not split into FP4 blocks of 32")
        return {
            "weight": ("int8", [rows, cols // 2]),
            "scale": (self._scale_dtype(storage, where), [rows, cols // FP4_BLOCK]),
        }

    def _mxfp4(self, storage: Any, where: str, shape: list[int]) -> dict[str, tuple[str, list[int]]]:
        experts, cols, rows = self._matrix(shape, where, 3)
        if self.get(storage, "block", where) != MXFP4_BLOCK or type(storage["block"]) is not int:
            raise self.error(f"{where}.block", storage["block"], str(MXFP4_BLOCK))
        if cols % MXFP4_BLOCK:
            raise KadaptError(f"{self.source}: {where}: {cols} inputs do not split into MXFP4 blocks of 32")
        blocks = cols // MXFP4_BLOCK
        return {
            "blocks": ("uint8", [experts, rows, blocks, MXFP4_BLOCK // 2]),
            "scales": ("uint8", [experts, rows, blocks]),
        }
