"""Derive the Atlas A3 kernel table (``kernels/atlas_a3.yaml``) from published Atlas A3 measurements.

Run: ``python -m kimi_adapter_core.backends.simulation.tables.ascend_calibrate [--out PATH]`` (no extra
needed: the measurements are the few published figures below, each with its source). The simulator never
imports this module: it reads the YAML it writes.

What is measured on the A3 and public, and used: the EP dispatch / combine kernels
(``MoeDistributeDispatchV2`` / ``MoeDistributeCombineV2``, the ones vLLM-Ascend's MC2 MoE path runs)
as timed by DeepEP-Ascend (sgl-project/sgl-kernel-npu, ``python/deep_ep``): low-latency kernels at
128 tokens per rank for EP 8/16/32 and at 32 tokens per rank, and high-throughput kernels at 4,096.
Their tests count one row per (token, expert it is routed to) - int8 rows for dispatch, bf16 for
combine - which is how ``kernels.AllToAll`` prices them.

What is not: TensorCast's measured profiling database for this chip (Ascend/msmodeling,
``tensor_cast/performance_model/profiling_database/data/ATLAS_800_A3_752T_128G_DIE``: GEMM, grouped
GEMM, FusedInferAttentionScore, RMSNorm, HCCL tables for vLLM-Ascend 0.13/0.15/0.18) is stored with
Git LFS, and every copy reachable here (the msmodeling tree at 84fec85, all 205 commits of its
history, a fork) holds 129-byte LFS pointers instead of rows. Its FusedInferAttentionScore rows would
not give an attention curve anyway: they record the KV pool's shape, not the sequence lengths
(msmodeling's own report ``FIA_KV_DIMENSION_ANALYSIS``). So the GEMM, grouped-GEMM, attention and
all-reduce curves stay the Hopper-measured ones (``base: h200_sxm_trtllm``), as the table says.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from ....atomic import atomic_write_text
from .device import get_device
from .kernels import KERNELS_DIR

SOURCE = (
    "DeepEP-Ascend (sgl-project/sgl-kernel-npu, BSD-3-Clause), A3 384 SuperPOD, pure HCCS: README "
    "'Low-Latency Kernels with Pure HCCS' (128 tokens per rank, hidden 7168, top-8, INT8 dispatch, BF16 "
    "combine: EP8 132/126 us, EP16 139/135 us, EP32 153/151 us) and 'Normal Kernels with Pure HCCS' "
    "(4096 tokens per rank: EP16 107/103 GB/s of rows received), python/deep_ep/doc/FUSED_DEEP_MOE_EN.md "
    "(batch size 32: dispatch 80 us, combine 75 us; EP not stated, taken as 16); rows counted as "
    "tests/python/deepep/test_low_latency.py and test_intranode.py count them (one per token and expert)"
)
HIDDEN, TOP_K = 7168, 8
ROW_BYTES = {"dispatch": HIDDEN * 1, "combine": HIDDEN * 2}  # int8 rows out, bf16 rows back
# microseconds per call, (dispatch, combine), at 128 tokens per rank, by EP size
LOW_LATENCY_128 = {8: (132.0, 126.0), 16: (139.0, 135.0), 32: (153.0, 151.0)}
LOW_LATENCY_32 = (16, (80.0, 75.0))  # (EP, microseconds) at 32 tokens per rank
NORMAL_4096 = (16, (107.0, 103.0))  # (EP, GB/s of rows received) at 4,096 tokens per rank
TOKENS = [32, 128, 4096]


def derive(link_bandwidth: float) -> dict[str, Any]:
    """The ``all_to_all`` section: per phase, a latency by EP size and the fraction of
    ``link_bandwidth`` (bytes/s) the rows move at, by tokens per rank.

    The per-token cost comes from the two low-latency points of one EP size (32 and 128 tokens); the
    latency of each EP size is its 128-token time minus 128 tokens at that cost; the 4,096-token
    efficiency is the high-throughput kernels' row bandwidth net of the same latency."""
    ep, small = LOW_LATENCY_32
    latency: dict[str, list[float]] = {"dispatch": [], "combine": []}
    efficiency: dict[str, list[float]] = {}
    for i, phase in enumerate(("dispatch", "combine")):
        row = TOP_K * ROW_BYTES[phase]  # bytes one token moves
        per_token = (LOW_LATENCY_128[ep][i] - small[i]) / (128 - 32)  # us
        for size in sorted(LOW_LATENCY_128):
            latency[phase].append(round(LOW_LATENCY_128[size][i] - 128 * per_token, 1))
        low = row / (per_token * 1e-6) / link_bandwidth
        normal_ep, normal_bw = NORMAL_4096
        base = latency[phase][sorted(LOW_LATENCY_128).index(normal_ep)]
        seconds = 4096 * row / (normal_bw[i] * 1e9) - base * 1e-6
        high = 4096 * row / seconds / link_bandwidth
        efficiency[phase] = [round(low, 3), round(low, 3), round(high, 3)]
    return {
        "source": SOURCE,
        "devices": sorted(LOW_LATENCY_128),
        "latency_us": latency,
        "tokens": TOKENS,
        "efficiency": efficiency,
    }


def calibrate(device_name: str = "atlas_800_a3") -> dict[str, Any]:
    device = get_device(device_name)
    ep = LOW_LATENCY_32[0]
    return {
        "name": "atlas_a3_measured",
        "base": "h200_sxm_trtllm",
        "source": (
            "derived by kimi_adapter_core/backends/simulation/tables/ascend_calibrate.py from published "
            "Atlas A3 "
            "measurements of the EP dispatch/combine kernels (all_to_all.source), as fractions of the "
            f"{device.name} profile's {device.link_for(ep).name} bandwidth. No Ascend GEMM, grouped-GEMM or "
            "attention measurements are available (TensorCast's profiling database is Git LFS pointers "
            "in every reachable copy): those curves are the Hopper ones"
        ),
        "all_to_all": derive(device.link_for(ep).bandwidth),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="atlas_800_a3", help="kadapt device profile whose link sets the bound"
    )
    parser.add_argument("--out", type=Path, default=KERNELS_DIR / "atlas_a3.yaml")
    options = parser.parse_args()
    header = (
        "# Generated by `python -m kimi_adapter_core.backends.simulation.tables.ascend_calibrate`; "
        "do not edit by hand.\n"
    )
    dumper = type("NoAliases", (yaml.SafeDumper,), {"ignore_aliases": lambda *_: True})
    body = yaml.dump(
        calibrate(options.device), Dumper=dumper, sort_keys=False, width=120, default_flow_style=None
    )
    atomic_write_text(options.out, header + body)
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
