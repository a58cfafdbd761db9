"""How the per-rank trace calls a decoder layer and what it prices around the layers once per step: a
layer's position keywords, its hidden states out of whatever it returns, and the per-layer embeddings
(Gemma-4's PLE) the model computes before its layers."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ....structure.model import ModelStructure
from .tracer import Recorder


def hidden_of(out: Any) -> torch.Tensor:
    """A decoder layer's hidden states (GLM-5's layers also return the top-k they hand on)."""
    return out[0] if isinstance(out, tuple) else out


# what a decoder layer returns beside its hidden states for the next one, in order (the extraction
# runtime's ``CARRIED_INPUTS``: GLM-5's and HY-V4's DSA top-k, which a layer without an indexer reuses)
CARRIED = ("prev_topk_indices",)


def handed_on(out: Any) -> dict[str, Any]:
    """What a decoder layer's output hands the next layer, by the name that layer takes it under."""
    return dict(zip(CARRIED, out[1:], strict=False)) if isinstance(out, tuple) else {}


def carried_to(layer: nn.Module, carried: dict[str, Any]) -> dict[str, Any]:
    """The handed-on values ``layer``'s forward takes (each traced layer stands for its kind, and the
    first of a kind that reuses a top-k comes after a layer that computes one)."""
    params = inspect.signature(layer.forward).parameters
    return {name: value for name, value in carried.items() if name in params}


def positions_of(layer: nn.Module, embeddings: Any, positions: torch.Tensor) -> dict[str, Any]:
    """The position keywords a decoder layer is called with: its rotary ``(cos, sin)`` and, when its
    forward takes them (by name or ``**kwargs``), the token positions, which some attentions read
    themselves (Ministral-3's Llama-4 query scaling by position)."""
    params = inspect.signature(layer.forward).parameters.values()
    takes = any(p.name == "position_ids" or p.kind is p.VAR_KEYWORD for p in params)
    return {"position_embeddings": embeddings, **({"position_ids": positions} if takes else {})}


def rope_for(rotary: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, rope_type: Any) -> Any:
    """A traced layer's position embeddings: the one rope (``rope_type`` None), its layer type's, or for
    rope labels (a tuple: DeepSeek-V4, ``upstream.rope_labels``) ``{label: (cos, sin)}`` of each."""
    if isinstance(rope_type, tuple):
        return {label: rotary(hidden, positions, label) for label in rope_type}
    return rotary(hidden, positions, *([rope_type] if rope_type else []))


def mask_of(layer: nn.Module, hidden: torch.Tensor) -> dict[str, Any]:
    """An all-visible additive mask over the step's tokens where the layer's forward requires one
    (Falcon's); other layers get none: the serving kernels price the attention, the trace masks nothing.
    An attention that then computes inline rather than through transformers' attention interface is
    refused after the step (``RankModel.trace``)."""
    params = inspect.signature(layer.forward).parameters.values()
    if _hands_on_mask(
        layer, params
    ):  # DeepSeek-V4: the layer passes **kwargs to an attention that requires one
        return {"attention_mask": None}
    if not any(p.name == "attention_mask" and p.default is p.empty for p in params):
        return {}
    batch, tokens = hidden.shape[:2]
    return {"attention_mask": hidden.new_zeros(batch, 1, tokens, tokens)}


def _hands_on_mask(layer: nn.Module, params: Any) -> bool:
    """Whether the layer names no attention mask but hands its ``**kwargs`` to an attention whose forward
    requires one (the model's forward passes it by keyword; None: nothing masked)."""
    params = list(params)
    if any(p.name == "attention_mask" for p in params) or not any(p.kind is p.VAR_KEYWORD for p in params):
        return False
    attention = getattr(layer, "self_attn", None)
    taken = inspect.signature(attention.forward).parameters if attention is not None else {}
    return "attention_mask" in taken and taken["attention_mask"].default is inspect.Parameter.empty


def per_layer_inputs(rec: Recorder, s: ModelStructure, tokens: int) -> None:
    """Gemma-4's per-layer embeddings, computed once per step before the layers: the projection of the
    input embeddings to every layer's input (a GEMM, replicated on every rank as plan places it) and the
    token table's rows (one gather). The per-layer rows the layers then gate are in each traced layer."""
    ple = s.per_layer_inputs
    if ple is None:
        return
    width, hidden = s.num_layers * ple.width, s.hidden_size
    rec.analytic(
        "per_layer_inputs(projection)",
        "matmul",
        flops=2 * tokens * hidden * width,
        nbytes=2 * (hidden * width + tokens * (hidden + 2 * width)),
        shapes=f"M{tokens} N{width} K{hidden}",
        attrs={"kernel": "bf16", "batch": 1, "m": tokens, "n": width, "k": hidden},
    )
    gathered = 2 * tokens * width  # bf16 rows read, then written
    rec.analytic(
        "per_layer_inputs(gather)", "vector", flops=tokens * width, nbytes=2 * gathered, compute="vector"
    )
