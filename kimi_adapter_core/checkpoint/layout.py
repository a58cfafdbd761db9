"""Which checkpoint tensors make each graph weight, and how they are combined.

A graph reads the model's parameters; the checkpoint on disk may store them differently. transformers
v5 fuses per-expert tensors when it loads (``experts.E.gate_proj.weight`` + ``experts.E.up_proj.weight``
for every E become one ``experts.gate_up_proj``) through ``WeightConverter`` entries of its conversion
mapping. This module reads those converters - the code ``from_pretrained`` runs, not a copy of it -
and turns each into data: the checkpoint names of every source tensor, in load order, and the ops
(``stack``, ``concat``, ``transpose``) that rebuild the graph weight from them. Converters also go the
other way, one checkpoint tensor into several weights (Kimi-K2.5's vision ``wqkv`` is chunked into
``q_proj``/``k_proj``/``v_proj``, q and k permuted from interleaved to half-split rope order): those
become ``chunk`` (which equal part of the source), ``split`` (which part, of the sizes transformers'
``Split`` reads from the model's target parameters: Sarvam-MoE's ``query_key_value`` into GQA-sized
q, k, v) and ``permute_for_rope`` ops. Concatenated sources may differ in size (OLMo-Hybrid's q, k, v
convolutions): each gets the size ``save_pretrained`` writes, the part ``torch.chunk`` cuts from the
weight in transformers' reverse op (``Chunk``). Checkpoint names are the model path after the spec's
``weight_renames`` when the spec states them (it describes the checkpoint it targets), else the name
transformers' ``save_pretrained`` writes: its loading renamings reversed (Mixtral's ``mlp.experts`` is
``block_sparse_moe.experts`` on disk). Source patterns written as regexes (Kimi-Linear's
``\\.experts.*.w1.weight``) are read with their escaped dots as dots. Each name (of a numbered group:
the first and the last) is then checked against transformers' own loading rename
(``rename_source_key``), so a name that would not load is an error here.

Why the spec's renames win: for Kimi-K2.5 the reversed mapping writes ``language_model.model.blocks.N``
(a vision-tower rename leaks into the text model), a name the published checkpoint does not have;
loading accepts both, so the spec names the published layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import KadaptError
from .naming import rename_weight
from .tensors import TensorType

# ops transformers applies when loading, and how kadapt's weight map spells them
_STACK, _CONCAT, _TRANSPOSE = "MergeModulelist", "Concatenate", "Transpose"
_CHUNK, _SPLIT, _ROPE = "Chunk", "Split", "PermuteForRope"


@dataclass(frozen=True)
class SourceGroup:
    """Checkpoint tensors of one source pattern (one per expert, or a single tensor)."""

    pattern: str  # transformers' source pattern ("mlp.experts.*.gate_proj.weight"), "" for a plain tensor
    tensors: tuple[str, ...]  # checkpoint names, in the order the ops consume them
    shape: tuple[int, ...]  # shape of each tensor, as the graph computes with it (before any packing)


@dataclass(frozen=True)
class CheckpointSource:
    """How one graph weight is rebuilt from the checkpoint."""

    groups: tuple[SourceGroup, ...]
    ops: tuple[dict[str, Any], ...]  # applied in order; see weight_loader.combine
    linear: bool  # the sources are ``nn.Linear`` weights (what a quantization ``targets: [Linear]`` selects)
    # the base model's name of a plain source where transformers' renamings give it another than its
    # name without the prefix (DeepSeek-V4's ``embed.weight`` for ``model.embed_tokens.weight``: a rename
    # anchored at the base model's names), which transformers' loader accepts as well
    alias: str | None = None

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(name for group in self.groups for name in group.tensors)


def _converters(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' loading conversions for ``model`` (renamings, converters), as loading uses them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    transforms = [
        t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)
    ]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def _renamed(name: str, renamings: list[Any]) -> str:
    """``name`` through each of transformers' ``renamings`` in turn."""
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    return name


def loading_renamer(model: nn.Module) -> Callable[[str], str]:
    """Checkpoint name -> the name transformers' loading renamings give it (its converters, which fuse
    tensors, are not applied: per-expert names stay per expert)."""
    renamings = _converters(model)[0]
    return lambda name: _renamed(name, renamings)


def _targets(converter: Any) -> list[str]:
    """A converter's target patterns without the dots some families write around them (Mixtral's
    ``.experts.gate_up_proj``)."""
    return [target.strip(".") for target in converter.target_patterns]


@dataclass(frozen=True)
class _Target:
    """Where a graph weight sits in a converter's output: ``prefix + targets[index] + suffix``."""

    prefix: str
    index: int
    suffix: str  # "" when the target names the tensor itself; ".weight"/".bias" when it names a module


def _target_match(converter: Any, path: str) -> _Target | None:
    """How ``path`` is one of ``converter``'s targets, else None.

    A many-to-one converter names the tensor (``mlp.experts.gate_up_proj``); a one-to-many one names
    modules whose every tensor it produces (``attn.q_proj`` for its weight and bias).
    """
    targets = _targets(converter)
    for index, target in enumerate(targets):
        if path.endswith("." + target):
            prefix, suffix = path[: -len(target)], ""
        elif len(targets) > 1 and f".{target}." in path:
            head, _, leaf = path.rpartition(".")
            if not head.endswith("." + target):
                continue
            prefix, suffix = head[: -len(target)], "." + leaf
        else:
            continue
        scope = converter.scope_prefix
        if scope and not (prefix.startswith(scope + ".") or f".{scope}." in f".{prefix}"):
            continue
        return _Target(prefix, index, suffix)
    return None


def _split_sizes(model: nn.Module, converter: Any, target: _Target, dim: int, where: str) -> list[int]:
    """The part sizes transformers' ``Split`` cuts on ``dim``: each target parameter's size there, read
    from the model as ``Split.convert`` reads it."""
    sizes = []
    for name in _targets(converter):
        path = target.prefix + name + target.suffix
        try:
            sizes.append(int(model.get_parameter(path).shape[dim]))
        except (AttributeError, IndexError) as exc:
            raise KadaptError(
                f"weight map: transformers splits the source of {where} into {path}, "
                f"which has no size on dim {dim} in the model ({exc})"
            ) from exc
    return sizes


def _op(op: Any, where: str, converter: Any, target: _Target, model: nn.Module) -> dict[str, Any] | None:
    """One converter op as weight-map data (None: an op that leaves this target untouched)."""
    kind = type(op).__name__
    if kind == _STACK:
        return {"op": "stack", "dim": op.dim}
    if kind == _CONCAT:
        return {"op": "concat", "dim": op.dim}
    if kind == _TRANSPOSE and not op.check_dims:
        return {"op": "transpose", "dims": [op.dim0, op.dim1]}
    if kind == _CHUNK and op.num_shards_attribute is None:
        chunks = len(converter.target_patterns)
        return {"op": "chunk", "dim": op.dim, "chunks": chunks, "index": target.index}
    if kind == _SPLIT:
        sizes = _split_sizes(model, converter, target, op.dim, where)
        return {"op": "split", "dim": op.dim, "sizes": sizes, "index": target.index}
    if kind == _ROPE:
        name = converter.target_patterns[target.index]
        if op.permute_layer_names is not None and not any(n in name for n in op.permute_layer_names):
            return None
        config = model.config
        sub = getattr(config, op.subconfig_key, config) if op.subconfig_key else config
        return {
            "op": "permute_for_rope",
            "heads": int(getattr(sub, "num_attention_heads", 1)),
            "inverse": op.inverse,
        }
    raise KadaptError(
        f"weight map: transformers loads {where} with {kind}, which the weight map cannot describe "
        "(supported: MergeModulelist, Concatenate, Transpose, Chunk, Split, PermuteForRope)"
    )


def _concat_parts(shape: tuple[int, ...], dims: list[int], dim: int, groups: int) -> list[list[int]]:
    """The ``groups`` source shapes a concatenation on ``dim`` of ``dims`` is made of, as
    ``save_pretrained`` writes them: transformers' reverse op (``Chunk``) cuts with ``torch.chunk``, equal
    parts when the size divides, else equal parts and a smaller last one."""
    parts = [list(p.shape) for p in torch.empty(dims, device="meta").chunk(groups, dim)]
    if len(parts) != groups:
        raise KadaptError(
            f"weight map: {shape} does not split into {groups} parts on dim {dim} "
            f"(torch.chunk, which transformers saves them with, makes {len(parts)})"
        )
    return parts


def _undo(dims: list[int], op: dict[str, Any], shape: tuple[int, ...]) -> None:
    """``dims`` (one tensor's shape after ``op``) turned into its shape before ``op``, in place."""
    kind = op["op"]
    if kind == "stack":
        del dims[op["dim"]]
    elif kind == "chunk":
        dims[op["dim"]] *= op["chunks"]
    elif kind == "split":
        part = op["sizes"][op["index"]]
        if dims[op["dim"]] != part:
            raise KadaptError(
                f"weight map: the graph reads {shape}, transformers' Split makes part {op['index']} "
                f"{part} long on dim {op['dim']}"
            )
        dims[op["dim"]] = sum(op["sizes"])
    elif kind == "transpose":
        a, b = op["dims"]
        dims[a], dims[b] = dims[b], dims[a]


def _source_shapes(shape: tuple[int, ...], ops: list[dict[str, Any]], groups: int) -> list[tuple[int, ...]]:
    """Each source group's tensor shape: ``shape`` with the ops undone, last op first."""
    shapes = [list(shape)]
    for op in reversed(ops):
        if op["op"] == "concat":
            if len(shapes) != 1:
                raise KadaptError(f"weight map: transformers concatenates {shape} twice")
            shapes = _concat_parts(shape, shapes[0], op["dim"], groups)
        else:
            for dims in shapes:
                _undo(dims, op, shape)
    if len(shapes) == 1:
        shapes *= groups
    return [tuple(dims) for dims in shapes]


def _expand(prefix: str, pattern: str, count: int | None) -> tuple[str, ...]:
    """Concrete names of ``pattern`` (escaped dots read as dots, dots around it dropped, as for
    ``_targets``) under ``prefix``: ``*`` numbered 0..count-1."""
    pattern = pattern.replace(r"\.", ".").strip(".")
    if re.search(r"[\\()\[\]|?+^$]", pattern):
        raise KadaptError(f"weight map: cannot expand transformers source pattern {pattern!r} into names")
    if "*" not in pattern:
        return (prefix + pattern,)
    if count is None:
        raise KadaptError(f"weight map: source pattern {pattern!r} is numbered but no op stacks it")
    return tuple(prefix + pattern.replace("*", str(i)) for i in range(count))


def _checkpoint_namer(renamings: list[Any], renames: tuple[tuple[str, str], ...]) -> Callable[[str], str]:
    """Model path -> checkpoint name: the spec's ``weight_renames``, else ``save_pretrained``'s names
    (transformers' loading renamings reversed, last first, as ``revert_weight_conversion`` does)."""
    if renames or not renamings:
        return lambda path: rename_weight(path, renames)
    reverse = [renaming.reverse_transform() for renaming in renamings[::-1]]
    return lambda path: _renamed(path, reverse)


def _alias_namer(
    renamings: list[Any], renames: tuple[tuple[str, str], ...], prefix: str
) -> Callable[[str, str], str | None]:
    """``(model path, its checkpoint name)`` -> the base model's checkpoint name of that tensor (the
    path without ``prefix``, renamings reversed) where it is not simply the name without the prefix;
    None otherwise, or under the spec's ``weight_renames`` (they state the names)."""
    if renames or not renamings or not prefix:
        return lambda path, name: None
    reverse = [renaming.reverse_transform() for renaming in renamings[::-1]]
    head = prefix + "."

    def alias(path: str, name: str) -> str | None:
        if not path.startswith(head):
            return None
        base = _renamed(path.removeprefix(head), reverse)
        return None if base in (name, name.removeprefix(head)) else base

    return alias


def _is_linear_weight(model: nn.Module, path: str) -> bool:
    owner, _, leaf = path.rpartition(".")
    return leaf == "weight" and isinstance(model.get_submodule(owner), nn.Linear)


def _checked_names(source: CheckpointSource) -> list[str]:
    """The names checked against transformers' loading rename: every plain tensor, and the first and
    last of each numbered group (its names differ only in the expert number; checking all 384 experts
    of 60 layers would be ~70,000 rename calls, a second of the main job, for no extra information)."""
    return [name for group in source.groups for name in dict.fromkeys((group.tensors[0], group.tensors[-1]))]


def _loads_as(
    name: str, renamings: list[Any], converters: list[Any], model: nn.Module, meta_state: dict[str, bool]
) -> str:
    """The model path transformers' loader reads checkpoint tensor ``name`` into."""
    from transformers.core_model_loading import rename_source_key

    loaded, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, meta_state)
    if loaded not in meta_state and name in meta_state:  # the loader keeps the model's own name
        loaded = name  # (upstream.LOADER_KEEPS_OWN_NAMES: DeepSeek-V4's final norm.weight)
    return loaded


def checkpoint_sources(
    model: nn.Module, weights: dict[str, TensorType], renames: tuple[tuple[str, str], ...]
) -> dict[str, CheckpointSource]:
    """For every model path in ``weights``, the checkpoint tensors and ops that rebuild it.

    Each checkpoint name is the expanded source under the spec's ``weight_renames``, checked to load
    back into that very path through transformers' own renamings and converters.
    """
    renamings, converters = _converters(model)
    checkpoint_name = _checkpoint_namer(renamings, renames)
    alias_of = _alias_namer(renamings, renames, model.base_model_prefix)
    meta_state = dict.fromkeys(weights, True)
    out: dict[str, CheckpointSource] = {}
    for path, tensor in weights.items():
        converter, target = None, None
        for candidate in converters:
            target = _target_match(candidate, path)
            if target is not None:
                converter = candidate
                break
        loads_as = path
        if converter is None or target is None:
            name = checkpoint_name(path)
            alias = alias_of(path, name)
            if alias is not None and _loads_as(alias, renamings, converters, model, meta_state) != path:
                alias = None  # only a name transformers' loader reads into this very path
            source = CheckpointSource(
                (SourceGroup("", (name,), tuple(tensor.shape)),), (), _is_linear_weight(model, path), alias
            )
        else:
            ops = [d for op in converter.operations if (d := _op(op, path, converter, target, model))]
            stack = next((op["dim"] for op in ops if op["op"] == "stack"), None)
            patterns = list(converter._original_source_patterns)
            shapes = _source_shapes(tuple(tensor.shape), ops, len(patterns))
            count = tensor.shape[stack] if stack is not None else None
            groups = tuple(
                SourceGroup(
                    pattern,
                    tuple(
                        checkpoint_name(name + target.suffix)
                        for name in _expand(target.prefix, pattern, count)
                    ),
                    shape,
                )
                for pattern, shape in zip(patterns, shapes, strict=True)
            )
            linear = all(len(shape) == 2 for shape in shapes) and (
                stack is not None or _is_linear_weight(model, path)
            )
            source = CheckpointSource(groups, tuple(ops), linear=linear)
            # a one-to-many converter renames its source to the first target; its ops make the others
            loads_as = target.prefix + _targets(converter)[0] + target.suffix
        for name in _checked_names(source):
            loaded = _loads_as(name, renamings, converters, model, meta_state)
            if loaded != loads_as:
                raise KadaptError(
                    f"weight map: checkpoint tensor {name} (from {path}) would load into {loaded}, "
                    f"not {path}: fix backends.extraction.weight_renames"
                )
        out[path] = source
    return out
