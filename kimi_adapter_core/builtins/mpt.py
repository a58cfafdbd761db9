"""MPT attention for export: its ALiBi bias taken by the key length alone, its mask additive or boolean.

transformers' ``MptAttention.forward`` slices the stack's ALiBi bias ``[heads, 1, max_seq_len]`` (built
once per call by ``MptModel.build_mpt_alibi_tensor``, handed every layer as ``position_bias``) with
``max(0, position_bias.size(1) - query_length)``, where ``query_length`` adds ``cache.get_seq_length()``:
kadapt's static cache answers each decode row's own position as a ``[B]`` tensor (rows at different
positions), which a Python ``max`` cannot compare. The bias has one query row, so that index is 0 for
any query length: ``mpt_attention_forward`` takes the bias's last ``key_length`` columns alone, as
upstream's key index does. And ``MptModel.forward`` hands its layers a boolean mask (True: hidden), which
upstream fills with the dtype's minimum; the ABI's wrappers hand an additive one (0 or the minimum),
which this adds, the same scores wherever a key is visible. Everything else is upstream's, line for line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def mpt_attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_bias: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``replace`` impl for ``MptAttention.forward``: upstream's attention, with the bias sliced by the
    key length alone and an additive mask added (a boolean one filled, as upstream does)."""
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)  # 5.23's keyword
    batch_size, seq_length = hidden_states.shape[:2]
    mixed_qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed_qkv = mixed_qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query_states, key_states, value_states = mixed_qkv.chunk(3, dim=2)
    query_states = query_states.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
    key_states = key_states.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
    value_states = value_states.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    attention_scores = torch.matmul(query_states, key_states.transpose(-1, -2)) * self.softmax_scale
    if position_bias is not None:
        if len(position_bias.shape) != 3:
            shape = len(position_bias.shape)
            raise ValueError(f"Expecting position_bias shape to be 3 dimensions, got {shape}")
        key_length = key_states.shape[-2]
        key_index = max(0, position_bias.size(2) - key_length)
        attention_scores = attention_scores + position_bias[:, :, key_index:]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_scores = attention_scores.masked_fill(attention_mask, torch.finfo(query_states.dtype).min)
    elif attention_mask is not None:
        attention_scores = attention_scores + attention_mask
    attn_weights = nn.functional.softmax(attention_scores.float(), dim=-1).to(value_states.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=self.attn_dropout_p, training=self.training)
    context_states = torch.matmul(attn_weights, value_states)
    context_states = context_states.permute(0, 2, 1, 3).contiguous().view(batch_size, seq_length, -1)
    return self.out_proj(context_states), attn_weights
