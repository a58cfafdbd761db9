"""The kernels a serving runtime runs for a multi-head Mamba1 mixer (Zamba's ``ZambaMambaMixer``).

Its inner channels ``I`` are split into ``H`` heads of ``P``; each head is a Mamba1 selective scan of its
own: ``in_proj`` to x and the gate, ``causal_conv1d_fn`` over x, per head ``x_proj`` to dt (rank ``R``),
B and C (``N`` each) and ``dt_proj`` back to the head's channels (batched matmuls over the heads), then
``selective_scan_fn`` in prefill and ``selective_state_update`` in decode: ``7 P N`` per token and head
on the vector units, the state ``[H, P, N]`` in float32. A TP rank runs 1/tp of the heads, each whole
(vLLM has no such mixer; this is how its Mamba1 kernels shard channels). Apart from ``ssm_kernels``
(which dispatches to it) to keep that module under 500 lines.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ....errors import KadaptError
from .deployment import Deployment
from .linear_kernels import Mamba1Scan, RankLinear
from .tracer import Recorder

# ZambaMambaMixer (transformers 5.24): per-head projections are parameters, not nn.Linear modules
MAMBA1_HEADS_FIELDS = ("in_proj", "conv1d", "x_proj_weight", "dt_proj_weight", "out_proj", "A_log", "D")
MAMBA1_HEADS_SIZES = (
    "n_mamba_heads",
    "mamba_head_dim",
    "ssm_state_size",
    "time_step_rank",
    "conv_kernel_size",
)


def is_mamba1_heads(module: nn.Module) -> bool:
    """Whether ``module`` is a multi-head Mamba1 mixer (by its attribute names)."""
    return all(hasattr(module, name) for name in (*MAMBA1_HEADS_FIELDS, *MAMBA1_HEADS_SIZES))


class RankMamba1Heads(Mamba1Scan):
    """A multi-head Mamba1 mixer (``mamba`` of a Zamba layer) as one TP rank runs it: 1/tp of its heads.
    Called as transformers calls the mixer."""

    def __init__(self, inner: nn.Module, rec: Recorder, dep: Deployment, tp: int) -> None:
        super().__init__()
        if not is_mamba1_heads(inner):
            raise KadaptError(
                f"{type(inner).__name__} is not a multi-head Mamba1 mixer kadapt can price: it needs "
                f"{', '.join((*MAMBA1_HEADS_FIELDS, *MAMBA1_HEADS_SIZES))}"
            )
        self.heads, self.width = int(inner.n_mamba_heads) // tp, int(inner.mamba_head_dim)
        self.state_size, self.rank = int(inner.ssm_state_size), int(inner.time_step_rank)
        self.kernel = int(inner.conv_kernel_size)
        self.bc_groups = self.heads  # each head reads its own B and C
        self.in_proj = RankLinear(inner.in_proj, tp, "rows")
        self.out_proj = RankLinear(inner.out_proj, tp, "columns")
        self.x_proj_weight, self.dt_proj_weight = inner.x_proj_weight, inner.dt_proj_weight
        self.bind(rec, dep)

    @property
    def channels(self) -> int:
        """Conv channels on this rank: its heads' x channels (B and C come after the conv)."""
        return self.heads * self.width

    def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        b, s, hidden = hidden_states.shape
        self.in_proj(hidden_states)  # x and the gate z of the rank's channels
        self._record_conv(b, s, hidden)
        x = hidden_states.new_empty(self.heads, b * s, self.width)
        projected = torch.bmm(x, self.x_proj_weight[: self.heads].transpose(1, 2))  # dt, B, C per head
        torch.bmm(projected[..., : self.rank], self.dt_proj_weight[: self.heads].transpose(1, 2))
        self._record_selective_scan(b, s, hidden)
        return self.out_proj(hidden_states.new_empty(b, s, self.channels))

    def _scan_shapes(self, b: int, s: int) -> str:
        return f"B{b} q{s} H{self.heads} P{self.width} N{self.state_size}"
