"""A MoonViT-style vision tower as sizing reads it from the raw config, torch-free.

Read from ``vision_config`` under either spelling of its keys (hub ``vt_*`` / ``init_pos_emb_*`` or
transformers' ``hidden_size`` / ``pos_emb_*``), so ``kadapt plan`` and ``simulate`` size Kimi-K2.5's
tower from the shipped JSON alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import KadaptError
from ..structure.bounds import FACT_RULES, WIDTH, Findings, Rule, Violation, shown


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
