"""Falcon attention for export: its key and value heads split off by slices.

transformers' ``FalconAttention._split_heads`` takes a multi-query or new-architecture layer's key and
value heads out of the fused projection with Python lists (``fused_qkv[..., [-2], :]``). ``torch.export``
lifts each list into a constant index tensor, and on the meta device kadapt exports from a constant has
no value: neither a weight nor a buffer transformers computes, so no graph can hold it. A slice
(``[..., -2:-1, :]``) selects the same head, keeps its dimension as the list does, and traces to a
``slice`` op with no constant. ``falcon_split_heads_slices`` is upstream's method with exactly that
changed, in every branch (the branch without multi-query attention has no list and stays as it is).
"""

from __future__ import annotations

from typing import Any

import torch


def falcon_split_heads_slices(
    self: Any, fused_qkv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``replace`` impl for ``FalconAttention._split_heads``: query, key and value
    ``[batch, seq, heads, head_dim]`` of ``fused_qkv`` ``[batch, seq, qkv width]``, as upstream splits
    them, with the key and value heads taken by slices instead of list indices."""
    batch, seq_len, _ = fused_qkv.shape
    if self.new_decoder_architecture:
        qkv = fused_qkv.view(batch, seq_len, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
        query = qkv[:, :, :, :-2]
        key = torch.broadcast_to(qkv[:, :, :, -2:-1], query.shape)
        value = torch.broadcast_to(qkv[:, :, :, -1:], query.shape)
        query, key, value = (x.flatten(2, 3) for x in (query, key, value))
        return query, key, value
    if not self.multi_query:
        fused_qkv = fused_qkv.view(batch, seq_len, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]
    fused_qkv = fused_qkv.view(batch, seq_len, self.num_heads + 2, self.head_dim)
    return fused_qkv[..., :-2, :], fused_qkv[..., -2:-1, :], fused_qkv[..., -1:, :]
