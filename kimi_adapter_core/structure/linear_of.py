"""The linear-attention mixer a hybrid stack's config describes (gated DeltaNet: Qwen3-Next, Qwen3.5).

Which layers are linear comes from ``derive``'s per-layer spans (``layer_types``, or the
``full_attention_interval`` rule); this reads the sizes their states follow from. A linear layer
whose sizes are not there keeps some other state, which kadapt refuses rather than guesses.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..errors import Refusal
from ..spec.model import Spec
from .model import LinearAttention


class Reader(Protocol):
    """What this reads of ``derive.Reader``: facts by name, where the config is, the spec."""

    where: str
    spec: Spec | None

    def get(self, fact: str, default: Any = None) -> Any: ...

    def require(self, fact: str) -> Any: ...


# What sizes a gated-DeltaNet layer's states, by structural fact (``LinearAttention`` field)
LINEAR_FACTS = {
    "num_key_heads": "linear_num_key_heads",
    "num_value_heads": "linear_num_value_heads",
    "key_head_dim": "linear_key_head_dim",
    "value_head_dim": "linear_value_head_dim",
    "conv_kernel": "linear_conv_kernel_dim",
}


def linear_of(read: Reader, spans: list[tuple[str, int | None]]) -> LinearAttention | None:
    """The linear layers' mixer (None when every layer is attention), from the gated-DeltaNet sizes; a
    linear layer without them is a linear attention kadapt has no state kind for (``hybrid``)."""
    if all(span != "linear" for span, _ in spans):
        return None
    missing = [key for key in LINEAR_FACTS.values() if read.get(key) is None]
    if missing:
        raise Refusal(
            "hybrid",
            f"{read.where}: linear_attention layers without {', '.join(missing)}: "
            "kadapt models gated-DeltaNet linear attention (a conv window and a recurrent state sized by "
            "those keys); this linear attention keeps other state",
            location=read.spec.locate("gate") if read.spec is not None else None,
        )
    return LinearAttention(
        kind="gated_delta_net", **{name: int(read.require(fact)) for name, fact in LINEAR_FACTS.items()}
    )
