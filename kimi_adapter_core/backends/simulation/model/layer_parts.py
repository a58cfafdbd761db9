"""Where a family's decoder layers keep their parts, for the parameter inventory's checkpoint names.

transformers' usual layer (``self_attn``, ``mlp`` with a ``gate`` router, two norms) is the default;
the tables here name where a family departs from it. The family matrix's census (``census.py``) finds
the families whose names these tables do not yet cover (``plan_departures.json``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ....structure.model import ModelStructure


@dataclass(frozen=True)
class Sublayers:
    """Where a decoder layer keeps its parts: transformers' usual ``self_attn`` and ``mlp`` after
    ``input_layernorm`` and ``post_attention_layernorm``, or, in a stack of one-sublayer blocks
    (Nemotron-H: a block is a mixer alone or an MLP alone), its one part in ``mixer`` after ``norm``."""

    attention: str = "self_attn"
    mlp: str = "mlp"
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")


# Families whose MLPs (dense, shared and routed experts) are not gated: ``up_proj`` and ``down_proj``
# around the activation, no ``gate_proj`` (transformers 5.24 ``NemotronHMLP``, ``NemotronHExperts``)
UNGATED_MLP = ("nemotron_h",)
# Families whose router weight transformers keeps in float32 (``_keep_in_fp32_modules_strict``: Nemotron-H)
FP32_ROUTER = ("nemotron_h",)


@dataclass(frozen=True)
class MoeParts:
    """Where an MoE block keeps its router and shared expert, where a family departs from the usual
    (the spec's router name, ``shared_expert``/``shared_experts`` by the config key, and a sigmoid
    router's DeepSeek-style correction bias)."""

    router: str
    shared: str
    correction_bias: bool


# Families whose decoder layers name their parts otherwise (transformers 5.24 ``Llama4TextDecoderLayer``:
# ``feed_forward`` holding ``router``, ``shared_expert`` and ``experts``; its sigmoid router has no bias)
SUBLAYERS = {"llama4_text": Sublayers(mlp="feed_forward")}
MOE_PARTS = {"llama4_text": MoeParts("router", "shared_expert", correction_bias=False)}


def sublayers(s: ModelStructure) -> Sublayers:
    """The decoder layers' part names: one-sublayer blocks when some block has no token mixer."""
    if s.mixerless_layer_ids:
        return Sublayers("mixer", "mixer", ("norm",))
    return SUBLAYERS.get(s.model_type, Sublayers())
