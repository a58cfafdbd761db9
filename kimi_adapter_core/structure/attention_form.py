"""An attention whose projections are not q/k/v/o: DeepSeek-V4's shared-KV multi-query attention.

transformers 5.24's ``DeepseekV4Attention`` projects the query through a low-rank residual
(``q_a_proj`` -> ``q_a_norm`` -> ``q_b_proj``, then an unweighted per-head norm), projects **one** KV head
(``kv_proj`` -> ``kv_norm``) that is both key and value (``cache.update(kv, kv)``), adds a learned sink
logit per head (``sinks``), rotates the last ``qk_rope_head_dim`` channels of each head interleaved and
de-rotates the output's, and projects the output through ``o_groups`` groups of heads, each to
``o_lora_rank`` (``o_a_proj``), mixed back to the hidden size (``o_b_proj``). Which model types build it
is a property of their code (``config_keys.yaml`` ``attention_forms``); the sizes are config keys.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from .reader import tables


class Reader(Protocol):
    def raw(self, key: str) -> Any: ...

    def require(self, fact: str) -> Any: ...


@dataclass(frozen=True)
class AttentionForm:
    """The shared-KV attention's sizes. The ABI still carries a key and a value state (the same
    values): ``value_is_key`` says so, so a runtime may store one."""

    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    value_is_key: bool = True
    sinks: bool = True

    def describe(self) -> str:
        return (
            f"shared key/value head, q_lora_rank {self.q_lora_rank}, rope on the last "
            f"{self.qk_rope_head_dim} channels (interleaved), {'sinks, ' if self.sinks else ''}output in "
            f"{self.o_groups} groups of rank {self.o_lora_rank}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def attention_form_of(read: Reader, head_dim: int) -> AttentionForm | None:
    """The form ``attention_forms`` gives the config's model type (None: q/k/v/o projections). The rope
    width is ``head_dim x partial_rotary_factor`` where the config has the factor, as
    ``DeepseekV4Config`` derives it (its ``qk_rope_head_dim`` key is read only without one)."""
    form = tables()["attention_forms"].get(read.raw("model_type"))
    if form is None:
        return None
    sizes = {name: int(read.require(name)) for name in ("q_lora_rank", "o_groups", "o_lora_rank")}
    factor = read.raw("partial_rotary_factor")
    number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    rope = int(head_dim * factor) if number else int(read.require("qk_rope_head_dim"))
    return AttentionForm(
        **sizes, qk_rope_head_dim=rope, value_is_key=bool(form["value_is_key"]), sinks=bool(form["sinks"])
    )
