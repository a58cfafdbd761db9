"""A norm that spans a whole tensor-parallel projection (OLMoE's q/k norm), traced on the rank's slice
with its statistics all-reduced across the TP group."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .tracer import Recorder

# The per-row statistics a norm computes and which ops compute them: a decomposed RMSNorm's mean of
# squares, a LayerNorm's mean and variance (fused kernels included). Over a TP-split projection each
# rank computes them over its columns and the ranks all-reduce them, one fp32 value per row each.
_STATISTICS = {
    "mean": 1,
    "sum": 1,
    "var": 1,
    "std": 1,
    "var_mean": 2,
    "std_mean": 2,
    "linalg_vector_norm": 1,
    "norm": 1,
    "native_layer_norm": 2,
    "_fused_rms_norm": 1,
}


class SplitNorm:
    """A norm of a traced layer that may span a whole tensor-parallel projection.

    OLMoE's ``q_norm`` / ``k_norm`` normalise all heads of q / k at once (a weight ``hidden_size``
    wide) while the rank holds 1/TP of the projection's columns, so the built module's weight is TP
    times wider than what it runs on. A TP engine keeps the rank's slice of the weight, computes the
    norm's statistics (the sum of squares) over its own columns and all-reduces them across the TP
    group, one fp32 value per row, before normalising. That is what is traced: the first call that
    runs on 1/TP of the weight's width replaces the module's parameters of that width by the rank's
    slice (the width it runs on is only known when it runs), then the module's own forward runs on
    it and the all-reduce is recorded right after the op that computed the statistics (an
    elementwise module, with no statistics, needs no collective).

    Installed as the module's ``forward`` (an instance attribute shadowing its class's), so hooks and
    op names stay the module's. A call at the weight's own width runs the module's forward untouched
    and records exactly what it did before; any other width runs it too, and the shape error it
    raises is reported by ``RankModel.trace`` with the module and the shapes.
    """

    def __init__(self, module: nn.Module, tp: int, names: dict[int, str]) -> None:
        self.module, self.tp, self.names = module, tp, names
        self.forward = module.forward  # the class's, bound to the module
        self.split = False
        self.rec = Recorder()  # bound per trace
        module.forward = self

    def bind(self, rec: Recorder) -> None:
        self.rec = rec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return self.forward(*args, **kwargs)
        width, held = x.shape[-1], self.module.weight.numel()
        if not self.split and self.tp > 1 and width * self.tp == held:
            self._hold_slice(held, width)
        if not self.split or width != self.module.weight.numel():
            return self.forward(*args, **kwargs)
        start = len(self.rec.ops)
        out = self.forward(*args, **kwargs)
        self._all_reduce_statistics(start, x.numel() // width)
        return out

    def _all_reduce_statistics(self, start: int, rows: int) -> None:
        """Record the all-reduce of the statistics the ops from ``start`` on computed, right after the
        first of them (none computed: an elementwise module, no collective)."""
        ops = self.rec.ops
        found = [(i, _STATISTICS[ops[i].name]) for i in range(start, len(ops)) if ops[i].name in _STATISTICS]
        if found:
            nbytes = rows * 4 * sum(n for _, n in found)  # fp32 per row and statistic
            comm = {"collective": "all_reduce", "bytes": nbytes, "group": self.tp}
            self.rec.analytic("tp_all_reduce(norm_statistics)", "comm", comm=comm, at=found[0][0] + 1)

    def _hold_slice(self, held: int, width: int) -> None:
        """Replace the module's parameters ``held`` wide by the rank's ``width`` of them, marked in the
        recorder and named like the ones they replace (the next traces bind them alike)."""
        for name, param in list(self.module.named_parameters(recurse=False)):
            if param.dim() != 1 or param.numel() != held:
                continue
            part = nn.Parameter(
                torch.empty(width, dtype=param.dtype, device=param.device), requires_grad=param.requires_grad
            )
            setattr(self.module, name, part)
            fmt = self.rec.weight_format(param)
            if fmt is not None:
                self.rec.mark_weight(part, fmt)
            if id(param) in self.names:
                self.names[id(part)] = self.names.pop(id(param))
        self.split = True


def split_norms(
    layer: nn.Module, kernels: list[nn.Module], tp: int, names: dict[int, str]
) -> list[SplitNorm]:
    """A ``SplitNorm`` on every norm-like module of ``layer`` (a ``weight`` and 1-D parameters only)
    outside the swapped serving ``kernels``, which split their own modules."""
    own = {id(m) for kernel in kernels for m in kernel.modules()}
    return [
        SplitNorm(m, tp, names)
        for m in layer.modules()
        if id(m) not in own
        and isinstance(getattr(m, "weight", None), nn.Parameter)
        and all(p.dim() == 1 for p in m.parameters(recurse=False))
    ]
