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

from ....config.source import resolve_source
from ....errors import KadaptError, Refusal
from ....spec.model import Spec
from ....structure.bounds import shown_path
from ....structure.model import ModelStructure
from ....structure.of_spec import structure_of_raw
from ....vision.tower import VisionArch, vision_arch


@dataclass(frozen=True)
class Architecture:
    """The model being sized: root model_type, the text backbone's structure and a vision tower."""

    model_type: str
    structure: ModelStructure
    vision: VisionArch | None


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
    if structure.linear is not None:
        raise Refusal(
            "hybrid",
            f"{len(structure.linear_layer_ids)} of the {structure.num_layers} layers are linear attention "
            f"({structure.linear.describe()}): plan and simulate do not size or price their states and "
            "scans yet, and refuse rather than count them as attention (apply and --verify carry them)",
            location=spec.locate("gate"),
        )
    vision_cfg = raw.get("vision_config")
    vision = None
    if isinstance(vision_cfg, dict):
        origin = shown_path(spec.source.config) if spec.source.config is not None else "config"
        vision = vision_arch(vision_cfg, structure.hidden_size, origin=origin)
    return Architecture(str(raw.get("model_type", "")), structure, vision)


def spec_architecture(spec: Spec) -> Architecture:
    return architecture(spec, read_config(spec))
