"""The TP all-reduce curve from AIConfigurator's custom all-reduce tables.

Its latency and ring bus efficiency by message size on the largest group measured, and each smaller
group's own (``shapes``, match: ``group``). Separate from the kernel fits because a collective is
priced against the link bandwidth of its group, not a device's roofline bound.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .calibrate_rows import measured


def all_reduce_curve(root: Path, framework: str, link_bw: Callable[[int], float]) -> dict[str, Any]:
    """Ring bus efficiency of the framework's custom all-reduce on the most GPUs it was measured on
    (8 in an HGX node; 4 on GB200, whose tables stop at one compute tray), at each message size
    measured (from 64 KiB). Not binned to a 4x grid: the kernel changes algorithm between 16 and
    32 MiB (B200, SGLang: 57 us at 16 MiB, 170 us at 32 MiB), and a bin holding both priced the
    32 MiB all-reduce of a 4,096-token prefill at 135 us. Each smaller group measured (2 and 4 GPUs)
    has its own curve and latency under ``shapes`` (match: ``group``): the ring formula on the
    8-GPU curve does not carry to two GPUs (vLLM on B200, TP2: 17.7 us per 256 KiB all-reduce
    against its row's 7.7, 25.6 us per 8 MiB against 50.6)."""

    def select(t: Any) -> Any:
        t = t[t.allreduce_dtype == "bfloat16"]
        return t[t.num_gpus == t.num_gpus.max()]

    found = measured(root, ("comm", "custom_allreduce_perf.parquet"), framework, select)
    kernel = found.rows.kernel_source.iloc[0]

    def smaller(t: Any) -> Any:
        t = t[(t.allreduce_dtype == "bfloat16") & (t.kernel_source == kernel)]
        return t[t.num_gpus < t.num_gpus.max()]

    groups = measured(root, ("comm", "custom_allreduce_perf.parquet"), framework, smaller).rows
    top = _ring_curve(found.rows, link_bw)
    shapes = [
        {"match": {"group": int(gpus)}, **_ring_curve(rows, link_bw)}
        for gpus, rows in sorted(groups.groupby("num_gpus"), key=lambda kv: kv[0])
    ]
    return {
        "latency_us": top.pop("overhead_us"),
        **top,
        "source": f"{found.source}, {int(found.rows.num_gpus.max())} GPUs, at each message size measured; "
        "shapes: each smaller group measured (match: group), its latency as overhead_us",
        "shapes": shapes,
    }


def _ring_curve(table: Any, link_bw: Callable[[int], float]) -> dict[str, Any]:
    """``{overhead_us, bytes, efficiency}`` of one group size's all-reduce rows: its least latency and
    the ring bus efficiency of the time above it at each message size measured (from 64 KiB)."""
    table = table.sort_values("message_size")
    gpus = int(table.num_gpus.max())
    latency = float(table.latency.min())
    nbytes = table.message_size * 2  # message_size counts bf16 elements
    eff = 2 * (gpus - 1) / gpus * nbytes / ((table.latency - latency).clip(lower=1e-4) * 1e-3) / link_bw(gpus)
    frame = table.assign(nbytes=nbytes, eff=eff.clip(upper=1.0))
    medians = frame[frame.nbytes >= 2**16].groupby("nbytes").eff.median()
    return {
        "overhead_us": round(latency * 1e3, 2),
        "bytes": [int(x) for x in medians.index],
        "efficiency": [max(0.001, round(float(v), 3)) for v in medians],
    }
