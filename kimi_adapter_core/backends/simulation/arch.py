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
from ...structure.bounds import FACT_RULES, WIDTH, Findings, Rule, Violation, shown, shown_path
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


# VisionArch field -> the keys it goes by (hub ``vt_*`` / transformers' names) and its rule
_VISION: dict[str, tuple[tuple[str, ...], Rule]] = {
    "hidden": (("vt_hidden_size", "hidden_size"), WIDTH),
    "intermediate": (("vt_intermediate_size", "intermediate_size"), WIDTH),
    "num_heads": (("vt_num_attention_heads", "num_attention_heads"), FACT_RULES["num_heads"]),
    "num_layers": (("vt_num_hidden_layers", "num_hidden_layers"), FACT_RULES["num_layers"]),
    "patch_size": (("patch_size",), WIDTH),
    "pos_emb_height": (("init_pos_emb_height", "pos_emb_height"), WIDTH),
    "pos_emb_width": (("init_pos_emb_width", "pos_emb_width"), WIDTH),
}


def _req(cfg: dict[str, Any], *keys: str, where: str) -> tuple[str, Any]:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return key, cfg[key]
    raise KadaptError(f"config {where} has none of {', '.join(keys)}")


def _merge(cfg: dict[str, Any], found: Findings) -> tuple[int, int]:
    """The merger's ``merge_kernel_size`` (else a square ``spatial_merge_size``, default 2)."""
    merge = cfg.get("merge_kernel_size")
    if not merge:
        side = found.take("vision_config.spatial_merge_size", cfg.get("spatial_merge_size", 2), WIDTH)
        return side or 1, side or 1
    if not isinstance(merge, list) or len(merge) != 2 or any(WIDTH.problem(side) for side in merge):
        problem = f"expected two positive integers, found {shown(merge)}"
        found.violations.append(Violation("vision_config.merge_kernel_size", problem))
        return 1, 1
    return merge[0], merge[1]


def vision_arch(cfg: dict[str, Any], text_hidden: int, *, origin: str = "config") -> VisionArch:
    """Normalize a MoonViT vision config dict, accepting hub (``vt_*``) or transformers names; every
    size typed and bounded (``structure.bounds``), all broken ones reported at once."""
    found = Findings()

    def size(keys: tuple[str, ...], rule: Rule) -> int:
        key, value = _req(cfg, *keys, where="vision_config")
        return found.take(f"vision_config.{key}", value, rule) or 1

    def optional(key: str, default: int) -> int:
        value = cfg.get(key)
        return default if value is None else found.take(f"vision_config.{key}", value, WIDTH) or 1

    sizes = {field: size(keys, rule) for field, (keys, rule) in _VISION.items()}
    merge_h, merge_w = _merge(cfg, found)
    arch = VisionArch(
        **sizes,
        in_channels=optional("in_channels", 3),
        merge_h=merge_h,
        merge_w=merge_w,
        mm_hidden=optional("mm_hidden_size", sizes["hidden"]),
        text_hidden=optional("text_hidden_size", text_hidden),
    )
    found.raise_any(origin)
    return arch


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
    vision = None
    if isinstance(vision_cfg, dict):
        origin = shown_path(spec.source.config) if spec.source.config is not None else "config"
        vision = vision_arch(vision_cfg, structure.hidden_size, origin=origin)
    return Architecture(str(raw.get("model_type", "")), structure, vision)


def spec_architecture(spec: Spec) -> Architecture:
    return architecture(spec, read_config(spec))
