"""The typed structure of a decoder model: what every backend needs to know, in one place.

Extraction (KV cache shapes, per-layer masks, tiny verify models), planning (parameter and KV
bytes), simulation (per-op FLOPs and sharding) and generation (wrapper modules, TensorCast
profiles, docs) all read this one description instead of config keys of one family. It is derived
from a transformers config (object or raw JSON dict) plus the spec's ``architecture`` section by
``derive.derive_structure``; it is plain data, torch-free and frozen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .around_layers import OutsideOp, PerLayerInputs, ResidualStreams
from .attention_form import AttentionForm
from .compressed import Compressor, Indexer
from .mixer import LinearAttention
from .rope import Rope

ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla")
# KV-cache layouts each attention kind can be exported with; the first is the default.
KV_LAYOUTS_BY_KIND = {
    "mha": ("heads",),
    "gqa": ("heads",),
    "mqa": ("heads",),
    "mla": ("latent", "expanded"),
}
ALL_KV_LAYOUTS = ("heads", "latent", "expanded")
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")  # sqrtsoftplus: sqrt(softplus(x)), DeepSeek-V4
# scorings whose top-k adds a correction bias to the scores (DeepSeek's noaux_tc; DeepSeek-V4 keeps it)
CORRECTED_SCORINGS = ("sigmoid", "sqrtsoftplus")


@dataclass(frozen=True)
class Attention:
    """Self-attention of every decoder layer.

    ``head_dim`` is the query/key width per head, ``v_head_dim`` the value width. For MLA,
    ``num_kv_heads`` equals ``num_heads`` (the expanded view) and the latent ranks are set.
    """

    kind: str  # mha | gqa | mqa | mla
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    # the values are the key projection's output (no v_proj; Gemma-4's full layers with
    # attention_k_eq_v): K and V still differ by their norms and rope, so both are cached
    value_from_key: bool = False
    form: AttentionForm | None = None  # projections other than q/k/v/o (DeepSeek-V4's shared-KV MQA)

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def kv_layouts(self) -> tuple[str, ...]:
        return KV_LAYOUTS_BY_KIND[self.kind]

    @property
    def default_kv_layout(self) -> str:
        return self.kv_layouts[0]

    def kv_dims(self, layout: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((key_heads, key_dim), (value_heads, value_dim))`` of one cached token in ``layout``."""
        if layout not in self.kv_layouts:
            raise ValueError(
                f"kv_layout {layout!r} does not fit {self.kind.upper()} attention; valid: "
                f"{', '.join(self.kv_layouts)}"
            )
        if layout == "latent":
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.v_head_dim)

    @property
    def value_is_key(self) -> bool:
        """Whether the values are the keys themselves (DeepSeek-V4's shared key/value head): the ABI
        carries both states, a serving engine stores one."""
        return self.form is not None and self.form.value_is_key

    def kv_elements(self, layout: str) -> int:
        """Elements one layer caches per token (key + value, as the ABI carries them: both where
        ``value_is_key``)."""
        (kh, kd), (vh, vd) = self.kv_dims(layout)
        return kh * kd + vh * vd

    def describe(self) -> str:
        if self.is_mla:
            return (
                f"MLA {self.num_heads} heads, kv_lora_rank {self.kv_lora_rank}, "
                f"{'full q projection' if self.q_lora_rank is None else f'q_lora_rank {self.q_lora_rank}'}, "
                f"head_dim {self.head_dim}/{self.v_head_dim}"
            )
        shape = f"{self.kind.upper()} {self.num_heads} heads / {self.num_kv_heads} KV heads x {self.head_dim}"
        shape += f", {self.form.describe()}" if self.form is not None else ""
        return shape + (", values from the key projection" if self.value_from_key else "")

    def to_dict(self) -> dict[str, Any]:
        """Its fields; ``value_from_key`` only where it is set (every other stack's metadata is unchanged)."""
        data = asdict(self)
        if not self.value_from_key:
            data.pop("value_from_key")
        if self.form is None:
            data.pop("form")
        return data


@dataclass(frozen=True)
class Moe:
    """Routed experts (plus optional shared experts) of the MoE layers."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_shared_experts: int
    shared_intermediate_size: int  # total width of the shared experts (0 when none)
    # softmax | sigmoid; None: neither the config nor the spec says (the model's code decides)
    scoring: str | None
    normalize_top_k: bool | None  # None: not stated
    routed_scaling_factor: float = 1.0
    expert_groups: int = 1  # group-limited routing (DeepSeek's n_group / topk_group)
    top_k_groups: int = 1
    hash_layers: tuple[int, ...] = ()  # routed by token id (DeepSeek-V4's tid2eid), not by the scores' top-k

    def describe(self) -> str:
        shared = f" + {self.num_shared_experts} shared" if self.num_shared_experts else ""
        if self.scoring is None:
            routing = "routing as the model's code does it: not stated by the config or spec"
        else:
            norm = {True: ", normalized", False: "", None: ", normalization not stated"}[self.normalize_top_k]
            routing = f"{self.scoring}{norm}"
        hashed = f"; {len(self.hash_layers)} layers pick them by token id" if self.hash_layers else ""
        return (
            f"MoE {self.num_experts} experts top-{self.top_k}{shared} "
            f"(width {self.expert_intermediate_size}, {routing}{hashed})"
        )


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its token mixer (attention span, or linear attention) and its MLP kind. A stack
    of one-sublayer blocks (Nemotron-H) has blocks with no token mixer (``attention`` ``none``: an MLP
    alone) and mixer blocks with no MLP (``mlp`` ``none``)."""

    index: int
    # full | sliding | chunked | linear (ModelStructure.linear) | indexed (full + DSA: .indexer) | hca
    # (sliding + compressed entries: .compressor) | csa (sliding + the entries an indexer picks:
    # .sparse_compressor) | none
    # (no mixer) | hybrid (full attention and the linear mixer: side by side, Falcon-H1; a shared block's,
    # then the mixer, Zamba: .shared_blocks)
    attention: str
    window: int | None  # keys a query sees (sliding, hca and csa layers only)
    mlp: str  # dense | moe | none
    # chunked layers only (Llama-4): the query at position p sees keys p - p % chunk .. p
    chunk: int | None = None
    # the layer's own attention where its KV heads or head width differ from the stack's
    # (``layer_shapes``: MiMo-V2-Flash's sliding layers, Gemma-4's full layers); None: the stack's
    attention_shape: Attention | None = None
    # the earlier layer whose keys and values this one reuses within a forward (``kv_sharing``: Gemma-4's
    # last num_kv_shared_layers layers); it caches nothing of its own. None: it computes and caches its own
    kv_source: int | None = None
    # the layer's dense MLP width where it differs from the stack's ``intermediate_size`` (Gemma-4's
    # double-wide MLP on its KV-sharing layers); None: the stack's
    mlp_width: int | None = None
    # an ``indexed`` layer without an indexer of its own: the earlier indexed layer whose top-k it attends
    # over (``indexer_types`` ``shared``: GLM-5, HY-V4); it caches keys and values, no indexer keys.
    # None: it scores its own indexer keys (or is not indexed)
    topk_source: int | None = None


@dataclass(frozen=True)
class SharedBlocks:
    """Transformer blocks shared across a stack's ``hybrid`` layers (Zamba, Zamba2, ``shared_blocks.py``):
    ``count`` blocks, hybrid layer ``j`` running block ``j % count`` over its hidden states concatenated
    with the input embeddings (``input_width`` x hidden wide); each hybrid layer has LoRA adapters of
    ``adapter_rank`` of its own (0: none; gate/up, and q/k/v with ``attention_adapters``) and a hidden x
    hidden projection of the block's output into its own mixer."""

    count: int
    adapter_rank: int
    attention_adapters: bool
    input_width: int

    def describe(self) -> str:
        if not self.adapter_rank:
            return f"{self.count} shared block(s), no adapters"
        adapted = "q/k/v and gate/up" if self.attention_adapters else "gate/up"
        return (
            f"{self.count} shared block(s), {adapted} adapters of rank {self.adapter_rank} per hybrid layer"
        )


@dataclass(frozen=True)
class ModelStructure:
    """A decoder-only text backbone as every kadapt backend sees it."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    attention: Attention
    intermediate_size: int  # dense MLP width (0 when every layer is MoE)
    moe: Moe | None
    layers: tuple[Layer, ...]
    rope: Rope
    tie_word_embeddings: bool
    num_mtp_layers: int = 0
    outside: tuple[OutsideOp, ...] = ()  # math outside the decoder layers, in the order it is applied
    linear: LinearAttention | None = None  # the mixer of the ``linear`` layers (None: attention only)
    indexer: Indexer | None = None  # the DSA indexer of the ``indexed`` layers (None: no such layer)
    per_layer_inputs: PerLayerInputs | None = None  # per-layer embeddings (None: the layers take none)
    shared_blocks: SharedBlocks | None = None  # the hybrid layers' shared blocks (None: no hybrid layer)
    residual_streams: ResidualStreams | None = None  # hyper-connections (None: one residual stream)
    compressor: Compressor | None = None  # the ``hca`` layers' compressor (None: no such layer)
    sparse_compressor: Compressor | None = None  # the ``csa`` layers' (an indexer; None: no such layer)
    # fact -> the config key it was read from (so tiny verify models shrink the right keys)
    keys: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if layer.mlp == "moe")

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if layer.mlp == "dense")

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def n_dense_layers(self) -> int:
        return len(self.dense_layer_ids)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer: the sliding window, or None for full attention."""
        return tuple(layer.window for layer in self.layers)

    @property
    def has_sliding_layers(self) -> bool:
        return any(window is not None for window in self.windows)

    @property
    def chunks(self) -> tuple[int | None, ...]:
        """Per layer: the attention chunk of a chunked layer (Llama-4), or None."""
        return tuple(layer.chunk for layer in self.layers)

    @property
    def has_chunked_layers(self) -> bool:
        return any(chunk is not None for chunk in self.chunks)

    @property
    def compressors(self) -> dict[str, Compressor]:
        """The compressed layer kinds' compressors (``hca``, ``csa``), those the stack has."""
        found = {"hca": self.compressor, "csa": self.sparse_compressor}
        return {kind: compressor for kind, compressor in found.items() if compressor is not None}

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind as the ABI carries its state: ``linear`` (conv window and recurrent state),
        ``lightning`` (a recurrent state alone: MiniMax), ``indexed`` (a KV cache and the DSA indexer's
        keys; a layer reusing another's top-k keeps the KV cache alone: ``attention``), ``none`` (no
        token mixer: no state), ``shared`` (attends over an earlier layer's keys and values of the same
        call: no state), ``hybrid`` (a KV cache and a conv window and recurrent state: Falcon-H1's
        attention and Mamba2 side by side, Zamba's shared block and then its Mamba) or ``attention`` (a KV
        cache), ``hca`` (a sliding KV cache, a compressor's ring and its entries: DeepSeek-V4), ``csa``
        (those and its Lightning indexer's ring and entries)."""
        linear = self.linear.layer_kind if self.linear is not None else "linear"
        special = {"linear": linear, "indexed": "indexed", "none": "none", "hybrid": "hybrid"}
        special.update({kind: kind for kind in ("hca", "csa")})
        return tuple(
            "shared"
            if layer.kv_source is not None
            else "attention"  # attends over another layer's top-k: its state is a KV cache alone
            if layer.topk_source is not None
            else special.get(layer.attention, "attention")
            for layer in self.layers
        )

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        """The layers that keep a linear mixer's states: ``linear`` ones and ``hybrid`` ones (which attend
        too: they are among ``attention_layer_ids`` as well)."""
        return tuple(layer.index for layer in self.layers if layer.attention in ("linear", "hybrid"))

    @property
    def hybrid_layer_ids(self) -> tuple[int, ...]:
        """The layers that run full attention and a linear mixer: side by side (Falcon-H1) or a shared
        block, then the mixer (Zamba, Zamba2)."""
        return tuple(layer.index for layer in self.layers if layer.attention == "hybrid")

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The layers with a KV cache of their own: those that attend (full, sliding, chunked or indexed)
        but do not reuse an earlier layer's keys and values (``shared_layer_ids``)."""
        return tuple(
            layer.index
            for layer in self.layers
            if layer.attention not in ("linear", "none") and layer.kv_source is None
        )

    @property
    def shared_layer_ids(self) -> tuple[int, ...]:
        """The layers that attend over an earlier layer's keys and values of the same call (Gemma-4's KV
        sharing): their queries and outputs are their own, their keys and values and cache are not."""
        return tuple(layer.index for layer in self.layers if layer.kv_source is not None)

    @property
    def mixerless_layer_ids(self) -> tuple[int, ...]:
        """The blocks without a token mixer (an MLP alone: Nemotron-H's ``mlp`` and ``moe`` blocks)."""
        return tuple(layer.index for layer in self.layers if layer.attention == "none")

    @property
    def mlpless_layer_ids(self) -> tuple[int, ...]:
        """The layers without an MLP (Nemotron-H's mixer blocks)."""
        return tuple(layer.index for layer in self.layers if layer.mlp == "none")

    def layer_attention(self, index: int) -> Attention:
        """Layer ``index``'s attention: its own shape, else the stack's."""
        return self.layers[index].attention_shape or self.attention

    def kv_dims(self, index: int, layout: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((key_heads, key_dim), (value_heads, value_dim))`` layer ``index`` caches per token."""
        return self.layer_attention(index).kv_dims(layout)

    def layer_kv_dims(self, layout: str) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...] | None:
        """Per layer its KV dims when the attending layers cache different shapes, else None (one shape:
        ``attention.kv_dims``, and every document that states it stays as it was)."""
        if all(layer.attention_shape is None for layer in self.layers):
            return None
        return tuple(self.kv_dims(layer.index, layout) for layer in self.layers)

    def outside_ops(self, site: str) -> tuple[tuple[str, float], ...]:
        """``(op, value)`` of the math outside the layers at ``site`` (embeddings | logits), in order."""
        return tuple((o.op, o.value) for o in self.outside if o.site == site)

    def describe(self) -> str:
        mlp = self.moe.describe() if self.moe else f"dense MLP {self.intermediate_size}"
        wide = [layer for layer in self.layers if layer.mlp_width is not None]
        if wide:
            widths = "/".join(str(w) for w in sorted({layer.mlp_width for layer in wide if layer.mlp_width}))
            mlp += f" ({len(wide)}/{self.num_layers} layers {widths})"
        if self.moe and self.n_dense_layers:
            mlp += f", dense layers {list(self.dense_layer_ids)}"
        spans = ""
        if self.has_sliding_layers:
            sliding = sum(1 for w in self.windows if w is not None)
            spans = f", {sliding}/{self.num_layers} sliding-window layers"
        if self.has_chunked_layers:
            chunked = [c for c in self.chunks if c is not None]
            sizes = "/".join(str(c) for c in sorted(set(chunked)))
            spans += f", {len(chunked)}/{self.num_layers} chunked-attention layers (chunk {sizes})"
        outside = "".join(f", {o.describe()}" for o in self.outside)
        if self.per_layer_inputs is not None:
            outside += f", {self.per_layer_inputs.describe()}"
        if self.shared_blocks is not None:
            hybrid = len(self.hybrid_layer_ids)
            outside += f", {hybrid}/{self.num_layers} hybrid layers ({self.shared_blocks.describe()})"
        if self.residual_streams is not None:
            outside += f", {self.residual_streams.describe()}"
        mixer = self.attention.describe()
        if self.linear is not None:
            # a shared-block stack's hybrid layers are told with their blocks (Zamba), others' beside
            # their attention (Falcon-H1: side by side)
            blocks = self.shared_blocks is not None
            linear = len(self.linear_layer_ids) - (len(self.hybrid_layer_ids) if blocks else 0)
            both = " beside attention" if self.hybrid_layer_ids and not blocks else ""
            kind = f"linear-attention layers{both} ({self.linear.describe()})"
            mixer = f"{linear}/{self.num_layers} {kind}, {mixer}"
        if self.indexer is not None:
            mixer = f"{mixer} with a {self.indexer.describe()}"
            reusing = [layer for layer in self.layers if layer.topk_source is not None]
            if reusing:
                mixer += f" ({len(reusing)}/{self.num_layers} layers reuse an earlier layer's top-k)"
        for kind, compressor in self.compressors.items():
            compressed = sum(1 for layer in self.layers if layer.attention == kind)
            label = "compressed" if kind == "hca" else "compressed sparse"
            mixer += f", {compressed}/{self.num_layers} {label} layers ({compressor.describe()})"
        shaped = [layer for layer in self.layers if layer.attention_shape is not None]
        if shaped:  # per-layer shapes: how many layers differ, and how
            others = sorted({layer.attention_shape.describe() for layer in shaped if layer.attention_shape})
            mixer += f" ({len(shaped)}/{self.num_layers} layers {'; '.join(others)})"
        if self.shared_layer_ids:
            sources = sorted({layer.kv_source for layer in self.layers if layer.kv_source is not None})
            mixer += (
                f", the last {len(self.shared_layer_ids)}/{self.num_layers} layers reuse the keys and values "
                f"of layers {', '.join(map(str, sources))} (KV sharing)"
            )
        if self.mixerless_layer_ids:  # one-sublayer blocks: say how many are an MLP alone, and a mixer alone
            mixer += f", {len(self.mixerless_layer_ids)}/{self.num_layers} blocks an MLP alone (no mixer)"
            mlp += f", {len(self.mlpless_layer_ids)}/{self.num_layers} blocks a mixer alone (no MLP)"
        return (
            f"{self.num_layers} layers, hidden {self.hidden_size}, {mixer}, "
            f"{mlp}{spans}, {self.rope.describe(self.num_layers)}{outside}"
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("keys")
        if not self.outside:  # most families: the key stays out of the IR metadata
            data.pop("outside")
        # stacks without them: metadata unchanged
        for kind in (
            "linear",
            "indexer",
            "per_layer_inputs",
            "residual_streams",
            "shared_blocks",
            "compressor",
            "sparse_compressor",
        ):
            if getattr(self, kind) is None:
                data.pop(kind)
        for size in ("dt_rank", "block_size"):  # only Mamba1 states the one, lightning the other
            if self.linear is not None and getattr(self.linear, size) is None:
                data["linear"].pop(size)
        if self.linear is not None and self.linear.gated_norm:  # only a norm-less Mamba2 says so
            data["linear"].pop("gated_norm")
        if self.moe is not None and not self.moe.hash_layers:  # only hash-routed stacks say so
            data["moe"].pop("hash_layers")
        data["attention"] = self.attention.to_dict()
        data["layers"] = _compress_layers(self.layers)
        data["rope"] = self.rope.to_dict()
        return data


def _compress_layers(layers: tuple[Layer, ...]) -> list[dict[str, Any]]:
    """Runs of identical layers as ``{"layers": [first, last], ...}`` (94 rows would say little)."""
    runs: list[dict[str, Any]] = []
    for layer in layers:
        kind = {"attention": layer.attention, "window": layer.window, "mlp": layer.mlp}
        if layer.chunk is not None:  # only chunked layers name one: other stacks' metadata is unchanged
            kind["chunk"] = layer.chunk
        if layer.attention_shape is not None:  # only a layer whose shape differs names it
            kind["attention_shape"] = layer.attention_shape.to_dict()
        if layer.kv_source is not None:  # only a KV-sharing layer names the layer it reads
            kind["kv_source"] = layer.kv_source
        if layer.mlp_width is not None:  # only a layer whose MLP width differs names it
            kind["mlp_width"] = layer.mlp_width
        if layer.topk_source is not None:  # only a layer reusing another's DSA top-k names it
            kind["topk_source"] = layer.topk_source
        previous = {k: v for k, v in runs[-1].items() if k != "layers"} if runs else None
        if previous == kind and runs[-1]["layers"][1] == layer.index - 1:
            runs[-1]["layers"][1] = layer.index
        else:
            runs.append({"layers": [layer.index, layer.index], **kind})
    return runs
