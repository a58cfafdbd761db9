"""Record every aten op a meta-device forward runs, with the shapes, dtypes, FLOPs and bytes it moves.

A ``TorchDispatchMode`` sees each op after autograd and composite decomposition, i.e. the kernels an
eager runtime would launch. FLOPs come from ``torch.utils.flop_counter``'s registry (matmuls,
attention); every other op is a vector op priced by its bytes. Weights are recognised by identity
(registered with ``mark_weight`` and followed through view ops) so a quantized weight is charged its
packed bytes, not its bf16 meta bytes; a dtype cast of a weight is free (the copy stays that weight),
and so is an fp32 upcast of a bf16 activation (norms, softmax and the router upcast in registers: the
consumer reads the bf16 tensor). Each matmul carries its shape (``attrs``: batch, m, n, k) and the
kernel family of its weight, which the efficiency tables and the measured cost model look up; every
op lists the weights it read with their formats (``Op.weights``), so a trace can be re-formatted.
Kernels the model does not run through aten (attention cores, grouped expert GEMMs, collectives) are
added with ``analytic``. Consecutive vector ops of one layer are fused afterwards (``fuse``), as every
serving runtime fuses norms with the residual add, rope and activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry
from torch.utils.hooks import RemovableHandle

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
    attrs: dict[str, Any] = field(default_factory=dict)  # shape facts the cost models look up
    inputs: list[tuple[int, float]] = field(default_factory=list, repr=False)  # (root tensor id, bytes)
    outputs: list[tuple[int, float]] = field(default_factory=list, repr=False)
    # the weights among ``inputs``: (root tensor id, format, elements read); lets a sweep re-format
    # a trace (``sweep.py``) without tracing again
    weights: list[tuple[int, WeightFormat, int]] = field(default_factory=list, repr=False)


def _tensors(tree: object) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shapes(tensors: list[torch.Tensor]) -> str:
    """``2x8x256 256``: the shapes an op was called on (the first three), as reports print them."""
    return " ".join("x".join(map(str, t.shape)) or "scalar" for t in tensors[:3])


class Recorder(TorchDispatchMode):
    """Collects ``Op`` records; ``scope`` and module hooks say where each one came from."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self._weights: dict[int, WeightFormat] = {}
        self._keep: list[torch.Tensor] = []  # keeps ids unique for the trace's lifetime
        self._root: dict[int, int] = {}
        self._upcast: dict[int, int] = {}  # fp32 copy of a bf16 activation -> bytes per element read
        self._scope = ("model", 1)
        self._modules: list[str] = []
        self._tag = ""
        # the last op that raised: (its exception, where it ran), so a trace that fails can say where
        self._failure: tuple[BaseException, str] | None = None

    # --- context -------------------------------------------------------------------------------
    def mark_weight(self, tensor: torch.Tensor, fmt: WeightFormat) -> None:
        self._weights[id(tensor)] = fmt
        self._keep.append(tensor)

    def weight_format(self, tensor: torch.Tensor) -> WeightFormat | None:
        """The format ``tensor`` was marked with (None: not a weight), to mark a replacement alike."""
        return self._weights.get(id(tensor))

    def failure(self, error: BaseException) -> str | None:
        """Where ``error`` was raised, when an op run under this recorder raised it: ``aten.mul in
        moe_layer.self_attn.q_norm on 1x8x256 2048``; None for an error raised elsewhere."""
        if self._failure is None or self._failure[0] is not error:
            return None
        return self._failure[1]

    @contextlib.contextmanager
    def scope(self, name: str, repeat: int) -> Iterator[None]:
        previous, self._scope = self._scope, (name, repeat)
        try:
            yield
        finally:
            self._scope = previous

    @contextlib.contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        """Ops recorded inside carry ``attrs["tag"] = tag`` (e.g. MLA's absorbed bmm before/after)."""
        previous, self._tag = self._tag, tag
        try:
            yield
        finally:
            self._tag = previous

    def hook(self, module: torch.nn.Module, prefix: str = "") -> list[RemovableHandle]:
        """Name every op after the innermost module that ran it; the handles remove the hooks (a
        model traced again registers its next recorder's)."""

        def enter(name: str) -> Callable[..., None]:
            return lambda *_: self._modules.append(name)

        def leave(*_: object) -> None:  # a forward hook must return None or it replaces the output
            self._modules.pop()

        handles = []
        for name, sub in module.named_modules(prefix=prefix):
            handles.append(sub.register_forward_pre_hook(enter(name)))
            handles.append(sub.register_forward_hook(leave))
        return handles

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
        attrs: dict[str, Any] | None = None,
        at: int | None = None,
    ) -> None:
        """Add a kernel priced from a formula rather than from a traced aten op; ``at``: its index in
        ``ops`` when it ran between ops already recorded (default: after them)."""
        scope, repeat = self._scope
        self.ops.insert(
            len(self.ops) if at is None else at,
            Op(
                name,
                self.module,
                scope,
                repeat,
                kind,
                flops,
                nbytes,
                compute,
                comm,
                shapes,
                dict(attrs or {}),
            ),
        )

    # --- dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch API
        kwargs = kwargs or {}
        short = func._overloadpacket.__name__
        try:
            out = func(*args, **kwargs)
        except RuntimeError as error:  # a shape the model cannot run at (the caller names it)
            where = f" in {self.module}" if self.module else ""
            self._failure = (error, f"aten.{short}{where} on {_shapes(_tensors((args, kwargs)))}")
            raise
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        self._keep.extend(outs)
        if (
            short == "_to_copy"
            and ins
            and outs
            and id(ins[0]) not in self._weights
            and _upcast(ins[0], outs[0])
        ):
            self._root[id(outs[0])] = self._root.get(id(ins[0]), id(ins[0]))
            self._upcast[id(outs[0])] = self._upcast.get(id(ins[0]), ins[0].element_size())
            return out
        if short in _FREE or func.is_view or (short == "_to_copy" and ins and id(ins[0]) in self._weights):
            # a dtype cast of a weight (DeepSeek's router upcasts its bf16 weight on every call) is free:
            # a serving runtime keeps the weight in its compute dtype, so the copy *is* the weight
            base = ins[0] if ins else None
            for o in outs:
                if base is not None:
                    self._root[id(o)] = self._root.get(id(base), id(base))
                    if id(base) in self._weights:
                        self._weights[id(o)] = self._weights[id(base)]
                    if id(base) in self._upcast and o.dtype == torch.float32:
                        self._upcast[id(o)] = self._upcast[id(base)]
            return out
        self._record(func, short, args, kwargs, out, ins, outs)
        return out

    def _record(self, func, short: str, args, kwargs, out, ins, outs) -> None:  # noqa: ANN001
        weight = next((self._weights[id(t)] for t in ins if id(t) in self._weights), None)
        inputs = [(self._root.get(id(t), id(t)), self._read_bytes(t)) for t in ins]
        outputs = [(id(t), float(_nbytes(t))) for t in outs]
        # a weight indexed by a tensor is a table lookup too (DeepSeek-V4's hash router, tid2eid[ids])
        gather = short in _GATHER or (short == "index" and bool(ins) and id(ins[0]) in self._weights)
        weights = [
            (self._root.get(id(t), id(t)), self._weights[id(t)], t.numel())
            for i, t in enumerate(ins)
            if id(t) in self._weights and not (i == 0 and gather)
        ]
        if gather:  # reads only the gathered rows, not the whole table
            inputs[0] = (inputs[0][0], sum(b for _, b in outputs))
        counter = flop_registry.get(func._overloadpacket)
        attrs: dict[str, Any] = {"tag": self._tag} if self._tag else {}
        if counter is not None:
            flops, kind = float(counter(*args, **kwargs, out_val=out)), "matmul"
            real_fp32 = any(t.dtype == torch.float32 and id(t) not in self._upcast for t in ins)
            compute = weight.compute if weight else ("fp32" if real_fp32 else "bf16")
            attrs["kernel"] = weight.kernel if weight else compute
            activation = next((t for t in ins if id(t) not in self._weights), None)
            if weight is not None and activation is not None:  # a projection: fusable with its siblings
                attrs["activation"] = self._root.get(id(activation), id(activation))
            if outs and outs[0].dim() >= 2:
                m, n = outs[0].shape[-2], outs[0].shape[-1]
                batch = outs[0].numel() // max(1, m * n)
                attrs.update(batch=batch, m=m, n=n, k=round(flops / max(1, 2 * batch * m * n)))
        else:
            flops, kind, compute = float(sum(t.numel() for t in outs)), "vector", "vector"
        scope, repeat = self._scope
        shapes = _shapes(ins)
        nbytes = sum(b for _, b in inputs) + sum(b for _, b in outputs)
        self.ops.append(
            Op(
                short,
                self.module,
                scope,
                repeat,
                kind,
                flops,
                nbytes,
                compute,
                None,
                shapes,
                attrs,
                inputs,
                outputs,
                weights,
            )
        )

    def _read_bytes(self, t: torch.Tensor) -> float:
        """Bytes a kernel reads of ``t``: a weight's packed bytes, an upcast activation's source bytes."""
        if id(t) in self._weights:
            return t.numel() * self._weights[id(t)].bytes_per_param
        if id(t) in self._upcast:
            return float(t.numel() * self._upcast[id(t)])
        return float(_nbytes(t))


def _upcast(source: torch.Tensor, copy: torch.Tensor) -> bool:
    """A widening cast of a floating activation to fp32 (bf16/fp16 -> fp32)."""
    return copy.dtype == torch.float32 and source.dtype in (torch.bfloat16, torch.float16)


def merge_projections(ops: list[Op]) -> list[Op]:
    """Merge sibling projections that read the same activation into one GEMM, as serving runtimes
    load them (q/k/v into qkv_proj, gate/up into gate_up_proj, MLA's q_a/kv_a into one): same layer,
    same parent module, same weight kernel and shape; N adds up and the activation is read once.
    Returns new ops; ``ops`` is not modified."""
    merged: list[Op] = []
    first: dict[tuple[object, ...], int] = {}
    for op in ops:
        source = op.attrs.get("activation")
        if op.kind != "matmul" or source is None:
            merged.append(op)
            continue
        parent, _, leaf = op.module.rpartition(".")
        key = (
            op.scope,
            op.repeat,
            parent,
            source,
            op.attrs.get("kernel"),
            op.attrs.get("m"),
            op.attrs.get("k"),
        )
        if key not in first:
            first[key] = len(merged)
            merged.append(replace(op, attrs={**op.attrs, "leaves": (leaf,)}))
            continue
        head = merged[first[key]]
        leaves = (*head.attrs["leaves"], leaf)
        merged[first[key]] = replace(
            head,
            name=f"{op.name}({'+'.join(leaves)})",
            module=parent,
            flops=head.flops + op.flops,
            bytes=head.bytes + op.bytes - sum(b for tid, b in op.inputs if tid == source),
            attrs={**head.attrs, "n": head.attrs.get("n", 0) + op.attrs.get("n", 0), "leaves": leaves},
            inputs=head.inputs + [i for i in op.inputs if i[0] != source],
            outputs=head.outputs + op.outputs,
            weights=head.weights + op.weights,
        )
    return merged


def fuse(ops: list[Op]) -> list[Op]:
    """Merge each run of consecutive vector ops of one traced layer (same scope) into one kernel.

    A fused kernel reads only the tensors produced outside the run and writes only those consumed
    after it (or never consumed: the run's result), so intermediate round trips through HBM vanish.
    Runs cross module boundaries inside a layer: the residual add of one sub-block and the next
    norm are one fused add-RMSNorm kernel in every serving runtime. The kernel is named after the
    module of its first op. Sibling projections are merged first (``merge_projections``).
    """
    ops = merge_projections(ops)
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
                weights=list({tid: (tid, fmt, n) for op in run for tid, fmt, n in op.weights}.values()),
            )
        )
        run.clear()

    for index, op in enumerate(ops):
        same = run and (run[0].scope, run[0].repeat) == (op.scope, op.repeat)
        if op.kind != "vector" or (run and not same):
            flush(index)
        if op.kind == "vector":
            run.append(op)
        else:
            fused.append(op)
    flush(len(ops))
    return fused
