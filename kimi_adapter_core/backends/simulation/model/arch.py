"""What sizing reads about the model: the text backbone's ``ModelStructure`` plus the vision tower.

The text backbone is ``structure.derive.structure_of_raw`` of the spec's shipped config - the one
typed description every backend reads (attention kind and KV dims, per-layer windows, mixers and
MLP kinds, MoE, a hybrid stack's linear-attention sizes, a DSA stack's indexer). This module adds
only what the structure does not describe: a MoonViT-style vision tower (Kimi-K2.5), read from
``vision_config`` under either spelling of its keys (hub ``vt_*`` / ``init_pos_emb_*`` or
transformers' ``hidden_size`` / ``pos_emb_*``), and the root ``model_type``; and it refuses a DSA
config it would size wrong.
It reads raw JSON and never imports torch, so ``kadapt plan`` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....config.source import resolve_source
from ....errors import KadaptError
from ....spec.model import Spec
from ....structure.bounds import shown_path
from ....structure.model import ModelStructure
from ....structure.of_spec import structure_of_raw, text_config_key
from ....structure.reader import tables
from ....vision.tower import VisionArch, vision_arch


@dataclass(frozen=True)
class Architecture:
    """The model being sized: root model_type, the text backbone's structure and a vision tower."""

    model_type: str
    structure: ModelStructure
    vision: VisionArch | None
    # the config's ``architectures``: what a serving framework picks its model code and defaults by
    architectures: tuple[str, ...] = ()


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
    """The structure of ``raw`` (the root config dict) as ``spec`` reads it, plus its vision tower when
    the spec names one (``module_paths.vision_tower``: a MoonViT tower; a vision-language checkpoint
    adapted for its text model alone, Qwen3.5's, is sized without its tower)."""
    structure = structure_of_raw(spec, raw)
    _check_indexer(spec, raw, structure)
    vision_cfg = raw.get("vision_config")
    vision = None
    if isinstance(vision_cfg, dict) and "vision_tower" in spec.module_paths:
        origin = shown_path(spec.source.config) if spec.source.config is not None else "config"
        vision = vision_arch(vision_cfg, structure.hidden_size, origin=origin)
    names = raw.get("architectures")
    architectures = tuple(str(n) for n in names) if isinstance(names, list) else ()
    return Architecture(str(raw.get("model_type", "")), structure, vision, architectures)


def indexed_layer_ids(s: ModelStructure) -> tuple[int, ...]:
    """The DSA layers with an indexer of their own (``indexed``: MLA plus the indexer) of a stack; a
    layer that reuses another's top-k (``Layer.topk_source``) has neither its weights nor its keys."""
    return tuple(
        layer.index for layer in s.layers if layer.attention == "indexed" and layer.topk_source is None
    )


_INDEX_KEYS = ("index_topk", "index_n_heads", "index_head_dim")


def _check_indexer(spec: Spec, raw: dict[str, Any], s: ModelStructure) -> None:
    """A DSA stack is sized and priced as DeepSeek-V3.2 builds it: MLA whose low-rank query residual
    (``q_lora_rank``) feeds the indexer's ``wq_b``. A config that sizes an indexer but names no indexed
    layer would be sized as dense MLA while transformers builds every layer with an indexer
    (``DeepseekV32Config`` fills ``layer_types`` itself): refused rather than sized wrong."""
    origin = shown_path(spec.source.config) if spec.source.config is not None else "config"
    key = text_config_key(spec, isinstance(raw.get("text_config"), dict))
    text = raw[key] if key and isinstance(raw.get(key), dict) else raw
    if s.indexer is None:
        if s.model_type in tables()["compressor_indexer_types"]:  # a compressed layer's indexer, none here
            return
        sized = [key for key in _INDEX_KEYS if text.get(key) is not None]
        if sized:
            raise KadaptError(
                f"{origin}: the config sizes a DSA indexer ({', '.join(sized)}) but its layer_types names no "
                "indexed_attention layer; plan and simulate would size dense MLA where transformers builds "
                "an indexer in every layer: list the layers in layer_types",
                location=spec.locate("source.config"),
            )
        return
    a = s.attention
    if not (a.is_mla and a.q_lora_rank):
        raise KadaptError(
            f"{origin}: the indexed layers' DSA indexer reads the MLA query residual (q_lora_rank), but the "
            f"attention is {a.describe()}; plan and simulate size DeepSeek-V3.2's indexer only",
            location=spec.locate("source.config"),
        )


def spec_architecture(spec: Spec) -> Architecture:
    return architecture(spec, read_config(spec))
