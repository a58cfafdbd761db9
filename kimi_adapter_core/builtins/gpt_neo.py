"""GPT-Neo attention scores for export: each row's local window counted over the keys its mask shows it.

transformers' ``GPTNeoSelfAttention._attn`` limits the scores by a boolean buffer of its own, ``bias``
``[1, 1, max_positions, max_positions]`` (lower-triangular; a local layer's keeps only the last
``window_size`` keys of each row), sliced ``[key_length - query_length : key_length, :key_length]``: it
assumes the query rows are the last ``query_length`` positions of a cache holding exactly
``key_length`` keys. Over kadapt's static cache the key length is the cache's capacity and each row
sits at its own position, so the slice would give a decode row the window of the cache's last slot,
not its own. Given a mask, ``gpt_neo_attn`` adds it (it already hides each row's future keys) and, on a
local layer, keeps of the keys it shows a row the last ``window_size``: a key with ``window_size`` or
more visible keys after it is hidden. On a row whose visible keys are its own prefix (the model's
causal mask, the ABI's mask for any row) that is the buffer's window, ``i - j < window_size``. Without a
mask it is upstream's slice. Everything else is upstream's, line for line (float32 scores, softmax,
dropout).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def gpt_neo_attn(
    self: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``replace`` impl for ``GPTNeoSelfAttention._attn``: upstream's scores, each row's causal prefix
    and local window read from ``attention_mask`` (additive, or boolean True: visible) rather than from
    the ``bias`` buffer's slice, which stays the limit only when no mask is given."""
    query = query.to(torch.float32)
    key = key.to(torch.float32)
    attn_weights = torch.matmul(query, key.transpose(-1, -2))
    minimum = torch.finfo(attn_weights.dtype).min
    if attention_mask is None:
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        attn_weights = torch.where(causal_mask, attn_weights, minimum)
    else:
        boolean = attention_mask.dtype == torch.bool
        visible = attention_mask if boolean else attention_mask == 0
        if self.attention_type == "local":
            shown = visible.to(torch.int32)
            after = shown.flip(-1).cumsum(-1).flip(-1) - shown  # visible keys after each key, per row
            visible = visible & (after < self.config.window_size)
        attn_weights = torch.where(visible, attn_weights, minimum)
        if not boolean:
            attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = attn_weights.to(value.dtype)
    attn_weights = self.attn_dropout(attn_weights)
    return torch.matmul(attn_weights, value), attn_weights
