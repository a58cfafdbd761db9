"""The decoder tensors of a stack whose hybrid layers share transformer blocks (Zamba2), under the model's
own names (transformers 5.24 ``Zamba2Model``).

Every layer runs a Mamba2 mixer: ``layers.i.mamba`` in a mixer layer, ``layers.i.mamba_decoder.mamba``
in a hybrid one, each with its norm. The ``count`` shared blocks are counted once, where the model keeps
them (at the first ``count`` hybrid layers: the later hybrid layers' blocks are tied to those), with an
input ``input_width`` x hidden wide. Each hybrid layer has a projection of its own (``linear``) and
LoRA adapters of its own, kept inside the block it runs (``..._adapter_list.{j}``, ``j`` its rank among
the hybrid layers). Split from ``params.py`` (the whole inventory), which calls ``shared_block_groups``
instead of its attention and MLP groups for such a stack.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from ....structure.model import ModelStructure
from ....structure.shared_blocks import shared_blocks_rule
from .mixer_params import LINEAR_TENSORS, Shard, Tensors

# where a hybrid layer keeps what a mixer layer keeps at its top level (the block's path and its MLP's
# projections are the family's: ``shared_blocks`` ``block`` and ``mlp``)
HYBRID_MIXER = "mamba_decoder"
# rows of each MLP projection role, in widths
_ROLE_ROWS = {"gate": 1, "up": 1, "gate_up": 2}


class BlockGroup(NamedTuple):
    """One tensor family of the stack: per instance the paths of its tensors below the layer list
    (``3.mamba.in_proj.weight``), their shapes, how they shard, whether they are linear weights a
    quantization mode may touch, and whether TP splits them by KV heads (``kv``: the stack's attention)."""

    name: str
    paths: tuple[tuple[str, ...], ...]
    shapes: tuple[tuple[int, ...], ...]
    shard: Shard
    linear: bool


def shared_block_groups(s: ModelStructure) -> list[BlockGroup]:
    """Every decoder tensor of a shared-block stack: each layer's mixer and norm, each hybrid layer's
    projection and adapters, and each shared block once."""
    blocks, lin = s.shared_blocks, s.linear
    assert blocks is not None and lin is not None
    hybrid = tuple(layer.index for layer in s.layers if layer.attention == "hybrid")
    mixers = s.linear_layer_ids

    def prefix(index: int) -> str:
        return f"{HYBRID_MIXER}." if index in hybrid else ""

    tensors_of, label = LINEAR_TENSORS[lin.kind]
    groups = [
        _group(f"{label}.{name}", mixers, tensors, shard, linear, prefix)
        for name, tensors, shard, linear in tensors_of(s)
    ]
    norm: Tensors = [("input_layernorm.weight", (s.hidden_size,))]
    groups.append(_group(f"{label}.layer_norm", mixers, norm, "replicated", False, prefix))
    h = s.hidden_size
    groups.append(_group("hybrid.linear", hybrid, [("linear.weight", (h, h))], "tp", True))
    owners = hybrid[: blocks.count]  # the layers that keep the shared blocks (the rest are tied to them)
    groups += [
        _group(f"shared_block.{name}", owners, tensors, shard, shard != "replicated")
        for name, tensors, shard in _block(s)
    ]
    adapters = _adapters(s, hybrid, owners)
    return groups if adapters is None else [*groups, adapters]


def _block(s: ModelStructure) -> list[tuple[str, Tensors, Shard]]:
    """One shared block's tensors at the family's path: attention over the wide input (q and o split by
    heads, k and v by KV heads), its two norms, the gated MLP (fused gate/up or not) split over TP."""
    a, h, blocks = s.attention, s.hidden_size, s.shared_blocks
    rule = shared_blocks_rule(s.model_type)
    assert blocks is not None and rule is not None
    block, roles, width = rule["block"], rule["mlp"], s.intermediate_size
    wide, attn = blocks.input_width * h, f"{block}.self_attn"
    ins = [
        (f"{block}.feed_forward.{roles[r]}.weight", (n * width, h))
        for r, n in _ROLE_ROWS.items()
        if r in roles
    ]
    mlp: Tensors = [*ins, (f"{block}.feed_forward.{roles['down']}.weight", (h, width))]
    return [
        ("q_proj", [(f"{attn}.q_proj.weight", (a.num_heads * a.head_dim, wide))], "tp"),
        ("k_proj", [(f"{attn}.k_proj.weight", (a.num_kv_heads * a.head_dim, wide))], "kv"),
        ("v_proj", [(f"{attn}.v_proj.weight", (a.num_kv_heads * a.v_head_dim, wide))], "kv"),
        ("o_proj", [(f"{attn}.o_proj.weight", (h, a.num_heads * a.v_head_dim))], "tp"),
        (
            "norms",
            [(f"{block}.input_layernorm.weight", (wide,)), (f"{block}.pre_ff_layernorm.weight", (h,))],
            "replicated",
        ),  # fmt: skip
        ("mlp", mlp, "tp"),
    ]


def _adapters(s: ModelStructure, hybrid: Sequence[int], owners: Sequence[int]) -> BlockGroup | None:
    """Each hybrid layer's LoRA adapters (rank ``r``), in the block it runs: down to ``r`` and back up to
    the projection's rows, on gate/up and, with ``attention_adapters``, on q, k and v (each as wide as the
    block's input). Replicated: a few rank-``r`` matrices. None: the family has none (Zamba)."""
    blocks, h, rule = s.shared_blocks, s.hidden_size, shared_blocks_rule(s.model_type)
    assert blocks is not None and rule is not None
    if not blocks.adapter_rank:
        return None
    r, wide, block = blocks.adapter_rank, blocks.input_width * h, rule["block"]
    lists = [(f"{block}.feed_forward.gate_up_proj_adapter_list", h, 2 * s.intermediate_size)]
    if blocks.attention_adapters:
        lists += [(f"{block}.self_attn.linear_{p}_adapter_list", wide, wide) for p in ("q", "k", "v")]
    paths = tuple(
        tuple(
            f"{owners[j % blocks.count]}.{path}.{j}.{part}.weight" for path, _, _ in lists for part in (0, 1)
        )
        for j in range(len(hybrid))
    )
    shapes = tuple(shape for _, into, out in lists for shape in ((r, into), (out, r)))
    return BlockGroup("shared_block.adapters", paths, shapes, "replicated", True)


def _group(
    name: str,
    layers: Sequence[int],
    tensors: Tensors,
    shard: Shard,
    linear: bool,
    prefix: Callable[[int], str] = lambda _: "",
) -> BlockGroup:
    """``tensors`` in each of ``layers``, each layer's under ``prefix(layer)``."""
    paths = tuple(tuple(f"{i}.{prefix(i)}{suffix}" for suffix, _ in tensors) for i in layers)
    return BlockGroup(name, paths, tuple(shape for _, shape in tensors), shard, linear)
