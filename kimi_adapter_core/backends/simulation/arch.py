"""What sizing reads about the model: the text backbone's ``ModelStructure`` plus the vision tower.

The text backbone is ``structure.derive.structure_of_raw`` of the spec's shipped config - the one
typed description every backend reads (attention kind and KV dims, per-layer windows and MLP kinds,
MoE). This module adds only what the structure does not describe: a MoonViT-style vision tower
(Kimi-K2.5), read from ``vision_config`` under either spelling of its keys (hub ``vt_*`` /
``init_pos_emb_*`` or transformers' ``hidden_size`` / ``pos_emb_*``), and the root ``model_type``.
It reads raw JSON and never imports torch, so ``kadapt plan`` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config.source import resolve_source
from ...errors import KadaptError
from ...spec.model import Spec
from ...structure.derive import structure_of_raw
from ...structure.model import ModelStructure


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
    """The model being sized: root model_type, the text backbone's structure and a vision tower."""

    model_type: str
    structure: ModelStructure
    vision: VisionArch | None


def _req(cfg: dict[str, Any], *keys: str, where: str) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    raise KadaptError(f"config {where} has none of {', '.join(keys)}")


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


def read_config(spec: Spec) -> dict[str, Any]:
    """The raw JSON config the spec ships; sizing needs no network and no transformers."""
    path: Path | None = spec.source.config
    if path is None:
        raise KadaptError(
            "spec has no source.config; plan/simulate need the shipped config file",
            location=spec.locate("source"),
        )
    return resolve_source(spec).raw


def architecture(spec: Spec, raw: dict[str, Any]) -> Architecture:
    """The structure of ``raw`` (the root config dict) as ``spec`` reads it, plus its vision tower."""
    structure = structure_of_raw(spec, raw)
    vision_cfg = raw.get("vision_config")
    vision = vision_arch(vision_cfg, structure.hidden_size) if isinstance(vision_cfg, dict) else None
    return Architecture(str(raw.get("model_type", "")), structure, vision)


def spec_architecture(spec: Spec) -> Architecture:
    return architecture(spec, read_config(spec))
