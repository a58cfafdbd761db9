"""Where a family's decoder layers keep their parts, for the parameter inventory's checkpoint names.

transformers' usual layer (``USUAL``: ``self_attn``, ``mlp`` with ``gate_proj``/``up_proj``/``down_proj``
and a ``gate`` router, two norms) is the default; ``layer_parts.json`` holds where each family departs
from it: its norms (name, count and placement: OLMo-2's post-norms, Cohere's single norm, OLMo's
weightless LayerNorm), a fused q/k/v or another output projection (Phi-3's ``qkv_proj``, Persimmon's
``dense``), the MLP's block and projection names (gated, fused ``gate_up`` or ungated ``fc1``/``fc2``),
the router's name, the shared expert's name and gate, and whether a sigmoid router keeps a
correction bias. The table is data generated from the classes transformers builds (``python -m
kimi_adapter_core.families.parts --write``; ``tests/test_layer_parts.py`` checks it is a regeneration),
so plan stays torch-free. The family matrix's census (``census.py``) finds the families these parts do
not yet describe (``plan_departures.json``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ....structure.model import ModelStructure

PARTS_TABLE = Path(__file__).with_name("layer_parts.json")
# Families whose router weight the checkpoint keeps in float32 (Nemotron-H). A dtype, not a name: not in
# the table, as transformers' ``_keep_in_fp32_modules_strict`` keeps DeepSeek-V3's router in float32 too,
# which its checkpoint stores in bf16
FP32_ROUTER = ("nemotron_h",)

_GATED = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# transformers' usual layer: what a table entry leaves out (the generator drops what equals it)
USUAL: dict[str, Any] = {
    "attention": "self_attn",
    "norms": ["input_layernorm", "post_attention_layernorm"],
    "final_norm": True,
    "mlp": "mlp",
    "dense_mlp": _GATED,
    "shared_mlp": _GATED,
    "experts_gated": True,
    "router": "gate",
    "o_proj": "o_proj",
    "correction_bias": "gate.e_score_correction_bias",
}


@dataclasses.dataclass(frozen=True)
class LayerParts:
    """Where a decoder layer keeps its parts. A projection mapping names each role of an MLP: ``gate``,
    ``up``, ``down``, or ``gate_up`` (fused), ``down``, or ``up``, ``down`` (ungated). ``router`` None:
    the spec's name (``moe.field_renames.gate``); ``shared`` None: by the config key (``shared_expert``
    with its ``shared_expert_gate`` for Qwen2-MoE's key, else ``shared_experts``)."""

    attention: str = USUAL["attention"]
    norms: tuple[str, ...] = tuple(USUAL["norms"])
    final_norm: bool = True  # the stack's final norm holds a weight
    qkv: str | None = None  # a fused q/k/v projection, in place of q_proj, k_proj, v_proj
    o_proj: str = USUAL["o_proj"]
    output_gate: str | None = None  # the attention's own output gate projection (HY-V4's gate_proj)
    mlp: str = USUAL["mlp"]
    moe: str | None = None  # the MoE block, when not where the dense MLP is
    dense_mlp: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(_GATED))
    shared_mlp: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(_GATED))
    experts_gated: bool = True  # routed experts hold gate_up_proj (else up_proj)
    router: str | None = None
    correction_bias: str | None = USUAL["correction_bias"]  # a sigmoid router's, under the MoE block
    shared: str | None = None
    shared_gate: str | None = None

    @property
    def moe_block(self) -> str:
        return self.moe or self.mlp


@functools.cache
def _table() -> dict[str, dict[str, Any]]:
    return json.loads(PARTS_TABLE.read_text(encoding="utf-8"))["families"]


def family_parts(model_type: str) -> LayerParts:
    """``model_type``'s parts: the table's entry over the usual layer."""
    entry = dict(_table().get(model_type, {}))
    if "norms" in entry:
        entry["norms"] = tuple(entry["norms"])
    return LayerParts(**entry)


def sublayers(s: ModelStructure) -> LayerParts:
    """The decoder layers' parts; in a stack of one-sublayer blocks (some block has no token mixer:
    Nemotron-H's is a mixer alone or an MLP alone) every block keeps its one part in ``mixer`` after
    ``norm``."""
    parts = family_parts(s.model_type)
    if s.mixerless_layer_ids:
        return dataclasses.replace(parts, attention="mixer", mlp="mixer", norms=("norm",))
    return parts


def shared_expert(s: ModelStructure, parts: LayerParts) -> tuple[str, str | None]:
    """The shared expert's name and its gate's: the table's, else by the config key - Qwen2-MoE style
    (one shared expert of its own width, and a sigmoid gate on it) vs DeepSeek style (n shared experts
    of the routed width; Nemotron-H's of moe_shared_expert_intermediate_size)."""
    if parts.shared is not None:
        return parts.shared, parts.shared_gate
    qwen_style = s.keys.get("shared_expert_intermediate_size") == "shared_expert_intermediate_size"
    return ("shared_expert", "shared_expert_gate") if qwen_style else ("shared_experts", None)
