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

ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla")
# KV-cache layouts each attention kind can be exported with; the first is the default.
KV_LAYOUTS_BY_KIND = {
    "mha": ("heads",),
    "gqa": ("heads",),
    "mqa": ("heads",),
    "mla": ("latent", "expanded"),
}
ALL_KV_LAYOUTS = ("heads", "latent", "expanded")
SCORING_FUNCS = ("softmax", "sigmoid")


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

    def kv_elements(self, layout: str) -> int:
        """Elements one layer caches per token (key + value)."""
        (kh, kd), (vh, vd) = self.kv_dims(layout)
        return kh * kd + vh * vd

    def describe(self) -> str:
        if self.is_mla:
            return (
                f"MLA {self.num_heads} heads, kv_lora_rank {self.kv_lora_rank}, "
                f"q_lora_rank {self.q_lora_rank}, head_dim {self.head_dim}/{self.v_head_dim}"
            )
        return f"{self.kind.upper()} {self.num_heads} heads / {self.num_kv_heads} KV heads x {self.head_dim}"


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

    def describe(self) -> str:
        shared = f" + {self.num_shared_experts} shared" if self.num_shared_experts else ""
        if self.scoring is None:
            routing = "routing as the model's code does it: not stated by the config or spec"
        else:
            norm = {True: ", normalized", False: "", None: ", normalization not stated"}[self.normalize_top_k]
            routing = f"{self.scoring}{norm}"
        return (
            f"MoE {self.num_experts} experts top-{self.top_k}{shared} "
            f"(width {self.expert_intermediate_size}, {routing})"
        )


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its attention span and its MLP kind."""

    index: int
    attention: str  # full | sliding
    window: int | None  # keys a query sees (sliding layers only)
    mlp: str  # dense | moe


@dataclass(frozen=True)
class Rope:
    type: str  # default | yarn | llama3 | ... (transformers' rope_type)
    theta: float | None


OUTSIDE_SITES = ("embeddings", "logits")
OUTSIDE_OPS = ("mul", "div", "softcap")


@dataclass(frozen=True)
class OutsideOp:
    """Math a family does outside its decoder layers, which the ABI wrappers reproduce.

    ``embeddings``: applied to what enters the first decoder layer; ``logits``: after the LM head.
    ``softcap`` is ``tanh(x / value) * value``.
    """

    site: str
    op: str
    value: float
    key: str  # the config key it comes from

    def describe(self) -> str:
        text = {
            "mul": f"x {self.value:g}",
            "div": f"/ {self.value:g}",
            "softcap": f"soft-capped at {self.value:g}",
        }
        return f"{self.site} {text[self.op]} ({self.key})"


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

    def outside_ops(self, site: str) -> tuple[tuple[str, float], ...]:
        """``(op, value)`` of the math outside the layers at ``site`` (embeddings | logits), in order."""
        return tuple((o.op, o.value) for o in self.outside if o.site == site)

    def describe(self) -> str:
        mlp = self.moe.describe() if self.moe else f"dense MLP {self.intermediate_size}"
        if self.moe and self.n_dense_layers:
            mlp += f", dense layers {list(self.dense_layer_ids)}"
        spans = ""
        if self.has_sliding_layers:
            sliding = sum(1 for w in self.windows if w is not None)
            spans = f", {sliding}/{self.num_layers} sliding-window layers"
        outside = "".join(f", {o.describe()}" for o in self.outside)
        return (
            f"{self.num_layers} layers, hidden {self.hidden_size}, {self.attention.describe()}, "
            f"{mlp}{spans}, rope {self.rope.type}{outside}"
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("keys")
        if not self.outside:  # most families: the key stays out of the IR metadata
            data.pop("outside")
        data["layers"] = _compress_layers(self.layers)
        return data


def _compress_layers(layers: tuple[Layer, ...]) -> list[dict[str, Any]]:
    """Runs of identical layers as ``{"layers": [first, last], ...}`` (94 rows would say little)."""
    runs: list[dict[str, Any]] = []
    for layer in layers:
        kind = {"attention": layer.attention, "window": layer.window, "mlp": layer.mlp}
        if runs and {k: runs[-1][k] for k in kind} == kind and runs[-1]["layers"][1] == layer.index - 1:
            runs[-1]["layers"][1] = layer.index
        else:
            runs.append({"layers": [layer.index, layer.index], **kind})
    return runs
