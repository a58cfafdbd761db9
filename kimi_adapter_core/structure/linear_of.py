"""The linear-attention / SSM mixer a hybrid stack's config describes: gated DeltaNet (Qwen3-Next,
Qwen3.5), KDA (Kimi-Linear, Bailing-hybrid), Mamba2 (Mamba2, Nemotron-H, Granite-4.0-H, Bamba).

Which layers are linear comes from ``derive``'s per-layer spans (``layer_types``, the
``full_attention_interval`` rule, or a raw layout ``layer_pattern`` reads); this reads the sizes their
states follow from. ``MIXERS`` is the table: per kind, the structural fact (``config_keys.yaml``) each
``LinearAttention`` size comes from; the first kind whose facts the config all states is the mixer. A
linear layer no kind sizes keeps some other state, which kadapt refuses rather than guesses.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..errors import KadaptError, Refusal
from ..spec.model import Spec
from .model import LinearAttention


class Reader(Protocol):
    """What this reads of ``derive.Reader``: facts by name, where the config is, the spec."""

    where: str
    spec: Spec | None

    def get(self, fact: str, default: Any = None) -> Any: ...


# Per mixer kind, in the order tried: ``LinearAttention`` size -> the fact it is read from (Mamba2 reads
# its B/C groups as key heads of the state size, ``model.RECURRENT_AXES``).
MIXERS: dict[str, dict[str, str]] = {
    "gated_delta_net": {
        "num_key_heads": "linear_num_key_heads",
        "num_value_heads": "linear_num_value_heads",
        "key_head_dim": "linear_key_head_dim",
        "value_head_dim": "linear_value_head_dim",
        "conv_kernel": "linear_conv_kernel_dim",
    },
    "kda": {
        "num_key_heads": "kda_num_heads",
        "num_value_heads": "kda_num_heads",
        "key_head_dim": "kda_head_dim",
        "value_head_dim": "kda_head_dim",
        "conv_kernel": "linear_conv_kernel_dim",
    },
    "mamba2": {
        "num_key_heads": "mamba_groups",
        "num_value_heads": "mamba_num_heads",
        "key_head_dim": "mamba_state_size",
        "value_head_dim": "mamba_head_dim",
        "conv_kernel": "mamba_conv_kernel",
    },
}
MIXER_NAMES = {"gated_delta_net": "gated-DeltaNet", "kda": "KDA", "mamba2": "Mamba2"}
# A size a config may leave to its class ("auto"): the fact, and how the class computes it
AUTO = "auto"


def linear_of(read: Reader, spans: list[tuple[str, int | None]]) -> LinearAttention | None:
    """The linear layers' mixer (None when every layer is attention), the first of ``MIXERS`` whose
    facts the config states; a linear layer no kind sizes keeps a state kadapt has no kind for
    (``hybrid``)."""
    if all(span != "linear" for span, _ in spans):
        return None
    for kind, sizes in MIXERS.items():
        if all(read.get(fact) is not None for fact in sizes.values()):
            return LinearAttention(kind=kind, **{name: _size(read, fact) for name, fact in sizes.items()})
    wanted = "; ".join(
        f"{MIXER_NAMES[kind]}: {', '.join(_keys(read, fact) for fact in dict.fromkeys(sizes.values()))}"
        for kind, sizes in MIXERS.items()
    )
    raise Refusal(
        "hybrid",
        f"{read.where}: linear_attention layers whose mixer kadapt cannot size; it models a conv window and "
        f"a recurrent state sized by one of these key sets ({wanted}), and this linear attention keeps "
        "other state",
        location=read.spec.locate("gate") if read.spec is not None else None,
    )


def _keys(read: Reader, fact: str) -> str:
    """The config keys a fact is looked up under, as the refusal names them."""
    return "/".join(getattr(read, "candidates", {}).get(fact, [fact]))


def _size(read: Reader, fact: str) -> int:
    """A positive whole size; ``auto`` for Mamba2's head width is what its config class computes."""
    value = read.get(fact)
    if value == AUTO and fact == "mamba_head_dim":
        inner = _size(read, "mamba_expand") * _size(read, "hidden_size")
        heads = _size(read, "mamba_num_heads")
        if inner % heads == 0:
            return inner // heads
        value = f"auto ({inner} inner channels over {heads} heads)"
    whole = isinstance(value, int) and not isinstance(value, bool)
    whole = whole or (isinstance(value, float) and value.is_integer())
    if not whole or value < 1:
        raise KadaptError(f"{read.where}: {_keys(read, fact)} is {value!r}; expected a positive whole number")
    return int(value)
