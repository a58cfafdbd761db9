"""Kernels as functions of the per-rank batch: the entries a sweep family prices every batch from.

A kernel's FLOPs, bytes and shape facts are affine in the per-rank batch ``b``: ``Scaled`` holds one
traced at ``b = at`` and ``at + 1`` and gives it at any ``b`` (its weight re-formatted to another
mode when asked); ``shape_of`` is what must not change with the batch. DP and EP reach only the
routed experts, so those are recomputed per configuration (``ScaledExperts``): ``expert_kernels``
runs the simulator's own ``RoutedExperts`` for a row count, and ``expert_spans`` finds each
routed-experts call (its grouped GEMM and the collectives around it) in a trace.

Separate from ``sweep``, which decides whether a family may be scaled (checked against real traces)
and prices configurations from these entries: this module is the arithmetic of one entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ....structure.model import ModelStructure
from ..model.deployment import Deployment
from ..model.quant import WeightFormat
from ..model.tracer import Op
from .weight_modes import Key, kernel_family

_REL = 1e-9  # predictions are checked to this relative tolerance (means over layers round)


# --- seam onto the simulator: its routed-experts module ------------------------------------------------
def expert_kernels(s: ModelStructure, dep: Deployment, fmt: WeightFormat, tokens: int) -> list[Op]:
    """The kernels the simulator's routed-experts module records for ``tokens`` rows on one rank."""
    import torch

    from ..model.serving_kernels import RoutedExperts
    from ..model.tracer import Recorder

    rec = Recorder()
    RoutedExperts(s, rec, dep, fmt).forward(torch.empty(tokens, s.hidden_size, device="meta"))
    return rec.ops


def numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _place(op: Op) -> tuple[Any, ...]:
    return (op.name, op.module, op.scope, op.repeat, op.kind)


def shape_of(op: Op) -> tuple[Any, ...]:
    """What must not change with the batch: place, dtype keys, group sizes, non-numeric facts."""
    fixed = [(f"comm.{k}", v) for k, v in (op.comm or {}).items() if not numeric(v) or k == "group"]
    fixed += [(f"attrs.{k}", v) for k, v in op.attrs.items() if not numeric(v)]
    return (*_place(op), op.compute, tuple(sorted(fixed, key=str)))


def close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= _REL * max(abs(a), abs(b))


def _affine(lo: Any, hi: Any, b: int, at: int) -> Any:
    """The value at ``b`` of a quantity that is ``lo`` at ``at`` and ``hi`` at ``at + 1``."""
    return lo if lo == hi else lo + (hi - lo) * (b - at)


@dataclass
class Scaled:
    """A kernel traced at b = ``at`` and ``at + 1`` (one trace when the family has one batch)."""

    lo: Op
    hi: Op
    at: int
    key: Key | None  # the weight it reads, for matmuls that name one
    traced: WeightFormat | None  # that weight's (tagged) traced format
    elements: float  # that weight's elements (0: its format is the same in every swept mode)
    opaque: frozenset[str] = frozenset()  # numeric facts that are not affine (ids): left out

    def op(self, b: int, fmt: WeightFormat | None = None, base: WeightFormat | None = None) -> Op:
        """The kernel at per-rank batch ``b``, its weight in ``fmt`` (traced as ``base``) when given."""
        lo, hi, at = self.lo, self.hi, self.at
        nbytes = _affine(lo.bytes, hi.bytes, b, at)
        attrs = {
            k: _affine(v, hi.attrs[k], b, at) if numeric(v) else v
            for k, v in lo.attrs.items()
            if k not in self.opaque
        }
        compute = lo.compute
        if fmt is not None and base is not None and self.traced is not None:
            compute = fmt.compute
            if self.elements:
                nbytes += self.elements * (fmt.bytes_per_param - base.bytes_per_param)
            if "kernel" in attrs:  # the kernel family follows the weight format
                attrs["kernel"] = kernel_family(fmt)
        comm = None
        if lo.comm is not None and hi.comm is not None:
            comm = {k: _affine(v, hi.comm[k], b, at) if numeric(v) else v for k, v in lo.comm.items()}
        return replace(
            lo,
            flops=_affine(lo.flops, hi.flops, b, at),
            bytes=nbytes,
            compute=compute,
            comm=comm,
            shapes="",
            attrs=attrs,
            inputs=[],
            outputs=[],
        )


@dataclass
class ScaledExperts:
    """One routed-experts call, recomputed per configuration; its rows on the rank are affine in b."""

    module: str
    scope: str
    repeat: int
    at: int
    tokens_lo: int
    tokens_hi: int
    traced: WeightFormat  # the (tagged) format it was traced with, to check the reproduction

    def kernels(self, s: ModelStructure, dep: Deployment, fmt: WeightFormat, b: int) -> list[Op]:
        ops = expert_kernels(s, dep, fmt, _affine(self.tokens_lo, self.tokens_hi, b, self.at))
        for op in ops:  # recorded outside the model: give them the traced call's place
            op.module, op.scope, op.repeat = self.module, self.scope, self.repeat
        return ops


def expert_spans(ops: list[Op]) -> dict[int, int]:
    """start -> end of each routed-experts call: its grouped GEMM and the collectives around it."""
    spans = {}
    for i, op in enumerate(ops):
        if op.kind != "experts":
            continue
        start, end = i, i + 1
        while start and ops[start - 1].kind == "comm" and _same_call(ops[start - 1], op):
            start -= 1
        while end < len(ops) and ops[end].kind == "comm" and _same_call(ops[end], op):
            end += 1
        spans[start] = end
    return spans


def _same_call(a: Op, b: Op) -> bool:
    return (a.module, a.scope, a.repeat) == (b.module, b.scope, b.repeat)


def values_of(op: Op) -> tuple[Any, ...]:
    """Everything a pricer may read of a kernel recorded outside the model (not its place in it)."""
    return (op.name, op.kind, op.flops, op.bytes, op.compute, op.comm, op.attrs)
