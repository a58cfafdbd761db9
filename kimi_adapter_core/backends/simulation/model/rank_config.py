"""The per-rank config of the text model: which decoder layers are built, and the sizes of one rank.

Tracing every layer of a huge model for every ``simulate`` call is slow and pointless: the layers of
one kind are identical. A layer's kind is its mixer (attention, or a hybrid stack's linear attention)
and its MLP kind. So the per-rank model keeps the layers up to the first of each kind
(``layer_kinds``, ``built_layers``), each traced layer standing for its kind, and its text
sub-config is resized to ONE rank (``rank_overrides``: query and KV heads, linear-attention heads,
dense and shared-expert widths, vocab over TP; a width the family adjusts at build time, LFM2's, is written
adjusted with the adjustment switched off). The per-rank sizes are written under the config keys
the structure read each fact from (``structure.keys``), so no family's key names are assumed;
``check_sizes`` refuses a config bridge that undoes one and notes one that changes a traced size.

Separate from ``rank_model`` because it is config arithmetic (torch-free) that the vision trace
(``estimate/vision``) applies to its own build too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ....errors import KadaptError, UsageError
from ....spec.model import Spec
from ....structure.kv_sharing import shared_in_prefix
from ....structure.layer_pattern import PATTERN_KEY
from ....structure.model import Attention, ModelStructure
from ....structure.reader import tables
from ....structure.shared_blocks import reusing_prefix, shared_blocks_rule
from .deployment import Deployment
from .parallel import heads_per_rank, kv_heads_per_rank

BACKEND = "simulation"

# Structural facts the traced modules take from the built (bridged) config while the routed-expert
# kernel, the memory figures and ``kadapt plan`` take them from the raw config (the structure).
_TRACED_FACTS = (
    "hidden_size",
    "head_dim",
    "v_head_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "intermediate_size",
    "expert_intermediate_size",
    "num_experts",
    "top_k",
    "first_dense_layers",
    "dense_layer_list",
    "moe_layer_step",
    "sliding_window",
)
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


@dataclass(frozen=True)
class LayerKind:
    """The decoder layers of one mixer and MLP kind, traced once (at the first of them)."""

    kind: str  # dense | moe | none (a one-sublayer block that is a mixer alone: Nemotron-H)
    layers: tuple[int, ...]  # indices in the full model
    windows: tuple[int | None, ...]  # each one's sliding window (None: full attention or linear)
    # attention | linear (a hybrid stack's linear-attention layers) | indexed | topk_reuse (DSA over an
    # earlier layer's top-k, no indexer of its own) | shared (KV sharing) | none (an MLP alone) | hybrid
    # (attention and a linear mixer: Falcon-H1 side by side, Zamba and Zamba2 a shared block, then the mixer)
    mixer: str = "attention"
    chunks: tuple[int | None, ...] = ()  # each one's attention chunk (Llama-4); () when none is chunked
    # their attention where it differs from the stack's (per-layer KV shapes: Gemma-4's full layers,
    # MiMo-V2-Flash's sliding ones); None: the stack's
    shape: Attention | None = None
    mlp_width: int | None = None  # their dense MLP width where it differs from the stack's (Gemma-4)
    # their MoE picks experts by token id (DeepSeek-V4's hash_moe: the router GEMM and scores, then a
    # tid2eid lookup, no top-k): traced apart from the top-k layers of the same mixer
    hash_routed: bool = False

    @property
    def spans(self) -> tuple[tuple[int | None, int | None], ...]:
        """Each layer's ``(window, chunk)``: what bounds the keys its queries see."""
        return tuple(zip(self.windows, self.chunks or (None,) * len(self.windows), strict=True))

    @property
    def index(self) -> int:
        return self.layers[0]

    @property
    def linear(self) -> bool:
        """Whether its layers run a linear mixer (swapped for its serving kernels): alone or, ``hybrid``,
        beside attention."""
        return self.mixer in ("linear", "hybrid")

    @property
    def attends(self) -> bool:
        """Whether its layers attend (through transformers' attention interface, or MLA's kernel)."""
        return self.mixer not in ("linear", "none")  # a hybrid layer attends too

    @property
    def sublayers(self) -> int:
        """Its parts each ending in a TP all-reduce: the mixer and the MLP, or the one a block has (a
        hybrid layer's attention and linear mixer each end in one: Falcon-H1's side by side, Zamba's
        shared block, then its mixer)."""
        return (self.mixer != "none") + (self.kind != "none") + (self.mixer == "hybrid")

    @property
    def scope(self) -> str:
        """The scope its ops are recorded under: the MLP kind, prefixed ``linear_`` for linear layers and
        ``hybrid_`` for layers running both (attention layers keep the names attention-only models
        always had); a block without an MLP by its mixer (``attention``, ``linear``), one without a mixer
        by its MLP (``dense_only``, ``moe_only``)."""
        if self.kind == "none":
            return "linear" if self.linear else "attention"
        if self.mixer == "none":
            return f"{self.kind}_only"
        scope = f"{self.mixer}_{self.kind}" if self.linear else self.kind
        if self.mixer == "shared":  # KV-sharing layers (Gemma-4): plan's groups say ``.shared`` too
            scope += ".shared"
        if self.mixer == "topk_reuse":  # DSA layers over an earlier layer's top-k (GLM-5, HY-V4)
            scope += ".topk_reuse"
        if self.shape is not None:  # a per-layer shape: its KV heads and width name it (plan's groups too)
            scope += f".{self.shape.num_kv_heads}x{self.shape.head_dim}"
        if self.mlp_width is not None:
            scope += f".{self.mlp_width}"
        return scope

    def attention(self, s: ModelStructure) -> Attention:
        """The attention its layers run: their own shape, else the stack's."""
        return self.shape or s.attention

    @property
    def name(self) -> str:
        return f"{self.scope}_layer"


def layer_kinds(s: ModelStructure) -> list[LayerKind]:
    """One entry per mixer and MLP kind present, in the order their first layers appear. A linear
    layer is ``linear`` whatever its ABI kind (MiniMax's ``lightning``, LFM2's ``short_conv`` too): its
    mixer is swapped for its serving kernels, not run through the attention interface. A hash-routed
    MoE layer is a kind of its own: DeepSeek-V4's csa layers begin with hash-routed layer 2, which
    priced all 21 as hash-routed (23 hash routers where the model has 3)."""
    hash_ids = set(s.moe.hash_layers) if s.moe is not None else set()
    kinds: dict[tuple[str, str, Attention | None, int | None, bool], list[int]] = {}
    for layer, mixer in zip(s.layers, s.layer_kinds, strict=True):
        mixer = "linear" if layer.attention == "linear" else mixer
        if layer.topk_source is not None:  # DSA over an earlier layer's top-k: priced sparse, not scored
            mixer = "topk_reuse"
        key = (mixer, layer.mlp, layer.attention_shape, layer.mlp_width, layer.index in hash_ids)
        kinds.setdefault(key, []).append(layer.index)
    return [
        LayerKind(
            mlp,
            tuple(ids),
            tuple(s.layers[i].window for i in ids),
            mixer,
            tuple(s.layers[i].chunk for i in ids) if s.has_chunked_layers else (),
            shape,
            width,
            hashed,
        )
        for (mixer, mlp, shape, width, hashed), ids in sorted(kinds.items(), key=lambda item: item[1][0])
    ]


def check_rank_shapes(s: ModelStructure, tp: int) -> None:
    """Refuse (``UsageError``) a TP degree at which one rank's config would build other KV heads than TP
    shards, or attention adapters it cannot split (Zamba2's, sized by the block's whole input): where
    the family's code derives a layer's KV heads from the stack's (``per_layer_attention`` rule
    ``times``: MiMo-V2-Flash's sliding layers, twice), a rank builds that multiple of the stack's
    per-rank heads, which TP shards only while it does not exceed the stack's KV heads. ``kadapt plan``
    sizes such a layer at any TP; the trace cannot build it."""
    blocks, rule = s.shared_blocks, shared_blocks_rule(s.model_type)
    if blocks is not None and blocks.attention_adapters and tp > 1 and rule is not None:
        raise UsageError(
            f"--tp {tp}: the shared blocks' q/k/v adapters (config {rule['attention_adapters']}) add one "
            f"{blocks.input_width * s.hidden_size}-wide output to every head's projection, which the "
            "per-rank model cannot split by heads; use --tp 1"
        )
    stack = s.attention
    if stack.form is not None and stack.form.o_groups % tp:
        raise UsageError(
            f"--tp {tp}: the attention's output projection runs {stack.form.o_groups} groups of heads "
            f"(o_groups), each projected on its own (o_a_proj), which TP {tp} does not divide among ranks; "
            f"use a --tp that divides {stack.form.o_groups}"
        )
    rules = tables()["per_layer_attention"]["rules"].get(s.model_type, {}).values()
    multiples = {int(r["num_kv_heads"]["times"]) for r in rules if "times" in r.get("num_kv_heads", {})}
    for layer in s.layers:
        shape = layer.attention_shape
        if shape is None or shape.num_kv_heads % stack.num_kv_heads:
            continue
        times = shape.num_kv_heads // stack.num_kv_heads
        built = times * kv_heads_per_rank(stack, tp)
        if times in multiples and kv_heads_per_rank(shape, tp) != built:
            raise UsageError(
                f"--tp {tp}: layer {layer.index} caches {shape.num_kv_heads} KV heads, {times}x the stack's "
                f"{stack.num_kv_heads} by its family's code ({s.model_type}); one rank would build {built} "
                f"where TP {tp} shards {kv_heads_per_rank(shape, tp)}; use --tp {stack.num_kv_heads} or less"
            )


def per_layer_rank_sizes(s: ModelStructure, tp: int, text: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """The per-layer KV heads of one rank, written where the config states them: its own
    ``per_layer_config`` (each built layer's override with that layer's KV heads per rank), else the keys
    the family's rule reads (``per_layer_attention.rules``: Gemma-4's ``num_global_key_value_heads``);
    a rule that derives a layer's KV heads from the stack's (MiMo-V2-Flash's sliding layers: twice)
    follows the stack's per-rank heads, which ``check_rank_shapes`` holds to the TP degrees where that
    is what a serving engine shards. Head widths do not change with TP."""
    shaped = {layer.index: layer.attention_shape for layer in s.layers if layer.attention_shape is not None}
    if not shaped:
        return {}
    listed = text.get("per_layer_config")
    if isinstance(listed, Mapping) and listed:
        return {"per_layer_config": _listed_per_rank(s, listed, tp, layers)}
    rules = tables()["per_layer_attention"]["rules"].get(s.model_type, {})
    sizes: dict[str, Any] = {}
    for index, shape in shaped.items():
        rule = rules.get(_layer_type(text, index), {}).get("num_kv_heads", {})
        if "key" in rule and shape.num_kv_heads != s.attention.num_kv_heads:  # ``times``: follows the stack's
            sizes[rule["key"]] = kv_heads_per_rank(shape, tp)
    return sizes


def _listed_per_rank(s: ModelStructure, listed: Mapping[Any, Any], tp: int, layers: int) -> dict[Any, Any]:
    """A config's ``per_layer_config`` for the built layers, each layer's query and KV heads those of one
    rank."""
    per_rank = {}
    for layer, values in listed.items():
        index = int(str(layer))
        if index >= layers:
            continue
        values = dict(values)
        if "num_key_value_heads" in values:
            values["num_key_value_heads"] = kv_heads_per_rank(s.layer_attention(index), tp)
        if "num_attention_heads" in values:  # a latent attention's own query heads (dots3's sliding layers)
            values["num_attention_heads"] = heads_per_rank(s.layer_attention(index), tp)
        per_rank[layer] = values
    return per_rank


def _layer_type(text: Mapping[str, Any], index: int) -> Any:
    types = text.get("layer_types")
    return types[index] if isinstance(types, list) and index < len(types) else None


def built_layers(s: ModelStructure) -> int:
    """Layers the per-rank model keeps: up to the first layer of the last kind to appear, and in a
    shared-block stack (Zamba) up to the first hybrid layer that reuses a block."""
    return max(max(kind.index for kind in layer_kinds(s)) + 1, reusing_prefix(s))


def rank_overrides(
    key: str | None, s: ModelStructure, dep: Deployment, text: Mapping[str, Any]
) -> dict[str, Any]:
    """Dotted overrides (applied before the spec's bridges) that resize the text sub-config to one rank,
    written under the keys the structure read each fact from: per-rank query and KV heads (an explicit
    head width, which would otherwise follow hidden / heads), dense and shared-expert widths / TP,
    vocab / TP, and the layers up to the first of each kind. Routed experts stay whole (the router is
    replicated; the experts themselves are priced analytically). Token ids are cleared: they lie
    outside the per-rank vocab."""
    tp, a, k = dep.parallel.tp, s.attention, s.keys
    layers = built_layers(s)
    sizes: dict[str, Any] = {k["vocab_size"]: math.ceil(s.vocab_size / tp)}
    if "num_layers" in k:  # else the per-layer list sets the depth (Nemotron-H's ``layers_block_type``)
        sizes[k["num_layers"]] = layers
    # a stack of SSM mixers alone has a nominal attention no key sizes, or one whose key is its mixer's
    # (Mamba2's ``num_heads``: the mixer stays whole, its kernels run the rank's 1/tp)
    attends = "num_heads" in k and bool(s.attention_layer_ids)
    if attends:
        sizes[k["num_heads"]] = heads_per_rank(a, tp)
    if "num_kv_heads" in k:
        sizes[k["num_kv_heads"]] = kv_heads_per_rank(a, tp)
    sizes.update(per_layer_rank_sizes(s, tp, text, layers))
    sizes.update(shared_in_prefix(s.model_type, text, s.num_layers, layers))  # its own sharing tail (Gemma-4)
    # gated DeltaNet's heads split like the attention heads (``Parallel.check``: TP divides them); a KDA or
    # Mamba2 mixer stays whole, its kernels run the rank's 1/tp (``ssm_kernels``)
    if s.linear is not None and s.linear.kind == "gated_delta_net":
        sizes[k["linear_num_key_heads"]] = s.linear.num_key_heads // tp
        sizes[k["linear_num_value_heads"]] = s.linear.num_value_heads // tp
    if attends and not a.is_mla:
        sizes[k.get("head_dim", "head_dim")] = a.head_dim
    if (
        a.form is not None
    ):  # DeepSeek-V4's grouped output: a rank projects its heads' groups (check_rank_shapes)
        sizes[k.get("o_groups", "o_groups")] = a.form.o_groups // tp
    if s.dense_layer_ids and "intermediate_size" in k:
        sizes[k["intermediate_size"]] = s.intermediate_size // tp
        if "ffn_auto_adjust" in k:  # LFM2: the width is already adjusted; its MLP must not adjust it again
            sizes[k["ffn_auto_adjust"]] = False
    moe = s.moe
    if moe is not None and moe.shared_intermediate_size:
        if "shared_expert_intermediate_size" in k:  # one shared expert of its own width
            sizes[k["shared_expert_intermediate_size"]] = moe.shared_intermediate_size // tp
        else:  # n shared experts of the routed width: one of the per-rank total width
            sizes[k.get("num_shared_experts", "n_shared_experts")] = 1
            width_key = k.get("expert_intermediate_size") or k["intermediate_size"]
            sizes[width_key] = max(1, moe.shared_intermediate_size // tp)
    for per_layer in (k.get("layer_types"), k.get("mlp_layer_types")):  # lists of one entry per layer
        if per_layer and isinstance(text.get(per_layer), list):
            sizes[per_layer] = list(text[per_layer][:layers])
    if isinstance(text.get(PATTERN_KEY), str):  # Nemotron-H's letters: its class builds the stack from them
        sizes[PATTERN_KEY] = text[PATTERN_KEY][:layers]
    sizes.update({name: None for name in _TOKEN_IDS if name in text})
    prefix = f"{key}." if key else ""
    return {prefix + name: value for name, value in sizes.items()}


def check_sizes(
    spec: Spec,
    key: str | None,
    text: Any,
    raw_text: Mapping[str, Any],
    overrides: dict[str, Any],
    s: ModelStructure,
) -> list[str]:
    """A bridge may not undo a per-rank size; one that changes a traced size is reported."""
    for path, wanted in overrides.items():
        if path.rpartition(".")[2] == "per_layer_config":  # built into layer configs: the kernel checks it
            continue
        got = _stated(text, path.rpartition(".")[2], wanted)
        if wanted is not None and got != wanted:
            raise KadaptError(
                f"a config bridge for backend {BACKEND} sets {path} = {got!r} over the per-rank value "
                f"{wanted!r} simulate derives from the deployment",
                location=spec.locate("config_bridges"),
            )
    notes = []
    prefix = f"{key}." if key else ""
    resized = {path.rpartition(".")[2] for path in overrides}
    for fact in _TRACED_FACTS:
        name = s.keys.get(fact)
        if name is None or name in resized or name not in raw_text:
            continue
        raw, got = raw_text[name], _stated(text, name, raw_text[name])
        if got != raw:
            notes.append(
                f"config bridges change {prefix}{name} from {raw} to {got}: the traced modules use {got}; "
                f"the routed-expert kernel, the memory figures and `kadapt plan` use the raw config's {raw}"
            )
    return notes


def _stated(config: Any, name: str, default: Any) -> Any:
    """The config's own value of ``name`` (else ``default``): the global one where a heterogeneous config
    refuses to answer for attributes its layers override (Gemma-4's ``head_dim``)."""
    stated = vars(config) if hasattr(config, "__dict__") else {}
    return stated[name] if name in stated else getattr(config, name, default)
