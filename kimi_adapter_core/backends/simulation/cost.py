"""Roofline pricing of recorded kernels and collectives on one device profile.

Kernel:     time = max(flops / (peak[dtype] * compute_eff), bytes / (hbm_bw * mem_eff)) + op_overhead
All-reduce: time = latency + 2 * (n-1)/n * bytes / (link_bw * link_eff)     (ring)
All-gather: time = latency + (n-1)/n * bytes / (link_bw * link_eff)
All-to-all: time = latency + max(intra-node bytes / inner_bw, inter-node bytes / outer_bw)
where the link is the narrowest interconnect level spanning the group (all-to-all payload is split
evenly over destinations: 1/n stays local, the rest crosses the inner or the outer level).
Nothing overlaps: a step is the sum of its kernels (see docs/cost_model.md for what that misses).
"""

from __future__ import annotations

from dataclasses import dataclass

from .device import Device
from .tracer import Op


@dataclass(frozen=True)
class Priced:
    op: Op
    time: float  # seconds for one occurrence
    bound: str  # compute | memory | overhead | network | latency

    @property
    def total(self) -> float:
        return self.time * self.op.repeat


def _all_to_all(device: Device, payload: float, group: int) -> tuple[float, float]:
    """(transfer, latency) of an all-to-all whose ``payload`` is spread evenly over ``group`` ranks.

    1/group stays local; destinations inside the narrower level (a node) use that link, the rest the
    wide link; both directions run concurrently, so the slower one sets the time.
    """
    outer = device.link_for(group)
    inner = next((k for k in device.links if k.max_devices < group), None)
    near = inner.max_devices if inner else group
    transfers = [payload * (near - 1) / group / ((inner or outer).bandwidth * (inner or outer).efficiency)]
    if inner:
        transfers.append(payload * (group - near) / group / (outer.bandwidth * outer.efficiency))
    return max(transfers), outer.latency


def comm_time(device: Device, collective: str, nbytes: float, group: int) -> tuple[float, str]:
    if group <= 1:
        return 0.0, "network"
    if collective == "all_to_all":
        transfer, latency = _all_to_all(device, nbytes, group)
    else:
        link = device.link_for(group)
        factor = 2 * (group - 1) / group if collective == "all_reduce" else (group - 1) / group
        transfer, latency = factor * nbytes / (link.bandwidth * link.efficiency), link.latency
    return latency + transfer, "network" if transfer >= latency else "latency"


def price(op: Op, device: Device) -> Priced:
    if op.kind == "comm":
        assert op.comm is not None
        time, bound = comm_time(device, str(op.comm["collective"]), op.comm["bytes"], int(op.comm["group"]))
        return Priced(op, time, bound)
    compute = op.flops / (device.peak(op.compute) * device.compute_efficiency)
    memory = op.bytes / (device.hbm_bandwidth * device.memory_efficiency)
    body = max(compute, memory)
    bound = "compute" if compute >= memory else "memory"
    if device.op_overhead > body:
        bound = "overhead"
    return Priced(op, body + device.op_overhead, bound)
