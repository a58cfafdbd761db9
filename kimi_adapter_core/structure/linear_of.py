"""The linear-attention / SSM mixer a hybrid stack's config describes: gated DeltaNet (Qwen3-Next,
Qwen3.5), KDA (Kimi-Linear, Bailing-hybrid), Mamba2 (Mamba2, Nemotron-H, Granite-4.0-H, Bamba), Mamba1
(Mamba, Falcon-Mamba, Jamba: a state per inner channel), lightning attention (MiniMax-Text-01: no conv
window, a recurrent state alone), a gated short convolution (LFM2, LFM3: a conv window alone).

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
from .bounds import shown
from .mixer import LinearAttention


class Reader(Protocol):
    """What this reads of ``derive.Reader``: facts by name, where the config is, the spec."""

    where: str
    origin: str
    prefix: str
    spec: Spec | None

    def get(self, fact: str, default: Any = None) -> Any: ...

    def peek(self, fact: str) -> tuple[str, Any] | None: ...


# Sizes no config key states, computed as the config classes compute them: a constant 1, and Mamba1's
# inner channels (``MambaConfig.intermediate_size``, Jamba's mamba_expand x hidden_size)
ONE = "one"
MAMBA_CHANNELS = "mamba_channels"
MAMBA_HEAD_WIDTH = "mamba_head_width"  # a multi-head Mamba1's channels per head (Zamba's mamba_head_dim)
DERIVED = {
    ONE: (),
    MAMBA_CHANNELS: ("mamba_expand", "hidden_size"),
    MAMBA_HEAD_WIDTH: ("mamba_expand", "hidden_size", "mamba_num_heads"),
}

# Spans whose layers run a linear mixer: ``linear`` alone, ``hybrid`` with full attention (Falcon-H1: side
# by side; Zamba: a shared block, then the mixer)
MIXED_SPANS = ("linear", "hybrid")

# Per mixer kind, in the order tried: ``LinearAttention`` size -> the fact it is read from (Mamba2 reads
# its B/C groups as key heads of the state size, ``mixer.RECURRENT_AXES``).
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
    # Mamba1's selective scan (no SSM heads): one B/C group of the state size, and each of its
    # expand x hidden inner channels a one-wide head (``mixer.VALUE_CONV_KINDS``: its conv sees them alone)
    "mamba1": {
        "num_key_heads": ONE,
        "num_value_heads": MAMBA_CHANNELS,
        "key_head_dim": "mamba_state_size",
        "value_head_dim": ONE,
        "conv_kernel": "mamba_conv_kernel",
        "dt_rank": "mamba_dt_rank",
    },
    # Zamba's multi-head Mamba1 (``ZambaMambaMixer``): its inner channels split into SSM heads, each a
    # Mamba1 scan of its own (its own x and dt projections, one B/C group of the state size); the conv
    # sees the channels alone, the state is [heads, head width, state size]
    "mamba1_heads": {
        "num_key_heads": ONE,
        "num_value_heads": "mamba_num_heads",
        "key_head_dim": "mamba_state_size",
        "value_head_dim": MAMBA_HEAD_WIDTH,
        "conv_kernel": "mamba_conv_kernel",
        "dt_rank": "mamba_dt_rank",
    },
    # LFM2's gated short convolution (``Lfm2ShortConv``): a depthwise conv over the hidden channels,
    # read as one-wide value heads (``mixer.VALUE_CONV_KINDS``); no recurrent state
    "short_conv": {
        "num_key_heads": ONE,
        "num_value_heads": "hidden_size",
        "key_head_dim": ONE,
        "value_head_dim": ONE,
        "conv_kernel": "short_conv_kernel",
    },
    # MiniMax's lightning attention: the attention's own heads and width (``head_dim``, else hidden /
    # heads as MiniMaxLightningAttention computes it); no conv window; its prefill block (which sizes its
    # decay buffers) is what tells it apart from any attention's sizes
    "lightning": {
        "num_key_heads": "num_heads",
        "num_value_heads": "num_heads",
        "key_head_dim": "head_dim",
        "value_head_dim": "head_dim",
        "block_size": "lightning_block_size",
    },
}
MIXER_NAMES = {
    "gated_delta_net": "gated-DeltaNet",
    "kda": "KDA",
    "mamba2": "Mamba2",
    "mamba1": "Mamba1",
    "mamba1_heads": "multi-head Mamba1",
    "short_conv": "short convolution",
    "lightning": "lightning",
}
# Facts a kind's config must not state: a Mamba1 scan is a state size without SSM heads (with heads,
# Mamba2 sized it, or its key set is incomplete and the refusal names it)
ABSENT: dict[str, tuple[str, ...]] = {"mamba1": ("mamba_num_heads",), "mamba1_heads": ("mamba_groups",)}
# A size a config may leave to its class ("auto": Mamba2's head width, Mamba1's dt rank); ``_size``
# computes it as the class does
AUTO = "auto"


def linear_of(read: Reader, spans: list[tuple[str, int | None]]) -> LinearAttention | None:
    """The linear layers' mixer (None when every layer is attention), the first of ``MIXERS`` whose
    facts the config states; a linear layer no kind sizes keeps a state kadapt has no kind for
    (``hybrid``)."""
    if all(span not in MIXED_SPANS for span, _ in spans):
        return None
    for kind, sizes in MIXERS.items():
        stated = all(_stated(read, fact) for fact in _needed(kind))
        if stated and not any(_stated(read, fact) for fact in ABSENT.get(kind, ())):
            gated = read.get("mamba_gated_norm") is not False or kind != "mamba2"  # Falcon-H1's switch
            sizes_read = {name: _size(read, fact) for name, fact in sizes.items()}
            return LinearAttention(kind=kind, **sizes_read, gated_norm=gated)
    location = read.spec.locate("gate") if read.spec is not None else None
    near = _nearest_mixer(read)
    if near is not None:
        kind, missing = near
        raise Refusal(
            "hybrid",
            f"{read.origin}: the linear_attention layers state {MIXER_NAMES[kind]}'s sizes but not "
            + ", ".join(_keys(read, fact) for fact in missing)
            + f" (a {MIXER_NAMES[kind]} mixer is sized by "
            + ", ".join(_keys(read, fact) for fact in _needed(kind))
            + ")",
            location=location,
        )
    wanted = "; ".join(
        f"{MIXER_NAMES[kind]}: " + ", ".join(_keys(read, fact) for fact in _needed(kind)) for kind in MIXERS
    )
    raise Refusal(
        "hybrid",
        f"{read.origin}: linear_attention layers whose mixer kadapt cannot size; it models a conv window and "
        f"a recurrent state sized by one of these key sets ({wanted}), and this linear attention keeps "
        "other state",
        location=location,
    )


# Facts any attention config states, which say nothing of which mixer a config meant
ANY_ATTENTION = frozenset({"num_heads", "head_dim", "hidden_size"})


def _nearest_mixer(read: Reader) -> tuple[str, list[str]] | None:
    """The mixer whose own facts the config states most of (at least one, not all), and the facts it
    lacks: a config that names gated DeltaNet's key heads but not its value heads lacks a key, it is
    not another kind of linear attention."""
    candidates = getattr(read, "candidates", {})
    generic = {key for fact in ANY_ATTENTION for key in candidates.get(fact, [fact])}
    best: tuple[float, str, list[str]] | None = None
    for kind in MIXERS:
        own = [fact for fact in _needed(kind) if fact not in ANY_ATTENTION]
        # stated under a key of its own (Mamba2's head width read from a plain head_dim says nothing)
        stated = [fact for fact in own if (read.peek(fact) or ("", None))[0] not in generic | {""}]
        if not stated or len(stated) == len(own):
            continue
        share = len(stated) / len(own)
        if best is None or share > best[0]:
            best = (share, kind, [fact for fact in _needed(kind) if not _stated(read, fact)])
    return None if best is None else (best[1], best[2])


def _needed(kind: str) -> tuple[str, ...]:
    """The config facts a kind needs stated: its sizes' (a derived size's inputs)."""
    facts: list[str] = []
    for fact in MIXERS[kind].values():
        facts += DERIVED.get(fact, (fact,))
    return tuple(dict.fromkeys(facts))


def _keys(read: Reader, fact: str) -> str:
    """The config keys a fact is looked up under, as the refusal names them."""
    return "/".join(getattr(read, "candidates", {}).get(fact, [fact]))


def _stated(read: Reader, fact: str) -> bool:
    """The config states ``fact`` (``head_dim`` may be left to hidden_size / heads)."""
    if fact == "head_dim":
        return read.get("head_dim") is not None or read.get("hidden_size") is not None
    return read.get(fact) is not None


def _size(read: Reader, fact: str) -> int:
    """A positive whole size; ``auto`` for Mamba2's head width is what its config class computes, an
    unstated ``head_dim`` hidden_size / heads, a ``DERIVED`` size as its config class computes it."""
    if fact == ONE:
        return 1
    if fact == MAMBA_CHANNELS:
        return _size(read, "mamba_expand") * _size(read, "hidden_size")
    if fact == MAMBA_HEAD_WIDTH:  # ZambaConfig checks the heads split the channels
        return _size(read, MAMBA_CHANNELS) // _size(read, "mamba_num_heads")
    value = read.get(fact)
    if value is None and fact == "head_dim":
        hidden, heads = _size(read, "hidden_size"), _size(read, "num_heads")
        if hidden % heads == 0:
            return hidden // heads
        value = f"unstated ({hidden} hidden over {heads} heads)"
    if value == AUTO and fact == "mamba_dt_rank":  # MambaConfig's and JambaConfig's ceil(hidden / 16)
        return -(-_size(read, "hidden_size") // 16)
    if value == AUTO and fact == "mamba_head_dim":  # Falcon-H1 states its inner width (mamba_d_ssm)
        inner = _size(read, "mamba_inner") if _stated(read, "mamba_inner") else _size(read, MAMBA_CHANNELS)
        heads = _size(read, "mamba_num_heads")
        if inner % heads == 0:
            return inner // heads
        value = f"auto ({inner} inner channels over {heads} heads)"
    whole = isinstance(value, int) and not isinstance(value, bool)
    whole = whole or (isinstance(value, float) and value.is_integer())
    if not whole or value < 1:
        found = read.peek(fact)
        key = read.prefix + found[0] if found is not None else _keys(read, fact)
        raise KadaptError(f"{read.origin}: {key}: expected a positive whole number, found {shown(value)}")
    return int(value)
