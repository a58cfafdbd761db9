"""Record every aten op a meta-device forward runs, with the shapes, dtypes, FLOPs and bytes it moves.

A ``TorchDispatchMode`` sees each op after autograd and composite decomposition, i.e. the kernels an
eager runtime would launch. FLOPs come from ``torch.utils.flop_counter``'s registry (matmuls,
attention); every other op is a vector op priced by its bytes. Weights are recognised by identity
(registered with ``mark_weight`` and followed through view ops) so a quantized weight is charged its
packed bytes, not its bf16 meta bytes; a dtype cast of a weight is free (the copy stays that weight).
Kernels the model does not run through aten (attention cores, grouped expert GEMMs, collectives) are
added with ``analytic``. Consecutive vector ops are fused afterwards (``fuse``), as every serving
runtime fuses norms, rope and activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from .quant import WeightFormat

_FREE = {
    "empty",
    "new_empty",
    "empty_like",
    "empty_strided",
    "detach",
    "lift_fresh",
    "alias",
    "_unsafe_view",
    "view",
    "reshape",
    "expand",
    "t",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "unbind",
    "as_strided",
    "view_as_real",
    "view_as_complex",
}
_GATHER = {"embedding", "index_select", "gather"}


@dataclass
class Op:
    """One kernel: an aten op, a fused run of vector ops, or an analytic kernel."""

    name: str
    module: str
    scope: str
    repeat: int
    kind: str  # matmul | vector | attention | experts | comm
    flops: float = 0.0
    bytes: float = 0.0
    compute: str = "bf16"  # peak-table key
    comm: dict[str, float] | None = None  # collective description for ``kind == "comm"``
    shapes: str = ""
    inputs: list[tuple[int, float]] = field(default_factory=list, repr=False)  # (root tensor id, bytes)
    outputs: list[tuple[int, float]] = field(default_factory=list, repr=False)


def _tensors(tree: object) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Recorder(TorchDispatchMode):
    """Collects ``Op`` records; ``scope`` and module hooks say where each one came from."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self._weights: dict[int, WeightFormat] = {}
        self._keep: list[torch.Tensor] = []  # keeps ids unique for the trace's lifetime
        self._root: dict[int, int] = {}
        self._scope = ("model", 1)
        self._modules: list[str] = []

    # --- context -------------------------------------------------------------------------------
    def mark_weight(self, tensor: torch.Tensor, fmt: WeightFormat) -> None:
        self._weights[id(tensor)] = fmt
        self._keep.append(tensor)

    @contextlib.contextmanager
    def scope(self, name: str, repeat: int) -> Iterator[None]:
        previous, self._scope = self._scope, (name, repeat)
        try:
            yield
        finally:
            self._scope = previous

    def hook(self, module: torch.nn.Module, prefix: str = "") -> None:
        """Name every op after the innermost module that ran it."""

        def enter(name: str) -> Callable[..., None]:
            return lambda *_: self._modules.append(name)

        def leave(*_: object) -> None:  # a forward hook must return None or it replaces the output
            self._modules.pop()

        for name, sub in module.named_modules(prefix=prefix):
            sub.register_forward_pre_hook(enter(name))
            sub.register_forward_hook(leave)

    @property
    def module(self) -> str:
        return self._modules[-1] if self._modules else ""

    def analytic(
        self,
        name: str,
        kind: str,
        *,
        flops: float = 0.0,
        nbytes: float = 0.0,
        compute: str = "bf16",
        comm: dict[str, float] | None = None,
        shapes: str = "",
    ) -> None:
        """Add a kernel priced from a formula rather than from a traced aten op."""
        scope, repeat = self._scope
        self.ops.append(Op(name, self.module, scope, repeat, kind, flops, nbytes, compute, comm, shapes))

    # --- dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch API
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        short = func._overloadpacket.__name__
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        self._keep.extend(outs)
        if short in _FREE or func.is_view or (short == "_to_copy" and ins and id(ins[0]) in self._weights):
            # a dtype cast of a weight (DeepSeek's router upcasts its bf16 weight on every call) is free:
            # a serving runtime keeps the weight in its compute dtype, so the copy *is* the weight
            base = ins[0] if ins else None
            for o in outs:
                if base is not None:
                    self._root[id(o)] = self._root.get(id(base), id(base))
                    if id(base) in self._weights:
                        self._weights[id(o)] = self._weights[id(base)]
            return out
        self._record(func, short, args, kwargs, out, ins, outs)
        return out

    def _record(self, func, short: str, args, kwargs, out, ins, outs) -> None:  # noqa: ANN001
        weight = next((self._weights[id(t)] for t in ins if id(t) in self._weights), None)
        inputs = [
            (
                self._root.get(id(t), id(t)),
                t.numel() * self._weights[id(t)].bytes_per_param if id(t) in self._weights else _nbytes(t),
            )
            for t in ins
        ]
        outputs = [(id(t), float(_nbytes(t))) for t in outs]
        if short in _GATHER:  # reads only the gathered rows, not the whole table
            inputs[0] = (inputs[0][0], sum(b for _, b in outputs))
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            flops, kind = float(counter(*args, **kwargs, out_val=out)), "matmul"
            dtype = ins[0].dtype if ins else torch.bfloat16
            compute = weight.compute if weight else ("fp32" if dtype == torch.float32 else "bf16")
        else:
            flops, kind, compute = float(sum(t.numel() for t in outs)), "vector", "vector"
        scope, repeat = self._scope
        shapes = " ".join("x".join(map(str, t.shape)) or "scalar" for t in ins[:3])
        nbytes = sum(b for _, b in inputs) + sum(b for _, b in outputs)
        self.ops.append(
            Op(short, self.module, scope, repeat, kind, flops, nbytes, compute, None, shapes, inputs, outputs)
        )


def fuse(ops: list[Op]) -> list[Op]:
    """Merge each run of consecutive vector ops (same module scope) into one kernel.

    A fused kernel reads only the tensors produced outside the run and writes only those consumed
    after it (or never consumed: the run's result), so intermediate round trips through HBM vanish.
    """
    consumers: dict[int, int] = {}
    for index, op in enumerate(ops):
        for tid, _ in op.inputs:
            consumers[tid] = index  # last consumer
    fused: list[Op] = []
    run: list[Op] = []

    def flush(end: int) -> None:
        if not run:
            return
        produced = {tid for op in run for tid, _ in op.outputs}
        reads = {tid: b for op in run for tid, b in op.inputs if tid not in produced}
        writes = {tid: b for op in run for tid, b in op.outputs if consumers.get(tid, end) >= end}
        nbytes = sum(reads.values()) + sum(writes.values())
        names = list(dict.fromkeys(op.name for op in run))
        label = (
            names[0]
            if len(run) == 1
            else "fused(" + "+".join(names[:4]) + ("+..." if len(names) > 4 else "") + ")"
        )
        head = run[0]
        fused.append(
            Op(
                label,
                head.module,
                head.scope,
                head.repeat,
                "vector",
                sum(o.flops for o in run),
                nbytes,
                "vector",
                None,
                head.shapes,
            )
        )
        run.clear()

    for index, op in enumerate(ops):
        same = run and (run[0].scope, run[0].module) == (op.scope, op.module)
        if op.kind != "vector" or (run and not same):
            flush(index)
        if op.kind == "vector":
            run.append(op)
        else:
            fused.append(op)
    flush(len(ops))
    return fused
