"""Traceable stand-ins for MoE code that dispatches on data (TensorCast's P7 and P8).

Upstream remote MoE blocks route tokens with ``.cpu().numpy()`` counts and a per-expert Python
loop, and their gates may sample. Neither can be traced. A simulation backend swaps in its own MoE
module and only needs the original block to be inert and the routing to be deterministic.
"""

from __future__ import annotations

from typing import Any

import torch


def moe_zeros(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``replace`` impl for ``MoE.forward`` / ``moe_infer``: zeros shaped like the first input.

    The block contributes nothing; the backend's module swap supplies the real MoE computation.
    """
    return torch.zeros_like(hidden_states)


def moe_gate_uniform(
    self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, ...]:
    """``replace`` impl for a top-k gate: deterministic round-robin experts, weight ``1/top_k`` each.

    Token ``t`` gets experts ``(t*k + j) mod E`` for ``j < k``, so load is spread evenly across
    experts (what a roofline model assumes) and the result does not depend on the data. Returns
    ``(topk_idx [T, k] int64, topk_weight [T, k])`` like the upstream gate; reads ``self.top_k``
    and ``self.n_routed_experts``.
    """
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0]
    top_k, experts = int(self.top_k), int(self.n_routed_experts)
    device = hidden_states.device
    index = (
        torch.arange(tokens, device=device)[:, None] * top_k + torch.arange(top_k, device=device)
    ) % experts
    weight = torch.full((tokens, top_k), 1.0 / top_k, dtype=hidden_states.dtype, device=device)
    return index, weight
