"""Roofline pricing of recorded kernels and collectives on one device profile.

Kernel:     ideal = max(flops / peak[dtype], bytes / hbm_bw)
            time  = ideal / efficiency(op kind, dtype, shape) [x routing imbalance] + op_overhead
The efficiency comes from the device's kernel table (``kernels.py``: measured fractions of this very
bound, by GEMM dtype and M, grouped-GEMM dtype and pairs per expert, attention kind and phase); a
device without a table, and vector ops, use the profile's flat ``compute`` / ``memory`` efficiencies
on their respective terms, as before.
All-reduce: time = latency + 2 * (n-1)/n * bytes / (link_bw * link_eff)     (ring; inside a node the
            kernel table's measured latency and efficiency by message size replace the profile's)
All-gather: time = latency + (n-1)/n * bytes / (link_bw * link_eff)
All-to-all: DeepEP-style: a token goes once to every rank holding one of its experts (per-rank
            deduplication) and once to every other node holding one (per-node deduplication over the
            wide link, forwarded inside the node over the narrow one); both links run concurrently:
            time = latency + max(intra-node bytes / inner_bw, inter-node bytes / outer_bw).
            A kernel table that measured the device's dispatch / combine kernels (``all_to_all``: the
            Atlas A3's) replaces this inside the EP sizes it measured: measured latency by group size
            + one row per token and expert at the measured fraction of the link bandwidth.
The link is the narrowest interconnect level spanning the group. One overlap is modelled: in decode the
shared experts run beside the routed path (``overlap_shared_experts``); otherwise a step is the sum of its
kernels (see docs/cost_model.md for what that misses).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .device import Device
from .kernels import KernelTable, load_kernels
from .tracer import Op


@dataclass(frozen=True)
class Priced:
    op: Op
    time: float  # seconds for one occurrence
    bound: str  # compute | memory | overhead | network | latency
    source: str = "roofline"  # roofline | table:<kernel table> | aiconfigurator:<system>/<framework>

    @property
    def total(self) -> float:
        return self.time * self.op.repeat


def kernel_table(device: Device) -> KernelTable | None:
    return load_kernels(device.kernels) if device.kernels else None


def _distinct(ranks: float, group: int, top_k: float) -> float:
    """Expected number of ``ranks`` (out of ``group``, experts spread evenly) one token's ``top_k``
    experts land on."""
    return ranks * (1 - (1 - 1 / group) ** top_k)


def _all_to_all(device: Device, comm: dict[str, float]) -> tuple[float, float]:
    """(transfer, latency) of an EP dispatch or combine (see the module docstring)."""
    group = int(comm["group"])
    outer = device.link_for(group)
    inner = next((k for k in device.links if k.max_devices < group), None)
    if "tokens" not in comm:  # a payload with no token structure: spread evenly over the group
        near = inner.max_devices if inner else group
        link = inner or outer
        transfers = [comm["bytes"] * (near - 1) / group / (link.bandwidth * link.efficiency)]
        if inner:
            transfers.append(comm["bytes"] * (group - near) / group / (outer.bandwidth * outer.efficiency))
        return max(transfers), outer.latency
    tokens, top_k, token_bytes = comm["tokens"], comm["top_k"], comm["token_bytes"]
    near = inner.max_devices if inner else group  # ranks per node
    nodes = max(1, group // near)
    remote_nodes = (nodes - 1) * (1 - (1 - near / group) ** top_k)  # each sent once over the wide link
    copies = _distinct(group - 1, group, top_k)  # ranks other than this one that receive the token
    narrow = inner or outer
    intra = tokens * token_bytes * max(0.0, copies - remote_nodes)  # direct + forwarded inside nodes
    transfers = [intra / (narrow.bandwidth * narrow.efficiency)]
    if inner:
        transfers.append(tokens * token_bytes * remote_nodes / (outer.bandwidth * outer.efficiency))
    return max(transfers), outer.latency


def comm_time(
    device: Device, comm: dict[str, float], table: KernelTable | None = None, phase: str = "dispatch"
) -> tuple[float, str, bool]:
    """(seconds, bound, whether the kernel table's measurement priced it) of one collective;
    ``phase`` says which half of an EP all-to-all it is (``dispatch`` or ``combine``)."""
    collective, nbytes, group = str(comm["collective"]), comm["bytes"], int(comm["group"])
    if group <= 1:
        return 0.0, "network", False
    measured = False
    if collective == "all_to_all":
        a2a = table.all_to_all if table is not None else None
        if a2a is not None and a2a.covers(group) and "tokens" in comm:
            latency, rows = a2a.latency[phase](group), comm["top_k"] * comm["token_bytes"]
            transfer = a2a.transfer(phase, comm["tokens"], rows, device.link_for(group).bandwidth)
            measured = True
        else:
            transfer, latency = _all_to_all(device, comm)
    else:
        link = device.link_for(group)
        factor = 2 * (group - 1) / group if collective == "all_reduce" else (group - 1) / group
        efficiency, latency = link.efficiency, link.latency
        if collective == "all_reduce" and table is not None and table.all_reduce and link is device.links[0]:
            latency, curve = table.all_reduce
            efficiency, measured = curve(nbytes), True
        transfer = factor * nbytes / (link.bandwidth * efficiency)
    return latency + transfer, "network" if transfer >= latency else "latency", measured


def _table_time(op: Op, table: KernelTable, compute: float, memory: float) -> tuple[float, float] | None:
    """(time without fixed cost, fixed cost or 0 for the device's op overhead) the table gives ``op``
    from its ideal ``compute`` and ``memory`` times; None when the table does not cover it."""
    attrs = op.attrs
    if op.kind == "matmul":
        effs = table.gemm_eff(str(attrs.get("kernel", op.compute)), float(attrs.get("m", 1)), op.bytes)
        return (max(compute / effs[0], memory / effs[1]), 0.0) if effs else None
    if op.kind == "experts":
        kernel, per_expert = str(attrs.get("kernel", op.compute)), float(attrs.get("pairs_per_expert", 1.0))
        found = table.grouped_eff(kernel, per_expert)
        if found is None:
            return None
        factor = table.imbalance_factor(kernel, per_expert) if attrs.get("routing") == "power_law" else 1.0
        return max(compute, memory) / found[0] * factor, found[1]
    if op.kind == "attention" and "kernel" in attrs:
        decode = bool(attrs["decode"])
        key = float(attrs["kv_bytes"]) if decode else float(attrs["seq"])
        efficiency = table.attention_eff(decode, str(attrs["kernel"]), key)
        return (max(compute, memory) / efficiency, 0.0) if efficiency else None
    return None


def _section(op: Op) -> str:
    """The kernel-table section whose curves price ``op``."""
    if op.kind == "attention":
        return "decode" if op.attrs.get("decode") else "prefill"
    return {"experts": "grouped"}.get(op.kind, "gemm")


def price(op: Op, device: Device, table: KernelTable | None = None) -> Priced:
    """Price ``op`` with the roofline; ``table`` defaults to the device's kernel table."""
    table = table if table is not None else kernel_table(device)
    if op.kind == "comm":
        assert op.comm is not None
        phase = "combine" if op.name.startswith("ep_combine") else "dispatch"
        time, bound, measured = comm_time(device, op.comm, table, phase)
        section = "all_to_all" if op.comm["collective"] == "all_to_all" else "all_reduce"
        return Priced(op, time, bound, f"table:{table.origin(section)}" if measured and table else "roofline")
    compute = op.flops / device.peak(op.compute)
    memory = op.bytes / device.hbm_bandwidth
    found = _table_time(op, table, compute, memory) if table else None
    bound = "compute" if compute >= memory else "memory"
    if found is not None and table is not None:
        (body, fixed), source = found, f"table:{table.origin(_section(op))}"
    else:
        compute, memory = compute / device.compute_efficiency, memory / device.memory_efficiency
        body, fixed, source = max(compute, memory), 0.0, "roofline"
        bound = "compute" if compute >= memory else "memory"
    overhead = fixed or device.op_overhead
    if overhead > body:
        bound = "overhead"
    return Priced(op, body + overhead, bound, source)


def overlap_shared_experts(kernels: list[Priced]) -> list[Priced]:
    """Run each MoE layer's shared experts on a second stream, hidden behind its routed path (router,
    dispatch, grouped GEMMs, combine), as TensorRT-LLM does in decode steps: the shared kernels keep
    only the part of their time that exceeds the routed path (``bound = overlapped`` when all of it
    hides). Applied to decode only: in a prefill both paths are compute-bound and share the SMs."""
    out = list(kernels)
    for scope in dict.fromkeys(k.op.scope for k in kernels):
        shared = [i for i, k in enumerate(out) if k.op.scope == scope and ".shared_expert" in k.op.module]
        routed = sum(
            k.time
            for k in out
            if k.op.scope == scope
            and (k.op.kind == "experts" or k.op.name.startswith("ep_") or k.op.module.endswith("mlp.gate"))
        )
        busy = sum(out[i].time for i in shared)
        if not shared or not routed or not busy:
            continue
        keep = max(0.0, busy - routed) / busy
        for i in shared:
            out[i] = replace(
                out[i], time=out[i].time * keep, bound="overlapped" if keep == 0 else out[i].bound
            )
    return out
