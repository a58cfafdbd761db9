"""Roofline pricing of recorded kernels and collectives on one device profile.

Kernel:     ideal = max(flops / peak[dtype], bytes / hbm_bw)
            time  = ideal / efficiency(op kind, dtype, shape) [x routing imbalance] + op_overhead
The efficiency comes from the device's kernel table for the serving framework (``kernels.py``:
measured fractions of this very bound, by GEMM dtype and M, grouped-GEMM dtype and pairs per expert,
attention kind and phase); a device without a table, and vector ops, use the profile's flat
``compute`` / ``memory`` efficiencies on their respective terms, as before. A table measured on
another device (H800 has none of its own) says so in the op's source (borrowed). On the same die
(the same peaks: H100, H200, H800) it prices the op as the measuring device ran it and carries the
time above that device's bound over as a time: ideal here + (measured time - ideal there), since a
latency-bound kernel does not speed up with bandwidth (``_priced_time``); on another die its
efficiencies are taken against this device's peaks and bandwidth.
Engine:     a small kernel the serving engine launches around the traced ones (``engine_kernels``):
            time = bytes / (hbm_bw * memory efficiency) + the device's engine-kernel floor
All-reduce: time = latency + 2 * (n-1)/n * bytes / (link_bw * link_eff)     (ring; inside a node the
            kernel table's measured latency and efficiency by message size replace the profile's,
            the group size's own where the table measured it)
All-gather: time = latency + (n-1)/n * bytes / (link_bw * link_eff)
All-to-all: DeepEP-style: a token goes once to every rank holding one of its experts (per-rank
            deduplication) and once to every other node holding one (per-node deduplication over the
            wide link, forwarded inside the node over the narrow one); both links run concurrently:
            time = latency + max(intra-node bytes / inner_bw, inter-node bytes / outer_bw).
            A kernel table that measured the device's dispatch / combine kernels (``all_to_all``: the
            Atlas A3's) replaces this inside the EP sizes it measured: measured latency by group size
            + one row per token and expert at the measured fraction of the link bandwidth.
            Decode steps (``comm["low_latency"]``) on a device with an ``ep_low_latency`` section run
            DeepEP's low-latency kernels, as SGLang and TensorRT-LLM wide-EP do: no deduplication, one
            row per token and expert; the rows to the other ranks of the node cross NVLink, the rest
            RDMA, concurrently: time = floor(EP size) + max(NVLink rows / (bw x eff), RDMA rows /
            (bw x eff)). The floor (the kernel's signalling round trips) is what the roofline misses:
            12-26 us per call against the link's 8 us, and the achievable fractions are measured.
            Prefill keeps the deduplicating model above (DeepEP's normal kernels).
The link is the narrowest interconnect level spanning the group. One overlap is modelled: in decode the
shared experts run beside the routed path (``overlap_shared_experts``); otherwise a step is the sum of its
kernels (see docs/cost_model.md for what that misses). A module the table measured only whole (vLLM's
MLA module, decode and prefill) is priced as measured: its core kernel takes the module's floor and
the kernels inside it are folded in (``fold_modules``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from ....errors import KadaptError
from ..model.tracer import Op
from ..tables.curves import Curve, Match, measured_across
from ..tables.device import Device, LowLatencyEP, get_device
from ..tables.kernels import KernelTable, table_for
from . import engine_kernels, ep_dispatch


@dataclass(frozen=True)
class Priced:
    op: Op
    time: float  # seconds for one occurrence
    bound: str  # compute | memory | overhead | network | latency
    source: str = "roofline"  # roofline | table:<kernel table> | aiconfigurator:<system>/<framework>
    # the measured floors of the module this kernel is the core of, per shape (``fold_modules``)
    floors: tuple[tuple[Match, Curve], ...] = ()
    module_time: float = 0.0  # of ``time``: the module's floor folded in (its projections, norms, ...)
    # the projections inside the traced module that its measurement does not hold (kept as priced)
    outside: tuple[str, ...] = ()
    shape: dict[str, Any] | None = None  # the op's attributes as the table matched them (``table_shape``)

    @property
    def total(self) -> float:
        return self.time * self.op.repeat


def kernel_table(device: Device, framework: str = "trtllm") -> KernelTable | None:
    """The kernel table ``device`` prices with when serving with ``framework`` (None: flat efficiencies)."""
    return table_for(device.kernels, framework) if device.kernels else None


def table_source(table: KernelTable, section: str, device: Device) -> str:
    """An op's price source for a curve of ``section``: the table that measured it, and whether that
    was another device (its efficiencies rescaled by this device's peaks and bandwidth)."""
    source = f"table:{table.origin(section)}"
    measured_on = table.measured_on(section)
    return source if measured_on in (None, device.name) else f"{source} (borrowed: {measured_on} curves)"


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


def low_latency_all_to_all(
    device: Device, ll: LowLatencyEP, comm: dict[str, float], phase: str
) -> tuple[float, float]:
    """(transfer, latency) of a DeepEP low-latency dispatch or combine (see the module docstring).

    DeepEP's LL kernels send a token once per selected expert (its receive buffers are laid out per
    local expert), and the FP8 dispatch carries one fp32 scale per 128 channels; the ranks of the
    sender's node are reached over NVLink (the sender's own rows are a local copy, not charged),
    the others over RDMA, both at once."""
    group = int(comm["group"])
    outer = device.link_for(group)
    inner = next((k for k in device.links if k.max_devices < group), None)
    near = inner.max_devices if inner else group  # ranks per node
    row = comm["token_bytes"]
    if phase == "dispatch" and row < 2 * comm["hidden"]:  # 8-bit rows carry their block scales
        row += comm["hidden"] / 128 * 4
    rows = comm["tokens"] * comm["top_k"] * row
    share = ll.efficiency[phase]
    narrow = inner or outer
    transfers = [rows * (near - 1) / group / (narrow.bandwidth * share[narrow.name])]
    if inner:
        transfers.append(rows * (group - near) / group / (outer.bandwidth * share[outer.name]))
    return max(transfers), ll.latency[phase](group)


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
        elif comm.get("low_latency") and device.ep_low_latency is not None and "tokens" in comm:
            transfer, latency = low_latency_all_to_all(device, device.ep_low_latency, comm, phase)
        else:
            transfer, latency = _all_to_all(device, comm)
    else:
        link = device.link_for(group)
        factor = 2 * (group - 1) / group if collective == "all_reduce" else (group - 1) / group
        efficiency, latency = link.efficiency, link.latency
        if collective == "all_reduce" and table is not None and table.all_reduce and link is device.links[0]:
            latency, curve = table.all_reduce
            own = curve.at({"group": group})  # the group size's own rows where it was measured
            latency = own.overhead if own is not curve else latency
            efficiency, measured = own(nbytes), True
        transfer = factor * nbytes / (link.bandwidth * efficiency)
    return latency + transfer, "network" if transfer >= latency else "latency", measured


def table_shape(op: Op, device: Device) -> dict[str, Any]:
    """``op``'s attributes as a kernel table matches its curves. The tables' per-shape curves were
    measured without attention DP (``attention_dp: 1``); a routed-expert or attention op of an
    attention-DP layout prices from them as the layout runs its kernels (``ep_dispatch.wide_ep``,
    over the device's NVLink domain):
    - tokens reaching the experts by all-to-all over an EP group wider than the NVLink domain run
      the wide-EP path (DeepEP dispatch, DeepGEMM grouped GEMMs, SGLang's MLA module under DP
      attention), which SGLang measures on its own: ``graph`` names it, as AIConfigurator's large-EP
      graph prices it across nodes (on H100, DeepSeek-V3's experts of a DP16 EP16 prefill take 6.4
      ms a layer there against 11.3 on the fused path's rows);
    - otherwise (an EP group inside the domain, or no all-to-all) the fused path runs the TP path's
      kernels at the DP groups' tokens, as AIConfigurator's fused graph prices it: the rows measured
      at ``attention_dp: 1``. Matched at the layout's own DP size, no per-shape curve fitted and the
      op priced at the median over every shape: DeepSeek-V3's experts of an H200 SGLang DP8 EP8
      prefill took 579 ms against the 762 of AIConfigurator's fused graph (0.83 of its step)."""
    attrs = op.attrs
    dp = int(attrs.get("attention_dp", 1))
    if op.kind not in ("experts", "attention") or dp <= 1:
        return attrs
    ep = int(attrs.get("ep", 1))
    # an attention op's layout: its tokens reach the experts by all-to-all where EP exceeds TP
    all_to_all = bool(attrs["all_to_all"]) if "all_to_all" in attrs else ep > int(attrs.get("tp", 1))
    if not ep_dispatch.wide_ep(dp, ep, all_to_all=all_to_all, node_size=device.links[0].max_devices):
        return {**attrs, "attention_dp": 1}
    return {**attrs, "graph": "wide_ep_generation" if attrs.get("decode") else "wide_ep_context"}


def _table_time(
    op: Op, table: KernelTable, compute: float, memory: float, attrs: dict[str, Any]
) -> tuple[float, float] | None:
    """(time without fixed cost, fixed cost or 0 for the device's op overhead) the table gives ``op``
    (its ``attrs`` as ``table_shape`` gives them) from its ideal ``compute`` and ``memory`` times;
    None when the table does not cover it."""
    if op.kind == "matmul":
        kernel, m = str(attrs.get("kernel", op.compute)), float(attrs.get("m", 1))
        effs = table.gemm_eff(kernel, m, op.bytes)
        return (max(compute / effs[0], memory / effs[1]), table.gemm_fixed(kernel, m)) if effs else None
    if op.kind == "experts":
        kernel, per_expert = str(attrs.get("kernel", op.compute)), float(attrs.get("pairs_per_expert", 1.0))
        found = table.grouped_eff(kernel, per_expert, attrs)
        if found is None:
            return None
        skewed = attrs.get("routing") == "power_law"
        factor = table.imbalance_factor(kernel, per_expert, attrs) if skewed else 1.0
        floor = table.imbalance_floor(kernel, per_expert, attrs) if skewed else 1.0
        return max(compute, memory) / found[0] * factor, found[1] * floor
    if op.kind == "attention" and "kernel" in attrs:
        decode = bool(attrs["decode"])
        key = float(attrs["kv_bytes"]) if decode else float(attrs["seq"])
        efficiency = table.attention_eff(decode, str(attrs["kernel"]), key, attrs)
        return (max(compute, memory) / efficiency, 0.0) if efficiency else None
    return None


def _measuring_device(table: KernelTable, section: str, device: Device) -> Device:
    """The device profile ``table``'s ``section`` curves were measured on (``device`` itself where it
    is this one, not recorded, or not a known profile)."""
    name = table.measured_on(section)
    if name in (None, device.name):
        return device
    return _profile(name) or device


@cache
def _profile(name: str) -> Device | None:
    """The shipped or user device profile ``name`` (None: none), read once."""
    try:
        return get_device(name)
    except KadaptError:
        return None


def _priced_time(op: Op, device: Device, table: KernelTable) -> tuple[float, float] | None:
    """(time without fixed cost, fixed cost) the table gives ``op`` on ``device``.

    A curve measured on another device with the same compute peaks (the same die with other HBM:
    H100, H200, H800) prices the op as the measuring device ran it - its efficiency against that
    device's own bound - and carries the time the bound does not account for over as a time: the
    op's ideal there is replaced by its ideal here, the rest (``ideal / eff - ideal``: launches,
    latency, dequantization, occupancy: the same SMs) kept as it was. A measured efficiency is not
    all bandwidth: between H100 and H200 (3.35 against 4.8 TB/s) the measured grouped-GEMM rows take
    1.02-1.10x as long on H100 where they reach under 0.2 of H200's memory bound and 1.38-1.44x (the
    bandwidth ratio, 1.43) where they reach over 0.8, as the time above the bound kept as a time
    gives; the efficiency carried over scaled all of a latency-bound kernel's time by the bandwidth
    (Kimi-K2.5's int4 experts at a 1,024-token prefill, H200 priced with H100's table: 0.68x
    AIConfigurator's). A curve measured on another die (other SMs) keeps its efficiency against
    this device's bound: its time over the bound is not this die's."""
    source = _measuring_device(table, _section(op), device)
    if source.peak_flops != device.peak_flops:
        source = device
    unit = op.compute
    if op.kind == "experts":  # a fallback curve computed in another unit (FP4 x FP8 experts on Hopper)
        unit = table.grouped_compute(str(op.attrs.get("kernel", op.compute)), op.compute)
    compute, memory = op.flops / source.peak(unit), op.bytes / source.hbm_bandwidth
    found = _table_time(op, table, compute, memory, table_shape(op, device))
    if found is None or source is device:
        return found
    here = max(op.flops / device.peak(unit), op.bytes / device.hbm_bandwidth)
    return max(0.0, found[0] - max(compute, memory)) + here, found[1]


def _decode_attention_time(
    op: Op, device: Device, table: KernelTable, found: tuple[float, float]
) -> tuple[float, float]:
    """The table's decode-attention time made non-decreasing in the KV bytes a call reads.

    The decode curves are efficiencies keyed by KV bytes, interpolated linearly in log(bytes), while
    the op's ideal time also holds terms that do not grow with the context (queries, outputs, the
    new tokens' cache write). Near an empty cache the measured kernel is latency-bound and its
    efficiency grows about as fast as the bytes (0.002 at 64 KiB, 0.009 at 256 KiB): dividing the
    fixed terms by it, and interpolating between such points, priced MLA decode at a near-empty
    cache above the same batch at 512 tokens. A kernel reading less cache is never slower, so: the
    op is priced at every grid point of its curve (FLOPs and KV read scaled with the context, the
    rest kept), each point takes the least time of itself and every longer point, and the time is
    interpolated between the two points around the op's KV bytes, linearly in log(time) against
    log(bytes), exact for a bandwidth-bound kernel (below the first point: the plain price capped by
    the first point; past the last: the plain price)."""
    kv = float(op.attrs["kv_bytes"])
    curve = table.attention_curve(True, str(op.attrs["kernel"]), table_shape(op, device))
    if curve is None or kv <= 0 or kv >= curve.xs[-1]:
        return found

    def at(kv_bytes: float) -> float:
        scale = kv_bytes / kv
        longer = replace(
            op,
            flops=op.flops * scale,
            bytes=op.bytes + kv * (scale - 1),
            attrs={**op.attrs, "kv_bytes": kv_bytes},
        )
        priced = _priced_time(longer, device, table)
        return sum(priced) if priced is not None else math.inf

    times = [at(x) for x in curve.xs]
    for i in range(len(times) - 2, -1, -1):
        times[i] = min(times[i], times[i + 1])
    if kv <= curve.xs[0]:
        return min(found[0], times[0] - found[1]), found[1]
    i = bisect.bisect_right(curve.xs, kv) - 1
    t = math.log(kv / curve.xs[i]) / math.log(curve.xs[i + 1] / curve.xs[i])
    return times[i] * (times[i + 1] / times[i]) ** t - found[1], found[1]


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
        if measured and table:
            source = f"table:{table.origin(section)}"
        elif section == "all_to_all" and op.comm.get("low_latency") and device.ep_low_latency:
            source = f"deepep_ll:{device.name}"
        else:
            source = "roofline"
        return Priced(op, time, bound, source)
    if "engine_kernel" in op.attrs:  # a small kernel the engine launches: roofline + floor
        body = op.bytes / (device.hbm_bandwidth * device.memory_efficiency)
        added = engine_kernels.floor(device)
        return Priced(op, body + added, "overhead" if added > body else "memory", "engine: roofline + floor")
    compute = op.flops / device.peak(op.compute)
    memory = op.bytes / device.hbm_bandwidth
    shape = table_shape(op, device)
    found = _priced_time(op, device, table) if table else None
    if found is not None and table is not None and op.kind == "attention" and op.attrs.get("decode"):
        found = _decode_attention_time(op, device, table, found)
    bound = "compute" if compute >= memory else "memory"
    if found is not None and table is not None:
        (body, fixed), source = found, table_source(table, _section(op), device)
        if op.kind == "experts" and shape.get("routing") == "power_law":
            kernel, pairs = str(shape.get("kernel", op.compute)), float(shape.get("pairs_per_expert", 1.0))
            source += table.imbalance_note(kernel, pairs, shape)
    else:
        compute, memory = compute / device.compute_efficiency, memory / device.memory_efficiency
        body, fixed, source = max(compute, memory), 0.0, "roofline"
        bound = "compute" if compute >= memory else "memory"
    overhead = fixed or device.op_overhead
    if overhead > body:
        bound = "overhead"
    if not (table and _mla(op) and source != "roofline"):
        return Priced(op, body + overhead, bound, source)
    kind = module_kind(shape)
    floors, outside = table.module_floor.get(kind, ()), table.module_outside.get(kind, ())
    return Priced(op, body + overhead, bound, source, floors, outside=outside, shape=shape)


def module_kind(shape: dict[str, Any]) -> str:
    """The kind of module an MLA kernel of ``shape`` (``table_shape``'s) is the core of, as a kernel
    table's ``module_floor`` names it: SGLang's module under DP attention on a wide-EP layout
    (``<graph>_mla``), else the MLA module of the framework's TP path (``mla`` in decode,
    ``mla_prefill`` in prefill: vLLM's)."""
    if "graph" in shape:
        return f"{shape['graph']}_mla"
    return "mla" if shape.get("decode") else "mla_prefill"


def framework_pricer(framework: str) -> Callable[[Op, Device], Priced]:
    """``price`` with the device's kernel table for ``framework``: what ``kadapt simulate
    --framework`` prices one step with (serving frameworks run different kernels), for a sweep or a
    ``--concurrency`` request mode."""

    def pricer(op: Op, device: Device) -> Priced:
        return price(op, device, kernel_table(device, framework))

    return pricer


def _mla(op: Op) -> bool:
    return op.kind == "attention" and op.attrs.get("kernel") == "mla"


def _inside(op: Op, core: Op, outside: tuple[str, ...] = ()) -> bool:
    """Whether ``op`` runs inside the module ``core`` is the kernel of (its module or a child of it,
    in the same traced layer) and the module's measurement holds it: not a projection of ``outside``
    (a merged GEMM's projections all of them, ``leaves``)."""
    if op is core or op.scope != core.scope or not (op.module + ".").startswith(core.module + "."):
        return False
    leaves = op.attrs.get("leaves") or (op.module.rpartition(".")[2],)
    return not (op.kind == "matmul" and outside and set(leaves) <= set(outside))


def module_floor(floors: tuple[tuple[Match, Curve], ...], shape: dict) -> Curve | None:
    """The measured floor of a module of ``shape``: its own where that head count was measured, else
    from the measured head counts around it with every other attribute equal (cache dtype,
    projections, hidden, layout), linear in log(heads) between the two nearest, the nearest one's
    past the ends (None: no floor of that kind at any head count). The floor is the projections,
    norms, rope and launches, and grows with the heads (q_b and o_proj are per head: vLLM 0.24's
    module on B200, FP8 cache and projections, one token: 46, 50, 54, 70, 90 us at 8, 16, 32, 64, 128
    heads); held out, 16 and 32 heads from 8 and 64 take 54 and 62 us."""
    return measured_across(floors, shape, "heads")


def fold_modules(kernels: list[Priced]) -> list[Priced]:
    """Price each module its table measured whole as that measurement: the core kernel (MLA
    attention, priced by the attention curve taken out of the module) takes the module's measured
    floor at its new tokens (``module_floor``: its head count's, else from the measured head counts
    around it), and every other kernel inside the module (projections, norms, rope, the absorbed
    bmms) is priced 0 (bound ``in_module``), in decode and in prefill. vLLM's MLA decode module is
    ~0.11-0.14 ms at its shortest context where its five GEMMs from the standalone rows alone come
    to 0.04 (bf16) or 0.4 ms (fp8-block); its prefill module takes 0.18 ms at one 1,024-token
    sequence on GB200 (DeepSeek-V3, 16 heads), where one standalone fp8-block GEMM row takes
    0.27-0.32 ms. The floor is matched on the module's shape, its projections' kernel family read off
    the kernels inside it (as priced: a sweep re-formats weights); a shape with no floor of its kind
    keeps its kernels as priced."""
    out = list(kernels)
    for i, core in enumerate(kernels):
        if not core.floors:
            continue
        inside = [j for j, k in enumerate(kernels) if _inside(k.op, core.op, core.outside)]
        families = {str(kernels[j].op.attrs.get("kernel")) for j in inside if kernels[j].op.kind == "matmul"}
        projections = families.pop() if len(families) == 1 else "mixed"
        shape = {**(core.shape or core.op.attrs), "projections": projections}
        floor = module_floor(core.floors, shape)
        if floor is None:
            continue
        tokens = float(core.op.attrs["batch"]) * float(core.op.attrs["seq"])
        added = floor(tokens)
        out[i] = replace(
            core, time=core.time + added, bound="module", source=f"{core.source} (module)", module_time=added
        )
        for j in inside:
            out[j] = replace(out[j], time=0.0, bound="in_module")
    return out


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
