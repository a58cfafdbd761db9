"""A typed, normalized summary of the architecture, read from the raw hub config.

Sizing needs a dozen integers, not a transformers config object, so this reads the JSON dict the
spec ships (``spec.source.config``) and never imports torch. Config bridges do not matter here: the
only renamed fields are the vision tower's (hub ``vt_*`` / ``init_pos_emb_*`` vs transformers'
``hidden_size`` / ``pos_emb_*``) and both spellings are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config.source import resolve_source
from ...errors import KadaptError
from ...spec.model import Spec


@dataclass(frozen=True)
class TextArch:
    """The DeepSeek-V3-style text backbone (MLA attention, sigmoid-routed MoE)."""

    num_layers: int
    hidden: int
    vocab: int
    max_positions: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate: int
    moe_intermediate: int
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    first_k_dense: int
    num_mtp_layers: int
    tie_word_embeddings: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_dense_layers(self) -> int:
        return min(self.first_k_dense, self.num_layers)

    @property
    def n_moe_layers(self) -> int:
        return self.num_layers - self.n_dense_layers if self.n_routed_experts else 0

    @property
    def kv_latent_dim(self) -> int:
        """Elements MLA caches per token per layer: the compressed KV plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_expanded_dim(self) -> int:
        """Elements a non-absorbed (MHA-layout) cache would hold per token per layer: K and V per head."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class VisionArch:
    """MoonViT-style vision tower plus its patch-merger projector."""

    hidden: int
    intermediate: int
    num_heads: int
    num_layers: int
    patch_size: int
    in_channels: int
    pos_emb_height: int
    pos_emb_width: int
    merge_h: int
    merge_w: int
    mm_hidden: int
    text_hidden: int


@dataclass(frozen=True)
class Architecture:
    model_type: str
    text: TextArch
    vision: VisionArch | None


def _req(cfg: dict[str, Any], *keys: str, where: str) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    raise KadaptError(f"config {where} has none of {', '.join(keys)}")


def text_arch(cfg: dict[str, Any]) -> TextArch:
    """Normalize a DeepSeek-V3 / Kimi-K2 text config dict."""
    w = "text_config"
    heads = int(_req(cfg, "num_attention_heads", where=w))
    return TextArch(
        num_layers=int(_req(cfg, "num_hidden_layers", where=w)),
        hidden=int(_req(cfg, "hidden_size", where=w)),
        vocab=int(_req(cfg, "vocab_size", where=w)),
        max_positions=int(_req(cfg, "max_position_embeddings", where=w)),
        num_heads=heads,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(_req(cfg, "kv_lora_rank", where=w)),
        qk_nope_head_dim=int(_req(cfg, "qk_nope_head_dim", where=w)),
        qk_rope_head_dim=int(_req(cfg, "qk_rope_head_dim", where=w)),
        v_head_dim=int(_req(cfg, "v_head_dim", where=w)),
        intermediate=int(_req(cfg, "intermediate_size", where=w)),
        moe_intermediate=int(cfg.get("moe_intermediate_size") or 0),
        n_routed_experts=int(cfg.get("n_routed_experts") or 0),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        first_k_dense=int(cfg.get("first_k_dense_replace", 0)),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def vision_arch(cfg: dict[str, Any], text_hidden: int) -> VisionArch:
    """Normalize a MoonViT vision config dict, accepting hub (``vt_*``) or transformers names."""
    w = "vision_config"
    merge = cfg.get("merge_kernel_size") or [cfg.get("spatial_merge_size", 2)] * 2
    return VisionArch(
        hidden=int(_req(cfg, "vt_hidden_size", "hidden_size", where=w)),
        intermediate=int(_req(cfg, "vt_intermediate_size", "intermediate_size", where=w)),
        num_heads=int(_req(cfg, "vt_num_attention_heads", "num_attention_heads", where=w)),
        num_layers=int(_req(cfg, "vt_num_hidden_layers", "num_hidden_layers", where=w)),
        patch_size=int(_req(cfg, "patch_size", where=w)),
        in_channels=int(cfg.get("in_channels", 3)),
        pos_emb_height=int(_req(cfg, "init_pos_emb_height", "pos_emb_height", where=w)),
        pos_emb_width=int(_req(cfg, "init_pos_emb_width", "pos_emb_width", where=w)),
        merge_h=int(merge[0]),
        merge_w=int(merge[1]),
        mm_hidden=int(cfg.get("mm_hidden_size") or _req(cfg, "vt_hidden_size", "hidden_size", where=w)),
        text_hidden=int(cfg.get("text_hidden_size") or text_hidden),
    )


def architecture(raw: dict[str, Any], text_key: str | None = "text_config") -> Architecture:
    """Build the summary from a root config dict; ``text_key`` names the text sub-config (or None)."""
    text_cfg = raw.get(text_key) if text_key else raw
    if not isinstance(text_cfg, dict):
        raise KadaptError(f"config has no '{text_key}' sub-config holding the text backbone")
    text = text_arch(text_cfg)
    if text.n_routed_experts and text.top_k <= 0:
        raise KadaptError("config declares routed experts but num_experts_per_tok is missing")
    vision_cfg = raw.get("vision_config")
    vision = vision_arch(vision_cfg, text.hidden) if isinstance(vision_cfg, dict) else None
    return Architecture(model_type=str(raw.get("model_type", "")), text=text, vision=vision)


def read_config(spec: Spec) -> dict[str, Any]:
    """The raw JSON config the spec ships; sizing needs no network and no transformers."""
    path: Path | None = spec.source.config
    if path is None:
        raise KadaptError(
            "spec has no source.config; plan/simulate need the shipped config file",
            location=spec.locate("source"),
        )
    return resolve_source(spec).raw


def text_key(spec: Spec, raw: dict[str, Any]) -> str | None:
    """Key of the text sub-config in the root config, or None when the root is the text config.

    ``abi.config`` says it when the spec has an ABI; otherwise a ``text_config`` entry decides.
    """
    if spec.abi is not None:
        return spec.abi.config
    return "text_config" if isinstance(raw.get("text_config"), dict) else None


def spec_architecture(spec: Spec) -> Architecture:
    raw = read_config(spec)
    return architecture(raw, text_key(spec, raw))
