"""Rotary-embedding argument fixes (TensorCast's P14)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def rotary_seq_len_as_int(
    original: Callable[..., Any], self: Any, x: torch.Tensor, seq_len: Any = None, *args: Any, **kwargs: Any
) -> Any:
    """``wrap`` impl for remote ``RotaryEmbedding.forward(x, seq_len)``: make ``seq_len`` an int.

    Traced callers pass ``seq_len`` as a 0-d tensor; upstream compares it with Python ints to grow
    its cos/sin cache, which is data-dependent control flow. A real tensor becomes its value; a meta
    tensor (no value) becomes ``self.max_seq_len_cached``, the full cached table.
    """
    if isinstance(seq_len, torch.Tensor):
        seq_len = int(self.max_seq_len_cached) if seq_len.device.type == "meta" else int(seq_len.item())
    return original(self, x, seq_len, *args, **kwargs)
