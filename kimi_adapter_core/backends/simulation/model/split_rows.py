"""A linear layer sized for a whole tensor-parallel projection it receives 1/TP of (Helium's o_proj),
traced as the row-parallel slice a serving engine holds."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .tracer import Recorder


class SplitRows:
    """A linear layer of a traced layer whose input is a TP-split projection but whose weight spans it
    all: Helium builds its ``o_proj`` ``hidden_size`` wide on the input side, not ``heads x head_dim``,
    so on one rank (1/TP of the heads) it receives 1/TP of the columns it was built for. vLLM's
    ``RowParallelLinear`` holds the rank's 1/TP of the input columns (the bias whole, added once) and
    all-reduces the partial sums; that all-reduce is the sublayer's TP all-reduce ``RankModel.trace``
    already records. So the first call whose input is 1/TP of ``in_features`` wide replaces the weight
    by the rank's ``[out, in / TP]`` slice (the width it runs on is only known when it runs), marked and
    named like the weight it replaces, and the module's own forward runs on it.

    Installed as the module's ``forward`` (an instance attribute shadowing its class's), so hooks and
    op names stay the module's. Any other width runs the module's forward untouched.
    """

    def __init__(self, module: nn.Linear, tp: int, names: dict[int, str]) -> None:
        self.module, self.tp, self.names = module, tp, names
        self.forward = module.forward  # the class's, bound to the module
        self.rec = Recorder()  # bound per trace
        module.forward = self

    def bind(self, rec: Recorder) -> None:
        self.rec = rec

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        weight = self.module.weight
        if (
            isinstance(x, torch.Tensor)
            and x.dim()
            and x.shape[-1] * self.tp == weight.shape[1] != x.shape[-1]
        ):
            self._hold_slice(weight, x.shape[-1])
        return self.forward(x, *args, **kwargs)

    def _hold_slice(self, weight: nn.Parameter, width: int) -> None:
        part = nn.Parameter(
            torch.empty(weight.shape[0], width, dtype=weight.dtype, device=weight.device),
            requires_grad=weight.requires_grad,
        )
        self.module.weight = part
        self.module.in_features = width
        fmt = self.rec.weight_format(weight)
        if fmt is not None:
            self.rec.mark_weight(part, fmt)
        if id(weight) in self.names:
            self.names[id(part)] = self.names.pop(id(weight))


def split_rows(layer: nn.Module, kernels: list[nn.Module], tp: int, names: dict[int, str]) -> list[SplitRows]:
    """A ``SplitRows`` on every ``nn.Linear`` of ``layer`` outside the swapped serving ``kernels`` (which
    split their own projections); none without tensor parallelism."""
    if tp == 1:
        return []
    own = {id(m) for kernel in kernels for m in kernel.modules()}
    return [SplitRows(m, tp, names) for m in layer.modules() if id(m) not in own and isinstance(m, nn.Linear)]
