"""What a hybrid or DSA stack keeps per request besides its KV cache: a linear layer's state, a DSA
layer's indexer keys (``KvSizing`` holds them; the plan report states them)."""

from __future__ import annotations

from dataclasses import dataclass

from ....structure.mixer import LinearAttention
from ....structure.model import Indexer
from ....structure.states import ConvState, RecurrentState
from ..model.quant import DTYPE_BYTES, INDEX_REFERENCE_DTYPE, index_key_bytes

STATE_CONV_DTYPE = "bf16"  # the conv window is kept in the model dtype (vLLM's mamba cache "auto")


@dataclass(frozen=True)
class LinearStateSizing:
    """What each linear-attention layer of a hybrid stack keeps per request: its conv window (in the
    model dtype) and recurrent state (float32 whatever the KV dtype: ``structure.states``), constant
    in the context length. Under TP both split with the heads, as vLLM shards the layer."""

    linear: LinearAttention
    layers: int
    tp: int

    def conv(self, *, per_rank: bool = True) -> ConvState | None:
        """The conv window (None: a mixer without one, MiniMax's lightning attention)."""
        whole = self.linear.conv
        if whole is None:
            return None
        return ConvState(whole.channels // (self.tp if per_rank else 1), whole.kernel)

    def recurrent(self, *, per_rank: bool = True) -> RecurrentState | None:
        """The recurrent state (None: a mixer without one, LFM2's short convolution)."""
        whole = self.linear.recurrent
        if whole is None:
            return None
        heads, *dims = whole.shape()
        return RecurrentState((heads // (self.tp if per_rank else 1), *dims), whole.dtype)

    def bytes_per_layer(self, *, per_rank: bool = True) -> int:
        states = (self.conv(per_rank=per_rank), self.recurrent(per_rank=per_rank))
        return sum(s.bytes_per_request(DTYPE_BYTES[STATE_CONV_DTYPE]) for s in states if s is not None)

    def bytes_per_request(self, *, per_rank: bool = True) -> int:
        return self.layers * self.bytes_per_layer(per_rank=per_rank)


@dataclass(frozen=True)
class IndexKeySizing:
    """The DSA indexer keys of a DeepSeek-V3.2 stack: one ``head_dim`` key per token in each indexed
    layer, beside its KV cache, growing with the context like it. The indexer is replicated over TP
    (vLLM and SGLang build it of ``ReplicatedLinear``s), so every rank caches every key."""

    indexer: Indexer
    layers: int

    @property
    def bytes_per_token_layer(self) -> int:
        """FP8 keys plus their fp32 block scales (128 + 4 B for DeepSeek-V3.2's 128-wide keys)."""
        return index_key_bytes(self.indexer.head_dim)

    @property
    def reference_bytes_per_token_layer(self) -> int:
        """What transformers' reference (and kadapt's extraction ABI) keeps: the model dtype, no scale."""
        return self.indexer.bytes_per_token(DTYPE_BYTES[INDEX_REFERENCE_DTYPE])

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_layer * self.layers

    def bytes(self, tokens: int) -> int:
        """The keys of a sequence of ``tokens`` (the same on every TP rank: replicated)."""
        return tokens * self.bytes_per_token
