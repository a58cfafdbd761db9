"""Hybrid layers that run one of a few transformer blocks shared across the stack (Zamba, Zamba2).

A ``hybrid`` layer of such a stack runs shared block ``j % count`` (``j``: its rank among the hybrid
layers) over the current hidden states concatenated with the stack's input embeddings (Zamba2: with
LoRA adapters of its own), projects the block's output with a linear layer of its own and feeds the sum
to its own mixer (Zamba2: Mamba2; Zamba: a multi-head Mamba1); the other layers are the mixer alone,
with no MLP. Its state is a KV cache (the shared block's attention, cached per hybrid layer) and the
mixer's conv window and recurrent state: the ABI kind ``hybrid``. The rule is data per model type
(``config_keys.yaml`` ``shared_blocks``), so a config object and its JSON describe one structure; a
``hybrid`` layer type elsewhere stays refused, but for Falcon-H1's (``hybrid_layer_type``).
"""

from __future__ import annotations

from typing import Any

from ..errors import KadaptError, Refusal
from .model import ModelStructure, SharedBlocks
from .reader import Reader, locate, tables


def shared_blocks_rule(model_type: Any) -> dict[str, Any] | None:
    """The model type's shared-block rule (``config_keys.yaml`` ``shared_blocks``), or None."""
    return tables()["shared_blocks"].get(model_type)


def modelled_hybrid_keys(model_type: Any) -> tuple[str, ...]:
    """The ``hybrid_keys`` the model type's shared-block rule models (not refused)."""
    rule = shared_blocks_rule(model_type)
    return tuple(rule["hybrid_keys"]) if rule is not None else ()


def class_derived_keys(model_type: Any) -> tuple[str, ...]:
    """The keys the model type's config class derives from the others (the rule's ``derived``)."""
    rule = shared_blocks_rule(model_type)
    return tuple(rule["derived"]) if rule is not None else ()


def hybrid_layer_type(model_type: Any) -> dict[str, str]:
    """``{layer type: "hybrid"}`` for a model type with a rule for its hybrid layers, else ``{}``: its
    shared-block rule's type (Zamba, Zamba2), or the type its config class gives every layer where that
    is ``hybrid`` (``uniform_layer_types``: Falcon-H1, attention and Mamba2 side by side). Elsewhere the
    type stays refused (``hybrid_layer_types``)."""
    rule = shared_blocks_rule(model_type)
    if rule is not None:
        return {rule["layer_type"]: "hybrid"}
    uniform = tables()["uniform_layer_types"].get(model_type)
    return {uniform: "hybrid"} if uniform == "hybrid" else {}


def shared_blocks_of(read: Reader, spans: list[tuple[str, int | None]]) -> SharedBlocks | None:
    """The stack's shared blocks (None: not a shared-block family, or no hybrid layer). Refused when the
    config lists no layer types (the class would build them); a located error when its block count or
    adapter rank is not a whole number (at least 1, and 0)."""
    rule = shared_blocks_rule(read.raw("model_type"))
    if rule is None:
        return None
    if read.get("layer_types") is None:  # Zamba's class builds its list with first layers of its own
        raise Refusal(
            "layer-types",
            f"{read.where} lists no {'/'.join(read.candidates['layer_types'])}: which layers are hybrid "
            f"is what its config class builds when none is listed, which kadapt does not guess; state "
            "the list",
            location=locate(read.spec, "gate"),
        )
    if all(span != "hybrid" for span, _ in spans):
        return None
    sizes = {}
    for name, least in (("count", 1), ("adapter_rank", 0)):
        key = rule[name]  # a config key, or the family's fixed number
        value = key if isinstance(key, int) else read.raw(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise KadaptError(f"{read.where}: {key} is {value!r}; expected a whole number >= {least}")
        sizes[name] = value
    adapters = rule["attention_adapters"]
    return SharedBlocks(
        count=sizes["count"],
        adapter_rank=sizes["adapter_rank"],
        attention_adapters=adapters is not None and read.raw(adapters) is True,
        input_width=int(rule["input_width"]),
    )


def mlp_kinds(
    blocks: SharedBlocks | None, spans: list[tuple[str, int | None]], kinds: list[str]
) -> list[str]:
    """Per layer the MLP kind: in a shared-block stack only the hybrid layers have one (the shared
    block's), the mixer layers none; elsewhere ``kinds`` as derived."""
    if blocks is None:
        return kinds
    return [kind if span == "hybrid" else "none" for (span, _), kind in zip(spans, kinds, strict=True)]


def reusing_prefix(structure: ModelStructure) -> int:
    """Layers a shortened stack keeps so that one of its shared blocks serves two hybrid layers: up to the
    first hybrid layer that reuses a block (transformers cannot tie Zamba's one block in a stack with a
    single hybrid layer); 0 for other stacks, or when no block is reused."""
    blocks = structure.shared_blocks
    hybrid = [layer.index for layer in structure.layers if layer.attention == "hybrid"]
    if blocks is None or len(hybrid) <= blocks.count:
        return 0
    return hybrid[blocks.count] + 1
