"""Plan's inventory of the parts of DeepSeek-V4's layers that are not q/k/v/o attention or a top-k router.

``AttentionForm`` (``structure/attention_form.py``): the low-rank query (``q_a_proj``, its norm,
``q_b_proj``), the one KV head read as key and value (``kv_proj``, its norm), the grouped low-rank output
(``o_a_proj``: ``o_groups`` blocks of ``heads x head_dim / o_groups`` -> ``o_lora_rank``, stored as one
``[o_groups x o_lora_rank, heads x head_dim / o_groups]`` weight; ``o_b_proj`` mixes them back) and one
float32 sink logit per head, under transformers 5.24's ``DeepseekV4Attention`` names. A hash-routed MoE
layer (``Moe.hash_layers``) keeps its ``tid2eid`` table ``[vocab, top_k]`` (int64) beside the router's
weight and no correction bias. A compressed (``hca``) layer's compressor (``Compressor``) keeps its own
``kv_proj`` and ``gate_proj`` (``head_dim x hidden`` each), a float32 ``position_bias`` ``[rate, head_dim]``
and a float32 ``kv_norm`` (transformers 5.24 keeps both in float32). Shards as ``params`` says: query and
output split by heads (``tp``), the shared KV head, the compressor and the query's latent replicated.
"""

from __future__ import annotations

from ....structure.model import Attention, ModelStructure
from .layer_parts import LayerParts

Tensors = list[tuple[str, tuple[int, ...]]]
Rows = list[tuple[str, Tensors, str, bool]]


def form_attention(s: ModelStructure, a: Attention, parts: LayerParts) -> Rows:
    """The attention rows of a layer of ``a.form`` (``params._attention``'s row form: name, tensors,
    shard, whether a quantization mode may touch it)."""
    f, h, attn = a.form, s.hidden_size, parts.attention
    assert f is not None
    width = a.num_heads * a.head_dim
    rows: Rows = [
        ("q_a_proj", [(f"{attn}.q_a_proj.weight", (f.q_lora_rank, h))], "replicated", True),
        ("q_a_norm", [(f"{attn}.q_a_norm.weight", (f.q_lora_rank,))], "replicated", False),
        ("q_b_proj", [(f"{attn}.q_b_proj.weight", (width, f.q_lora_rank))], "tp", True),
        ("kv_proj", [(f"{attn}.kv_proj.weight", (a.head_dim, h))], "replicated", True),
        ("kv_norm", [(f"{attn}.kv_norm.weight", (a.head_dim,))], "replicated", False),
        (
            "o_a_proj",
            [(f"{attn}.o_a_proj.weight", (f.o_groups * f.o_lora_rank, width // f.o_groups))],
            "tp",
            True,
        ),
        ("o_b_proj", [(f"{attn}.o_b_proj.weight", (h, f.o_groups * f.o_lora_rank))], "tp", True),
    ]
    if f.sinks:
        rows.append(("sinks", [(f"{attn}.sinks", (a.num_heads,))], "tp", False))
    rows.append(("layer_norms", [(f"{norm}.weight", (h,)) for norm in parts.norms], "replicated", False))
    return rows


def hash_router_rows(s: ModelStructure, parts: LayerParts) -> Rows:
    """A hash-routed layer's token -> experts table (beside the router weight every MoE layer has)."""
    assert s.moe is not None
    router = parts.router or "gate"
    return [
        (
            "tid2eid",
            [(f"{parts.moe_block}.{router}.tid2eid", (s.vocab_size, s.moe.top_k))],
            "replicated",
            False,
        )
    ]


# The plan group label of each compressed kind's compressor tensors
COMPRESSOR_LABELS = {"hca": "compressor", "csa": "csa_compressor"}


def compressor_rows(
    s: ModelStructure, parts: LayerParts, kind: str = "hca"
) -> list[tuple[str, Tensors, str, str, bool]]:
    """The compressed layers' compressor tensors of ``kind``: ``(name, tensors, shard, dtype, linear)``.
    A csa compressor projects two series (``2 x head_dim``) and carries its Lightning indexer: a
    compressor of its own of the indexer's key width, the query projection from the attention's low-rank
    query residual and the per-head score weights (transformers keeps the biases and norms float32)."""
    c, h, attn = s.compressors[kind], s.hidden_size, f"{parts.attention}.compressor"
    rows = _compressor(attn, c.overlap * c.head_dim, c.head_dim, c.rate, h, "")
    if c.indexer is None:
        return rows
    i, index = c.indexer, f"{attn}.indexer"
    rows += _compressor(index, c.overlap * i.head_dim, i.head_dim, c.rate, h, "indexer.")
    form = s.attention.form  # the indexer's queries come from the attention's low-rank query residual
    q_rank = (form.q_lora_rank if form is not None else None) or s.attention.q_lora_rank or h
    rows.append(
        (
            "indexer.q_b_proj",
            [(f"{index}.q_b_proj.weight", (i.n_heads * i.head_dim, q_rank))],
            "replicated",
            "bf16",
            True,
        )
    )
    rows.append(
        (
            "indexer.weights_proj",
            [(f"{index}.scorer.weights_proj.weight", (i.n_heads, h))],
            "replicated",
            "bf16",
            True,
        )
    )
    return rows


def _compressor(
    path: str, width: int, head_dim: int, rate: int, hidden: int, label: str
) -> list[tuple[str, Tensors, str, str, bool]]:
    """One compressor's projections (``width`` wide: its series), float32 position bias and norm."""
    projections = [(f"{path}.{name}.weight", (width, hidden)) for name in ("kv_proj", "gate_proj")]
    return [
        (f"{label}projections", projections, "replicated", "bf16", True),
        (f"{label}position_bias", [(f"{path}.position_bias", (rate, width))], "replicated", "fp32", False),
        (f"{label}kv_norm", [(f"{path}.kv_norm.weight", (head_dim,))], "replicated", "fp32", False),
    ]
