"""Multi-head latent attention (MLA) helpers for export.

transformers' ``DeepseekV3Attention.expand_kv`` builds the per-head key with ``new_empty`` and two
``copy_`` calls into slices of it. Exported, that is an in-place write into views: the graph is not
functional and an IR executor that runs ops one by one sees an uninitialised buffer. The builtin
below computes the same tensors with ``torch.cat``.
"""

from __future__ import annotations

from typing import Any

import torch


def mla_expand_kv_functional(
    self: Any, kv_nope: torch.Tensor, k_rot: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``replace`` impl for ``DeepseekV3Attention.expand_kv``: same result, no in-place writes.

    ``kv_nope`` is the compressed latent ``[B, 1, S, kv_lora_rank]``, ``k_rot`` the shared rope key
    ``[B, 1, S, qk_rope_head_dim]``. Returns per-head key ``[B, H, S, qk_nope + qk_rope]`` and value
    ``[B, H, S, v_head_dim]``, exactly as upstream (key = ``cat(k_nope, k_rot broadcast to H)``).
    """
    batch_size, _, seq_length, _ = kv_nope.shape
    kv = self.kv_b_proj(kv_nope).view(batch_size, seq_length, -1, self.qk_nope_head_dim + self.v_head_dim)
    kv = kv.transpose(1, 2)
    k_nope, value_states = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
    return torch.cat((k_nope, k_rot), dim=-1), value_states
