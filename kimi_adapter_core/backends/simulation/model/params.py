"""Analytic parameter inventory: every weight tensor family of the model, counted from its structure.

Counting from the ``ModelStructure`` (instead of instantiating the model) keeps ``kadapt plan``
torch-free and instant, and works for every family the structure describes: MHA/GQA/MQA or MLA
attention, dense and MoE MLPs (shared experts, a router bias for sigmoid routing), tied embeddings,
and hybrid stacks: attention weights in the attention layers only, the mixer's weights in the linear
ones (``mixer_params.LINEAR_TENSORS``; the attention of the
gated-DeltaNet families is gated: ``_gated_attention``),
and a DSA stack's indexer in its indexed layers (``_indexer``).

Each group carries what sizing needs: how it is sharded, its native dtype, whether it is a linear
weight a quantization mode may touch, the shape of each tensor (the checkpoint's storage rule reads it:
``quant.checkpoint_policy``), and the checkpoint names of its tensors - the model's own
parameter names (``module_paths`` + the names inside a decoder layer: transformers' conventional
``self_attn.q_proj``, ``mlp.experts.gate_up_proj``, ..., or the family's own from ``layer_parts``)
after the spec's ``backends.extraction.weight_renames``, i.e. what the extraction backend writes and
what the spec's ``quantization[].modules`` globs match. Sizes that the structure does not carry and
that do not matter for sizing (q/k norms, attention and expert biases, gpt-oss's attention sinks: 0.03% of
gpt-oss-120b; an MTP block the model class does not build) are not counted; see ``docs/cost_model.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from ....checkpoint.naming import rename_weight
from ....spec.model import Spec
from ....structure.model import CORRECTED_SCORINGS, Attention, ModelStructure
from ....structure.residual_streams import STREAM_HEAD
from ....vision.tower import VisionArch
from .arch import Architecture, indexed_layer_ids
from .embedding_params import embedding_tensors
from .form_params import COMPRESSOR_LABELS, compressor_rows, form_attention, hash_router_rows
from .layer_parts import FP32_ROUTER, LayerParts, shared_expert, sublayers
from .mixer_params import LINEAR_TENSORS, Shard, Tensors
from .shared_block_params import BlockGroup, shared_block_groups
from .stream_params import stream_connections, stream_head_shapes


@dataclass(frozen=True)
class ParamGroup:
    """One tensor family: the same tensors in each of ``instances`` layers (or once for the model)."""

    name: str  # short label for tables
    checkpoint_names: tuple[tuple[str, ...], ...]  # per instance, the checkpoint name of each tensor
    tensor_shapes: tuple[tuple[int, ...], ...]  # shape of each of those tensors in one instance
    shard: Shard
    dtype: str  # native dtype: bf16 | fp32
    linear: bool  # a linear weight that a --quant mode re-formats
    # a "kv"-sharded group's attention, whose KV heads it splits by: a per-layer shape's differ from the
    # stack's (MiMo-V2-Flash's sliding layers), and TP replicates each shape's heads past their own count
    attention: Attention | None = None

    @property
    def tensor_params(self) -> tuple[int, ...]:
        """Parameters of each tensor in one instance."""
        return tuple(math.prod(shape) for shape in self.tensor_shapes)

    @property
    def is_vision(self) -> bool:
        """A group of the vision tower or its projector (not the text model)."""
        return self.name.startswith(("vision", "projector"))

    @property
    def per_instance(self) -> int:
        return sum(self.tensor_params)

    @property
    def instances(self) -> int:
        return len(self.checkpoint_names)

    @property
    def count(self) -> int:
        return self.per_instance * self.instances

    @property
    def checkpoint_name(self) -> str:
        """A representative name: the first tensor of the first instance."""
        return self.checkpoint_names[0][0]

    def tensors(self) -> Iterator[tuple[str, int]]:
        """``(checkpoint name, parameters)`` of every tensor of every instance."""
        for names in self.checkpoint_names:
            yield from zip(names, self.tensor_params, strict=True)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of the tensor called ``name`` (a checkpoint name of this group)."""
        return self._shapes[name]

    @functools.cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape, built once: a search per name was quadratic in the layers (a
        10,000-layer config took minutes to plan)."""
        shapes = self.tensor_shapes
        pairs = (zip(names, shapes, strict=True) for names in self.checkpoint_names)
        return {name: shape for pair in pairs for name, shape in pair}


@dataclass(frozen=True)
class Naming:
    """Where the text model's tensors live in the built model, and how the checkpoint renames them."""

    language_model: str
    layers: str
    lm_head: str
    renames: tuple[tuple[str, str], ...]
    router: str = "gate"  # the MoE block's router attribute (gpt-oss: ``router``; moe.field_renames.gate)
    embeddings: str = "embed_tokens"  # the stack's token embedding and final norm (``module_paths``)
    final_norm: str | None = "norm"  # None: the stack applies none (``final_norm: null``)
    # the stack's learned absolute position table and its norm over the embeddings (None: none)
    position_embeddings: str | None = None
    embedding_norm: str | None = None

    def checkpoint(self, path: str) -> str:
        """The checkpoint's name of model tensor ``path`` (the extraction backend's rule)."""
        return rename_weight(path, self.renames)


def naming(spec: Spec) -> Naming:
    renames = spec.backend_options("extraction").get("weight_renames") or ()
    paths, parts = spec.module_paths, spec.stack_parts()
    return Naming(
        paths["language_model"],
        paths["language_layers"],
        paths["lm_head"],
        tuple((r["from"], r["to"]) for r in renames),
        ((spec.moe or {}).get("field_renames") or {}).get("gate", "gate"),
        str(parts.path("embeddings")),
        parts.path("final_norm"),
        parts.path("position_embeddings"),
        parts.path("embedding_norm"),
    )


def _layers(
    n: Naming, name: str, layers: Sequence[int], tensors: Tensors, shard: Shard, dtype: str, linear: bool
) -> ParamGroup:
    names = tuple(tuple(n.checkpoint(f"{n.layers}.{i}.{suffix}") for suffix, _ in tensors) for i in layers)
    return ParamGroup(name, names, tuple(shape for _, shape in tensors), shard, dtype, linear)


def _model(n: Naming, name: str, path: str, shape: tuple[int, ...], shard: Shard) -> ParamGroup:
    return ParamGroup(name, ((n.checkpoint(path),),), (shape,), shard, "bf16", False)


def _gated_attention(s: ModelStructure) -> bool:
    """Whether the attention layers are those of a gated-DeltaNet hybrid (Qwen3-Next, Qwen3.5,
    Qwen3.5-MoE): every one of them folds a sigmoid output gate into ``q_proj`` (twice the query rows)
    and normalizes each query and key head (``q_norm``, ``k_norm``). The structure does not carry
    these two facts; these families are the only ones with a gated-DeltaNet mixer, and all their
    attention classes build both (transformers 5.24 ``Qwen3NextAttention``, ``Qwen3_5Attention``)."""
    return s.linear is not None and s.linear.kind == "gated_delta_net"


def _attention_shapes(s: ModelStructure) -> list[tuple[Attention, tuple[int, ...], str]]:
    """The attention layers grouped by their shape: ``(attention, layer ids, group label)``, the stack's
    first with no label (its groups keep their names), then each per-layer shape labelled by its KV
    heads and widths (``.8x192``: MiMo-V2-Flash's sliding layers). A stack with no attention layer
    still gets the stack's (its layer norms are every layer's)."""
    by_shape: dict[Attention, list[int]] = {s.attention: []}
    for index in s.attention_layer_ids:
        by_shape.setdefault(s.layer_attention(index), []).append(index)
    return [
        (a, tuple(ids), "" if a == s.attention else f".{a.num_kv_heads}x{a.head_dim}")
        for a, ids in by_shape.items()
        if ids or a == s.attention
    ]


def _attention(s: ModelStructure, a: Attention) -> list[tuple[str, Tensors, Shard, bool]]:
    """Attention tensors of an attention layer (the last row, the two layer norms, is every layer's).
    MLA: q_a/kv_a project to shared latents and are replicated under TP (as vLLM/SGLang do); q_b/kv_b
    are column-parallel and o_proj row-parallel (split by heads). MHA/GQA/MQA: q and o split by heads;
    k and v by KV heads (replicated once TP exceeds them); a gated attention's q_proj holds the gate
    too, and its per-head q/k norms are replicated. ``a`` is the attention of the layers sized (the
    stack's, or a per-layer shape's)."""
    h, parts = s.hidden_size, sublayers(s)
    heads = a.num_heads
    if a.form is not None:  # DeepSeek-V4's shared-KV attention, its output and norms (form_params)
        return form_attention(s, a, parts)  # type: ignore[return-value]
    rows: list[tuple[str, Tensors, Shard, bool]] = []
    if a.is_mla:
        assert a.kv_lora_rank is not None and a.qk_nope_head_dim is not None
        if a.q_lora_rank:
            rows += [
                ("q_a_proj", [("self_attn.q_a_proj.weight", (a.q_lora_rank, h))], "replicated", True),
                (
                    "q_a_layernorm",
                    [("self_attn.q_a_layernorm.weight", (a.q_lora_rank,))],
                    "replicated",
                    False,
                ),
                (
                    "q_b_proj",
                    [("self_attn.q_b_proj.weight", (heads * a.head_dim, a.q_lora_rank))],
                    "tp",
                    True,
                ),
            ]
        else:
            rows.append(("q_proj", [("self_attn.q_proj.weight", (heads * a.head_dim, h))], "tp", True))
        latent = a.kv_elements("latent")
        kv_b = (heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)
        rows += [
            (
                "kv_a_proj_with_mqa",
                [("self_attn.kv_a_proj_with_mqa.weight", (latent, h))],
                "replicated",
                True,
            ),
            ("kv_a_layernorm", [("self_attn.kv_a_layernorm.weight", (a.kv_lora_rank,))], "replicated", False),
            ("kv_b_proj", [("self_attn.kv_b_proj.weight", kv_b)], "tp", True),
        ]
    else:
        rows += _qkv(s, a, parts)
    if parts.output_gate:  # one gate per output element, split by heads like the output
        gate = f"{parts.attention}.{parts.output_gate}.weight"
        rows.append(("output_gate", [(gate, (heads * a.v_head_dim, h))], "tp", True))
    o_proj = f"{parts.attention}.{parts.o_proj}.weight"
    rows.append(("o_proj", [(o_proj, (h, heads * a.v_head_dim))], "tp", True))
    if parts.norms:  # none when the layer's norms hold no weight (OLMo's LayerNorm)
        norms: Tensors = [(f"{norm}.weight", (h,)) for norm in parts.norms]
        rows.append(("layer_norms", norms, "replicated", False))
    return rows


def _qkv(s: ModelStructure, a: Attention, parts: LayerParts) -> list[tuple[str, Tensors, Shard, bool]]:
    """MHA/GQA/MQA query, key and value projections: three, split by heads and by KV heads, or one
    fused projection where the family fuses them (Phi-3's ``qkv_proj``), split by heads; a gated
    attention's q_proj holds the output gate too, and its per-head q/k norms are replicated."""
    h, attn, qkv = s.hidden_size, parts.attention, parts.qkv
    kv, gated = a.num_kv_heads, _gated_attention(s)
    q_rows = a.num_heads * a.head_dim * (2 if gated else 1)  # query and output gate
    if qkv is not None:
        fused = q_rows + kv * (a.head_dim + a.v_head_dim)
        return [(qkv, [(f"{attn}.{qkv}.weight", (fused, h))], "tp", True)]
    rows: list[tuple[str, Tensors, Shard, bool]] = [
        ("q_proj", [(f"{attn}.q_proj.weight", (q_rows, h))], "tp", True),
        ("k_proj", [(f"{attn}.k_proj.weight", (kv * a.head_dim, h))], "kv", True),
    ]
    if not a.value_from_key:  # else the values are the key projection's output: no v_proj
        rows.append(("v_proj", [(f"{attn}.v_proj.weight", (kv * a.v_head_dim, h))], "kv", True))
    if gated:
        qk_norms: Tensors = [(f"{attn}.{qk}_norm.weight", (a.head_dim,)) for qk in ("q", "k")]
        rows.append(("qk_norms", qk_norms, "replicated", False))
    return rows


def _indexer(s: ModelStructure) -> list[tuple[str, Tensors, Shard, bool]]:
    """Tensors of a DSA layer's indexer under transformers' names (5.24 ``DeepseekV32Indexer``): ``wq_b``
    from the MLA's query residual to every indexer head, ``wk`` to the one shared key, the key's
    LayerNorm (weight and bias) and ``weights_proj`` to one weight per head. All replicated: vLLM and
    SGLang build the indexer of ``ReplicatedLinear``s ("no tensor parallel, just replicated"). ``wq_b``
    and ``wk`` are linear weights a checkpoint's FP8 blocks cover; ``weights_proj`` is not (DeepSeek's
    inference code builds it in the model dtype, vLLM loads it with no quant config)."""
    ix, a, h = s.indexer, s.attention, s.hidden_size
    assert ix is not None and a.q_lora_rank
    proj: Tensors = [
        ("self_attn.indexer.wq_b.weight", (ix.n_heads * ix.head_dim, a.q_lora_rank)),
        ("self_attn.indexer.wk.weight", (ix.head_dim, h)),
    ]
    norm: Tensors = [
        ("self_attn.indexer.k_norm.weight", (ix.head_dim,)),
        ("self_attn.indexer.k_norm.bias", (ix.head_dim,)),
    ]
    weights: Tensors = [("self_attn.indexer.weights_proj.weight", (ix.n_heads, h))]
    return [
        ("indexer_proj", proj, "replicated", True),
        ("indexer_k_norm", norm, "replicated", False),
        ("indexer_weights_proj", weights, "replicated", False),
    ]


# gated-DeltaNet families whose input projection is fused as in_proj_qkvz + in_proj_ba (the others,
# Qwen3.5's, split it as in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)


# rows of each MLP projection role (``layer_parts.LayerParts``), in widths
_ROLE_ROWS = {"gate": 1, "up": 1, "gate_up": 2}


def _mlp(prefix: str, hidden: int, width: int, roles: Mapping[str, str]) -> Tensors:
    """An MLP's projections under the family's names (``prefix`` "": the layer's own, OPT's): each input
    projection (gate and up, fused gate_up, or up alone) from ``hidden`` to ``width`` rows, then down."""
    ins = [(roles[r], n * width) for r, n in _ROLE_ROWS.items() if r in roles]
    at = f"{prefix}." if prefix else ""
    inputs: Tensors = [(f"{at}{name}.weight", (rows, hidden)) for name, rows in ins]
    return [*inputs, (f"{at}{roles['down']}.weight", (hidden, width))]


def text_groups(s: ModelStructure, n: Naming) -> list[ParamGroup]:
    h, vocab = s.hidden_size, s.vocab_size
    parts = sublayers(s)
    groups = [_model(n, "embed_tokens", f"{n.language_model}.{n.embeddings}.weight", (vocab, h), "vocab")]
    if parts.final_norm and n.final_norm is not None:  # none holding a weight (OLMo's LayerNorm)
        final = f"{n.language_model}.{n.final_norm}.weight"
        groups.append(_model(n, "final_norm", final, (h,), "replicated"))
    if not s.tie_word_embeddings:
        groups.append(_model(n, "lm_head", f"{n.lm_head}.weight", (vocab, h), "vocab"))
    for role, path, shape in embedding_tensors(s, n.language_model, n.position_embeddings, n.embedding_norm):
        groups.append(_model(n, role, path, shape, "replicated"))
    if s.shared_blocks is not None:  # every decoder tensor is the mixer's or a shared block's (Zamba2)
        return groups + [_shared_block_group(s, n, g) for g in shared_block_groups(s)]
    for first, (shape, ids, label) in enumerate(_attention_shapes(s)):
        for name, tensors, shard, linear in _attention(s, shape):
            if name == "layer_norms" and first:  # every layer has both norms: counted once
                continue
            layer_ids = range(s.num_layers) if name == "layer_norms" else ids
            group = _layers(n, f"attn.{name}{label}", layer_ids, tensors, shard, "bf16", linear)
            groups.append(replace(group, attention=shape) if shard == "kv" else group)
    groups += _shared_attention_groups(s, n)
    if s.indexer is not None:
        for name, tensors, shard, linear in _indexer(s):
            groups.append(_layers(n, f"attn.{name}", indexed_layer_ids(s), tensors, shard, "bf16", linear))
    for kind in s.compressors:  # hca: attn.compressor.*, csa: attn.csa_compressor.* (its indexer's too)
        ids, label = [i for i, k in enumerate(s.layer_kinds) if k == kind], COMPRESSOR_LABELS[kind]
        for name, tensors, shard, dtype, linear in compressor_rows(s, parts, kind):
            groups.append(_layers(n, f"attn.{label}.{name}", ids, tensors, shard, dtype, linear))  # type: ignore[arg-type]
    if s.linear is not None and s.linear.kind in LINEAR_TENSORS:  # another kind: ``plan.check_priced``
        tensors_of, label = LINEAR_TENSORS[s.linear.kind]
        for name, tensors, shard, linear in tensors_of(s):
            ids = s.linear_layer_ids
            groups.append(_layers(n, f"{label}.{name}", ids, tensors, shard, "bf16", linear))
    if s.dense_layer_ids:  # by width: the stack's, then a width some layers have (Gemma-4's double-wide)
        by_width: dict[int, list[int]] = {}
        for index in s.dense_layer_ids:
            by_width.setdefault(s.layers[index].mlp_width or s.intermediate_size, []).append(index)
        for width, ids in by_width.items():
            dense = _mlp(parts.mlp, h, width, parts.dense_mlp)
            label = "" if width == s.intermediate_size else f".{width}"
            groups.append(_layers(n, f"dense_mlp{label}", ids, dense, "tp", "bf16", True))
    if s.moe is not None and s.moe_layer_ids:
        groups += _moe_groups(s, n, parts)
    if s.per_layer_inputs is not None:
        groups += _per_layer_input_groups(s, n)
    if s.residual_streams is not None:
        groups += _residual_stream_groups(s, n)
    return groups


def _shared_block_group(s: ModelStructure, n: Naming, g: BlockGroup) -> ParamGroup:
    """A shared-block stack's tensor family under the checkpoint's names; a ``kv`` one splits by the
    stack's KV heads."""
    names = tuple(tuple(n.checkpoint(f"{n.layers}.{path}") for path in paths) for paths in g.paths)
    group = ParamGroup(g.name, names, g.shapes, g.shard, "bf16", g.linear)
    return replace(group, attention=s.attention) if g.shard == "kv" else group


def _shared_attention_groups(s: ModelStructure, n: Naming) -> list[ParamGroup]:
    """The KV-sharing layers' own attention tensors (Gemma-4): their query and output projections, by
    their attention's shape; they have no key or value projection (their layer norms are every layer's)."""
    by_shape: dict[Attention, list[int]] = {}
    for index in s.shared_layer_ids:
        by_shape.setdefault(s.layer_attention(index), []).append(index)
    groups = []
    for shape, ids in by_shape.items():
        label = ".shared" + ("" if shape == s.attention else f".{shape.num_kv_heads}x{shape.head_dim}")
        for name, tensors, shard, linear in _attention(s, shape):
            if name in ("q_proj", "o_proj"):
                groups.append(_layers(n, f"attn.{name}{label}", ids, tensors, shard, "bf16", linear))
    return groups


def _per_layer_input_groups(s: ModelStructure, n: Naming) -> list[ParamGroup]:
    """Per-layer embeddings under transformers' names (5.24 ``Gemma4TextModel``): the token table
    ``[vocab, layers x width]`` (split by vocabulary like the embeddings), the projection of the input
    embeddings to every layer's input and its norm (replicated: computed once per token), and in each
    layer the gate to the input's width, the projection back and its norm."""
    ple, h, stack = s.per_layer_inputs, s.hidden_size, n.language_model
    assert ple is not None
    total = s.num_layers * ple.width
    projection = f"{stack}.per_layer_model_projection.weight"
    gates: Tensors = [
        ("per_layer_input_gate.weight", (ple.width, h)),
        ("per_layer_projection.weight", (h, ple.width)),
    ]
    everyone = range(s.num_layers)
    return [
        _model(n, "ple.embed", f"{stack}.embed_tokens_per_layer.weight", (ple.vocab, total), "vocab"),
        ParamGroup(
            "ple.projection", ((n.checkpoint(projection),),), ((total, h),), "replicated", "bf16", True
        ),
        _model(n, "ple.norm", f"{stack}.per_layer_projection_norm.weight", (ple.width,), "replicated"),
        _layers(n, "ple.gates", everyone, gates, "replicated", "bf16", True),
        _layers(
            n,
            "ple.norms",
            everyone,
            [("post_per_layer_input_norm.weight", (h,))],
            "replicated",
            "bf16",
            False,
        ),
    ]


def _residual_stream_groups(s: ModelStructure, n: Naming) -> list[ParamGroup]:
    """Hyper-connections (``stream_params``): every layer's two connections and the stack's head,
    float32 and replicated."""
    head = f"{n.language_model}.{STREAM_HEAD}"
    names = tuple(n.checkpoint(f"{head}.{name}") for name in ("hc_fn", "hc_base", "hc_scale"))
    connections = _layers(
        n, "hc.connections", range(s.num_layers), stream_connections(s), "replicated", "fp32", False
    )
    return [connections, ParamGroup("hc.head", (names,), stream_head_shapes(s), "replicated", "fp32", False)]


def _moe_groups(s: ModelStructure, n: Naming, parts: LayerParts) -> list[ParamGroup]:
    """The MoE layers' router (``FP32_ROUTER``), shared and routed experts."""
    moe, ids, h, mlp = s.moe, s.moe_layer_ids, s.hidden_size, parts.moe_block
    assert moe is not None
    experts, groups = moe.num_experts, []
    shared, shared_gate = shared_expert(s, parts)
    router: list[tuple[str, tuple[int, ...]]] = [(f"{mlp}.{parts.router or n.router}.weight", (experts, h))]
    if shared_gate and moe.shared_intermediate_size:
        router.append((f"{mlp}.{shared_gate}.weight", (1, h)))
    router_dtype = "fp32" if s.model_type in FP32_ROUTER else "bf16"
    groups.append(_layers(n, "router", ids, router, "replicated", router_dtype, False))
    if moe.scoring in CORRECTED_SCORINGS and parts.correction_bias:  # DeepSeek's noaux_tc bias, in fp32
        bias: Tensors = [(f"{mlp}.{parts.correction_bias}", (experts,))]
        biased = [i for i in ids if i not in moe.hash_layers]  # a hash-routed layer has none (form_params)
        groups.append(_layers(n, "router_bias", biased, bias, "replicated", "fp32", False))
    for name, tensors, shard, linear in hash_router_rows(s, parts) if moe.hash_layers else ():
        groups.append(_layers(n, f"router.{name}", moe.hash_layers, tensors, shard, "int64", linear))
    if moe.shared_intermediate_size:
        shared_mlp = _mlp(f"{mlp}.{shared}", h, moe.shared_intermediate_size, parts.shared_mlp)
        groups.append(_layers(n, "shared_experts", ids, shared_mlp, "tp", "bf16", True))
    width = moe.expert_intermediate_size
    routed: Tensors = [  # stacked [experts, out, in], as most transformers MoE classes hold them
        (f"{mlp}.experts.gate_up_proj", (experts, 2 * width, h))
        if parts.experts_gated
        else (f"{mlp}.experts.up_proj", (experts, width, h)),
        (f"{mlp}.experts.down_proj", (experts, h, width)),
    ]
    groups.append(_layers(n, "routed_experts", ids, routed, "ep", "bf16", True))
    return groups


def _vision(name: str, checkpoint: str, params: int, instances: int = 1) -> ParamGroup:
    """A vision group, named after its hub-layout tensor (the vision tower is not renamed);
    ``{i}`` in ``checkpoint`` is the block index. Its tensors are counted as one lump of ``params``,
    shape ``(params,)``: no storage rule quantizes a 1-D tensor, and no shipped checkpoint quantizes
    its vision tower."""
    names = tuple((checkpoint.format(i=i),) for i in range(instances))
    return ParamGroup(name, names, ((params,),), "replicated", "bf16", False)


def vision_groups(v: VisionArch) -> list[ParamGroup]:
    """MoonViT + patch-merger projector, replicated on every device (small next to the text model)."""
    h, i = v.hidden, v.intermediate
    per_layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h  # qkv+proj, fc1, fc2, 2 LayerNorms
    merged = v.mm_hidden * v.merge_h * v.merge_w
    return [
        _vision(
            "vision.patch_embed",
            "vision_tower.patch_embed.proj.weight",
            v.in_channels * v.patch_size * v.patch_size * h + h,
        ),
        _vision(
            "vision.pos_emb",
            "vision_tower.patch_embed.pos_emb.weight",
            v.pos_emb_height * v.pos_emb_width * h,
        ),
        _vision("vision.layers", "vision_tower.encoder.blocks.{i}.wqkv.weight", per_layer, v.num_layers),
        _vision("vision.final_norm", "vision_tower.encoder.final_layernorm.weight", 2 * h),
        _vision(
            "projector",
            "mm_projector.proj.0.weight",
            2 * v.mm_hidden + (merged * merged + merged) + (merged * v.text_hidden + v.text_hidden),
        ),
    ]


def param_groups(arch: Architecture, n: Naming) -> list[ParamGroup]:
    groups = text_groups(arch.structure, n)
    if arch.vision is not None:
        groups += vision_groups(arch.vision)
    return groups
