"""What a linear-attention layer keeps between steps, one small class per state kind (issue 36).

An attention layer's KV cache grows with the context (``Attention.kv_dims`` sizes it per token). A
linear-attention / SSM mixer instead keeps a short convolution window (``ConvState``) and a
recurrent state (``RecurrentState``; MiniMax's lightning attention only that): one fixed-size slot
per request however long it runs, the way
vLLM's ``kv_cache_interface`` has a Mamba state spec beside its attention specs and transformers'
``cache_utils`` a ``LinearAttentionLayer`` beside ``DynamicLayer``. Each class knows its shape per
request and its bytes; ``plan`` sizes the states from them and the extraction checks the layers hand
over exactly these shapes. The runtime rules for carrying them (initial value, prefill to decode,
ragged rows, paging, finished and joining requests) are in the state mapping's contract
(``runtime/abi.py`` ``LINEAR_STATE_RULES``). Torch-free: dtypes are names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ConvState:
    """A causal depthwise convolution's input window, ``[channels, kernel]`` per request, in the ABI
    dtype (transformers' ``LinearAttentionLayer.conv_states``: the last ``kernel`` tokens' inputs)."""

    channels: int
    kernel: int

    def shape(self) -> tuple[int, ...]:
        return (self.channels, self.kernel)

    def bytes_per_request(self, abi_dtype_bytes: int) -> int:
        return self.channels * self.kernel * abi_dtype_bytes


@dataclass(frozen=True)
class RecurrentState:
    """A linear-attention recurrent state of fixed shape per request (gated DeltaNet: ``[value_heads,
    key_dim, value_dim]``), kept in ``dtype`` whatever the ABI dtype: transformers' reference scans
    accumulate it in float32. ``dtype`` None: the ABI dtype (MiniMax's lightning attention keeps its
    state in its values' dtype, ``MiniMaxLightningAttention.forward``)."""

    dims: tuple[int, ...]
    dtype: str | None = "float32"

    def shape(self) -> tuple[int, ...]:
        return self.dims

    def dtype_in(self, abi_dtype: str) -> str:
        """The state's dtype in a model whose ABI dtype is ``abi_dtype``."""
        return abi_dtype if self.dtype is None else self.dtype

    def bytes_per_request(self, abi_dtype_bytes: int) -> int:
        width = abi_dtype_bytes if self.dtype is None else DTYPE_BYTES[self.dtype]
        return math.prod(self.dims) * width
