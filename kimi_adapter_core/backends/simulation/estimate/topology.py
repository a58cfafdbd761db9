"""What a priced layout assumes about the devices' topology, stated where the data would not say it.

A TP all-reduce or an EP all-to-all over more devices than one NVLink domain holds is priced on the
profile's next interconnect level; one over more GPUs than a node of the measured data held (GB200:
AIConfigurator's system file has 4 GPUs per node, kadapt's profile one 72-GPU NVL72 domain) reads
curves measured on fewer GPUs than it spans. Both are assumptions the numbers rest on, so
``simulate`` notes them for its layout (``layout_notes``) and a sweep's report each group size that
makes one, with the layouts of its rows that have such a group (``topology_notes``). Torch-free: the
device profile, its kernel table and ``aiconfigurator.GPUS_PER_NODE`` (no extra).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ....errors import KadaptError
from ..model.parallel import Parallel
from ..tables.device import Device
from ..tables.kernels import KernelTable
from .aiconfigurator import GPUS_PER_NODE, SYSTEMS
from .cost import kernel_table


@dataclass(frozen=True)
class TopologyNote:
    id: str  # "T1": how rows refer to it
    devices: int  # the group size the note is about
    layouts: tuple[str, ...]  # the reported layouts with a TP or EP group of that size
    text: str


def groups(par: Parallel) -> tuple[tuple[str, int], ...]:
    """The collective groups of a layout: TP (all-reduce) and EP (all-to-all), those of 2+ devices."""
    return tuple((kind, size) for kind, size in (("TP", par.tp), ("EP", par.ep)) if size > 1)


def measured_node(table: KernelTable | None) -> tuple[str, int] | None:
    """(AIConfigurator system, GPUs per node) of the data behind ``table``'s collectives, None when the
    table does not come from AIConfigurator's systems (or there is no table)."""
    if table is None:
        return None
    system = SYSTEMS.get(table.measured_on("all_reduce") or "")
    return (system, GPUS_PER_NODE[system]) if system in GPUS_PER_NODE else None


def group_note(device: Device, table: KernelTable | None, size: int) -> str | None:
    """What kadapt assumes for a TP or EP group of ``size`` devices on ``device``, None when nothing
    the profile or the measured data would contradict (a group inside one node of both)."""
    domain = device.links[0]
    node = measured_node(table)
    if size > domain.max_devices:
        try:
            outer = device.link_for(size)
        except KadaptError:  # the sweep skips such a layout, with this reason
            return None
        spans = math.ceil(size / domain.max_devices)
        text = (
            f"a TP or EP group of {size} devices spans {spans} {domain.name} domains of "
            f"{domain.max_devices}: kadapt prices what leaves a domain on {outer.name} "
            f"({outer.bandwidth / 1e9:g} GB/s per device): the TP all-reduce as one ring at that level's "
            f"bandwidth, efficiency {outer.efficiency:g} and latency {outer.latency * 1e6:g} us, the EP "
            f"all-to-all's rows to other domains at its bandwidth and the rest on {domain.name}"
        )
        if node is not None and node[1] != domain.max_devices:
            text += f"; AIConfigurator's {node[0]} data has {node[1]} GPUs per node"
        return text
    if node is None or size <= node[1] or node[1] == domain.max_devices:
        return None
    system, gpus = node
    assert table is not None
    return (
        f"a TP or EP group of {size} devices is priced inside one {domain.name} domain "
        f"({domain.max_devices} devices, {domain.bandwidth / 1e9:g} GB/s per device), but AIConfigurator's "
        f"{system} data behind kernel table {table.name} has {gpus} GPUs per node: kadapt assumes "
        f"{size} GPUs reach each other as the {gpus} of a measured node do (no hop between nodes priced; a "
        f"TP all-reduce over such a group at the efficiency measured on {gpus} GPUs)"
    )


def layout_notes(device: Device, table: KernelTable | None, par: Parallel) -> list[str]:
    """``simulate``'s notes for one layout: each TP or EP group size that makes an assumption."""
    found: list[str] = []
    for size in dict.fromkeys(size for _, size in groups(par)):
        text = group_note(device, table, size)
        if text is not None:
            kinds = " and ".join(f"{kind}{size}" for kind, n in groups(par) if n == size)
            found.append(f"topology ({kinds}): {text}")
    return found


def topology_notes(
    device: Device, framework: str, layouts: Iterable[tuple[str, Parallel]]
) -> tuple[list[TopologyNote], dict[str, tuple[str, ...]]]:
    """The notes the reported ``layouts`` (name, layout) need, one per group size, and each layout's
    note ids (a layout needing none maps to ``()``)."""
    table = kernel_table(device, framework)
    texts: dict[int, str | None] = {}
    users: dict[int, list[str]] = {}
    of_layout: dict[str, list[int]] = {}
    for name, par in layouts:
        sizes = of_layout.setdefault(name, [])
        for _, size in groups(par):
            if size not in texts:
                texts[size] = group_note(device, table, size)
            if texts[size] is not None and size not in sizes:
                sizes.append(size)
                users.setdefault(size, []).append(name)
    ordered = sorted(users)
    ids = {size: f"T{i}" for i, size in enumerate(ordered, 1)}
    notes = [TopologyNote(ids[s], s, tuple(users[s]), texts[s] or "") for s in ordered]
    return notes, {name: tuple(ids[s] for s in sorted(sizes)) for name, sizes in of_layout.items()}
