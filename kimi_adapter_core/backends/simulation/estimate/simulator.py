"""``kadapt simulate``: trace the per-rank model, price every kernel, size the memory, report.

This module joins the pieces: spec → structure, parameter inventory and weight-format policy → per-rank trace
(``rank_model``) → fused kernels (``tracer.fuse``) → prices → a ``Simulation`` holding the per-op
table, the step time, tokens/s per device and the per-device memory breakdown. Two cost models:
``roofline`` (``cost.price``: the roofline scaled by the device's kernel-efficiency table) and
``measured`` (each GEMM, attention, routed-expert and collective looked up in AIConfigurator's
measured tables for the device, ``measured.MeasuredPricer``; the roofline prices what they
lack, and every op says where its price came from).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ....errors import KadaptError
from ....spec.model import Spec
from ..model.deployment import Deployment
from ..model.inputs import ModelInputs
from ..model.rank_model import trace_rank
from ..model.tracer import Op, fuse
from ..tables.device import Device
from .cost import Priced, fold_modules, kernel_table, overlap_shared_experts, price
from .eager import HOST_SOURCE, eager_step
from .engine_kernels import engine_kernels
from .planner import Memory, activation_bytes, kv_sizing, memory, state_kinds, weight_lines
from .topology import layout_notes

COST_MODELS = ("roofline", "measured")


@dataclass(frozen=True)
class OpRow:
    """One line of the per-op table: identical kernels aggregated over layers."""

    scope: str
    module: str
    name: str
    count: int
    time: float  # seconds, all occurrences
    bound: str
    flops: float  # all occurrences
    bytes: float
    source: str = "roofline"  # where the price came from (see ``cost.Priced.source``)


@dataclass(frozen=True)
class Simulation:
    deployment: Deployment
    device: Device
    quant: str
    kernels: tuple[Priced, ...]  # in execution order, one entry per traced kernel (repeat = layer count)
    memory: Memory
    warnings: tuple[str, ...]
    model: str = ""  # the structure's one-line description
    cost_model: str = "roofline"  # roofline | measured
    states: dict[str, dict[str, Any]] | None = None  # per state kind of a hybrid stack (``state_kinds``)

    @property
    def step_time(self) -> float:
        return sum(k.total for k in self.kernels)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.deployment.output_tokens / self.step_time / self.deployment.parallel.devices

    def rows(self) -> list[OpRow]:
        table: dict[tuple[str, str, str], list[Any]] = {}
        for k in self.kernels:
            key = (k.op.scope, k.op.module, k.op.name)
            row = table.setdefault(key, [0, 0.0, {}, 0.0, 0.0, {}])
            row[0] += k.op.repeat
            row[1] += k.total
            row[2][k.bound] = row[2].get(k.bound, 0.0) + k.total
            row[3] += k.op.flops * k.op.repeat
            row[4] += k.op.bytes * k.op.repeat
            row[5][k.source] = row[5].get(k.source, 0.0) + k.total + 1e-30
        rows = [
            OpRow(s, m, n, c, t, max(b, key=b.get), f, y, max(src, key=src.get))
            for (s, m, n), (c, t, b, f, y, src) in table.items()
        ]
        return sorted(rows, key=lambda r: r.time, reverse=True)

    def sources(self) -> dict[str, tuple[int, float]]:
        """Per price source: (kernels, seconds of the step). A kernel whose time an eager engine's host
        sets (bound ``host``) counts under ``HOST_SOURCE``, not under the table that priced its work."""
        out: dict[str, tuple[int, float]] = {}
        for k in self.kernels:
            source = HOST_SOURCE if k.bound == "host" else k.source
            count, time = out.get(source, (0, 0.0))
            out[source] = (count + 1, time + k.total)
        return out


def trace_kernels(spec: Spec, inputs: ModelInputs, dep: Deployment) -> tuple[list[Op], tuple[str, ...]]:
    """The fused kernels of one step of ``dep`` on one rank, and the trace's notes."""
    rec, notes = trace_rank(spec, inputs, dep)
    return fuse(rec.ops), tuple(notes)


def finish_step(kernels: list[Priced], dep: Deployment) -> list[Priced]:
    """A step's priced kernels as the step runs them: a module measured whole priced as measured
    (``fold_modules``); decode: the shared experts overlap the routed path; an engine without CUDA
    graphs (``dep.eager_host``): every launched kernel at least the host's time to launch it
    (``eager.eager_step``, last: a kernel hidden on a second stream is still launched)."""
    kernels = fold_modules(kernels)
    kernels = overlap_shared_experts(kernels) if dep.decode else kernels
    return eager_step(kernels, dep.eager_host)


def inside_whole_modules(kernels: list[Priced], whole: Callable[[Op], bool]) -> list[Priced]:
    """``kernels`` with every engine kernel inside a module that ``whole`` says is priced as its
    measurement (the measured cost model's SGLang wide-EP MLA module) priced 0 (bound ``in_module``):
    the measured row holds the module's own quantizations, rope and cache write, as the roofline's
    ``cost.fold_modules`` prices them inside a module floor."""
    cores = [(k.op.scope, k.op.module + ".") for k in kernels if k.op.kind == "attention" and whole(k.op)]

    def inside(op: Op) -> bool:
        return any(op.scope == scope and (op.module + ".").startswith(core) for scope, core in cores)

    return [
        replace(k, time=0.0, bound="in_module") if "engine_kernel" in k.op.attrs and inside(k.op) else k
        for k in kernels
    ]


def simulate(
    inputs: ModelInputs,
    spec: Spec,
    dep: Deployment,
    device: Device,
    *,
    warnings: tuple[str, ...] = (),
    cost_model: str = "roofline",
    framework: str = "trtllm",
) -> Simulation:
    """Price one prefill or decode step of ``dep`` on ``device``; the per-rank model is built from
    ``spec`` (its bridges and patches for backend ``simulation``), sized by ``inputs``.
    ``framework`` picks the device's kernel tables (both cost models: serving frameworks run different
    kernels); ``cost_model="measured"`` looks ops up in AIConfigurator's ``framework`` tables."""
    s = inputs.arch.structure
    dep.check(s)
    if cost_model not in COST_MODELS:
        raise KadaptError(f"unknown cost model {cost_model!r} (known: {', '.join(COST_MODELS)})")
    measured = None
    if cost_model == "measured":
        from .aiconfigurator import require, system_for
        from .measured import MeasuredPricer

        require()
        measured = MeasuredPricer(system_for(device.name), framework)
    ops, trace_notes = trace_kernels(spec, inputs, dep)
    ops = engine_kernels(ops, framework, dep.decode, device)
    table = kernel_table(device, framework)
    priced = []
    for op in ops:
        seconds = measured.time(op, decode=dep.decode) if measured else None
        priced.append(
            Priced(op, seconds, "measured", measured.source)
            if measured and seconds is not None
            else price(op, device, table)
        )
    if measured is not None:  # a module measured whole holds its engine kernels
        whole = measured.whole_mla
        priced = inside_whole_modules(priced, lambda op: whole(op.attrs) is not None)
    kernels = tuple(finish_step(priced, dep))
    kv = kv_sizing(s, dep.parallel.tp, dep.kv_dtype, value_once=True)  # a serving runtime's cache
    logits_tokens = dep.tokens_per_rank if dep.decode else dep.batch_per_rank
    tokens = dep.context_len + dep.tokens_per_query
    mem = memory(
        weight_lines(inputs, dep.parallel),
        kv,
        dep.batch_per_rank,
        tokens,
        activation_bytes(s, dep.parallel, dep.tokens_per_rank, logits_tokens),
        device,
    )
    notes = [*warnings, *inputs.notes, *trace_notes]
    if dep.mtp and not s.num_mtp_layers:
        notes.append(
            f"the model declares no MTP layers; the {dep.mtp} draft passes are priced as DeepSeek-style "
            "MTP blocks (eh_proj + one decoder layer of the model's last kind + lm_head)"
        )
    notes += mem.warnings(device)
    par = dep.parallel
    if s.moe is not None and s.moe.num_experts and par.devices > 1 and par.ep == par.moe_tp == 1:
        notes.append(
            f"routed experts replicated on each of the {par.devices} devices (--ep 1 --moe-tp 1); "
            f"vLLM's and SGLang's --tp {par.devices} shards each expert's width (--moe-tp {par.devices}), "
            f"expert parallelism the experts themselves (--ep {par.devices})"
        )
    if measured is None:  # AIConfigurator's own collectives count its nodes; the roofline's do not
        notes += layout_notes(device, table, dep.parallel)
    states = state_kinds(kv, tokens)
    return Simulation(
        dep, device, inputs.quant_label, kernels, mem, tuple(notes), s.describe(), cost_model, states
    )
