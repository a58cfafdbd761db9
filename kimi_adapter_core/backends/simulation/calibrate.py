"""Derive a kernel-efficiency table (``kernels/*.yaml``) from AIConfigurator's measured kernel tables.

Run: ``python -m kimi_adapter_core.backends.simulation.calibrate [--system h200_sxm] [--out PATH]``
(needs the ``measured`` extra: ``aiconfigurator-core``, Apache-2.0, whose parquet tables hold NVIDIA's
measured kernel latencies). The simulator never imports this module: it reads the YAML it writes.

Every efficiency is the fraction of kadapt's *own* roofline bound a measured kernel reached:
``eff = ideal / (measured - op_overhead)`` with ``ideal = max(flops / peak, bytes / hbm_bw)`` computed
exactly as ``cost.py`` computes it for the same op (same FLOP and byte formulas, bf16 activations,
the weight's packed bytes), so pricing ``ideal / eff + op_overhead`` reproduces the measurement.
Each grid point is the median over the table's shapes at that point (model-sized N, K only: 256 to
16384), which keeps one odd kernel from setting the curve. Rows faster than 3 op overheads are
dropped (their time is launch cost, not work).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ...atomic import atomic_write_text
from .device import get_device
from .kernels import KERNELS_DIR

OVERHEAD_MS = 0.002  # the device profile's op_overhead (2 us on Hopper)
M_GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SEQ_GRID = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
BYTES_GRID = [2**p for p in range(16, 34, 2)]  # 64 KiB .. 8 GiB read per decode-attention call
MOE_GRID = [0.25, 1, 4, 16, 64, 256, 1024]  # token-expert pairs per local expert


def _tables(system: str) -> Path:
    import aiconfigurator_core

    return Path(aiconfigurator_core.__file__).parent / "systems" / "data" / system


def _median_curve(frame: Any, key: str, grid: list[float], value: str = "eff") -> list[float]:
    """Median of ``value`` at each grid point (rows binned to the nearest grid point in log space)."""
    import numpy as np

    logs = np.log([float(g) for g in grid])
    index = np.abs(np.log(frame[key].astype(float).to_numpy())[:, None] - logs[None, :]).argmin(axis=1)
    frame = frame.assign(_bin=index)
    medians = frame.groupby("_bin")[value].median()
    out = [float(medians.get(i, float("nan"))) for i in range(len(grid))]
    known = [(i, v) for i, v in enumerate(out) if not math.isnan(v)]
    # a grid point with no rows takes its nearest measured neighbour's value
    return [
        round(v if not math.isnan(v) else min(known, key=lambda kv: abs(kv[0] - i))[1], 3)
        for i, v in enumerate(out)
    ]


def _eff(frame: Any, ideal_ms: Callable[[Any], Any], min_ideal_ms: float = 0.0) -> Any:
    """Rows with their efficiency; launch-bound rows (faster than 3 overheads, or whose ideal time is
    under ``min_ideal_ms``) say nothing about the kernel's throughput and are dropped."""
    frame = frame.assign(ideal=ideal_ms(frame))
    frame = frame[(frame.latency > 3 * OVERHEAD_MS) & (frame.ideal >= min_ideal_ms)].copy()
    frame["eff"] = (frame.ideal / (frame.latency - OVERHEAD_MS)).clip(upper=1.0)
    return frame


def gemm_curves(root: Path, peak: dict[str, float], bw: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Dense GEMMs, two curves per dtype: the compute efficiency by M over compute-bound rows and the
    memory efficiency by bytes moved over memory-bound rows (small weights stream badly)."""
    import pandas as pd

    table = pd.read_parquet(next(root.glob("gemm/trtllm/*/gemm_perf.parquet")))
    table = table[table.n.between(256, 16384) & table.k.between(256, 16384)]
    compute: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    for dtype, key, wbytes in (
        ("bfloat16", "bf16", 2.0),
        ("fp8", "fp8", 1.0),
        ("fp8_block", "fp8_block", 1.0),
    ):
        rows = table[table.gemm_dtype == dtype]
        unit = peak["bf16" if key == "bf16" else "fp8"]
        rows = rows.assign(
            flops_ms=2.0 * rows.m * rows.n * rows.k / unit * 1e3,
            nbytes=2.0 * rows.m * rows.k + wbytes * rows.n * rows.k + 2.0 * rows.m * rows.n,
        )
        rows = rows.assign(bytes_ms=rows.nbytes / bw * 1e3)
        bound = rows.flops_ms >= rows.bytes_ms
        heavy = _eff(rows[bound], lambda f: f.flops_ms)
        light = _eff(rows[~bound], lambda f: f.bytes_ms)
        compute[key] = {"m": M_GRID, "efficiency": _median_curve(heavy, "m", M_GRID)}
        memory[key] = {"bytes": BYTES_GRID, "efficiency": _median_curve(light, "nbytes", BYTES_GRID)}
    return compute, memory


def moe_curves(root: Path, peak: dict[str, float], bw: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Grouped expert GEMMs by token-expert pairs per local expert; balanced routing sets the curve,
    the power-law/balanced latency ratio at the same shape sets the imbalance factor."""
    import pandas as pd

    sources = [
        ("trtllm", "moe_torch_flow_cutlass", "fp8_block", "fp8_block", 1.0 + 4 / 16384, "fp8"),
        ("trtllm", "moe_torch_flow_cutlass", "fp8", "fp8", 1.0, "fp8"),
        ("trtllm", "moe_torch_flow_cutlass", "bfloat16", "bf16", 2.0, "bf16"),
        ("sglang", "sglang_marlin_moe", "int4_wo", "w4a16", 0.5 + 2 / 32, "bf16"),
    ]
    curves: dict[str, Any] = {}
    factors: dict[str, Any] = {}
    for framework, kernel, dtype, key, wbytes, unit_key in sources:
        found = []  # the framework version that measured this kernel most widely
        for candidate in root.glob(f"moe/{framework}/*/moe_perf.parquet"):
            rows = pd.read_parquet(candidate)
            rows = rows[(rows.kernel_source == kernel) & (rows.moe_dtype == dtype) & (rows.moe_tp_size == 1)]
            # fine-grained MoE of large models (DeepSeek-V3, Kimi-K2.5, Qwen3-235B)
            rows = rows[(rows.hidden_size >= 4096) & (rows.num_experts >= 64)]
            found.append((len(rows), str(candidate), rows))
        _, path_text, table = max(found, key=lambda item: item[:2])
        path = Path(path_text)
        local = table.num_experts / table.moe_ep_size
        pairs = table.num_tokens * table.topk / table.moe_ep_size
        table = table.assign(pairs_per_expert=pairs / local, pairs=pairs, local=local)
        unit = peak[unit_key]

        def ideal(f: Any, unit: float = unit, wbytes: float = wbytes) -> Any:
            per_expert = 3.0 * f.hidden_size * f.inter_size
            touched = f.local * (1 - (1 - 1 / f.local) ** f.pairs)
            nbytes = touched * per_expert * wbytes + f.pairs * (2 * f.hidden_size + 3 * f.inter_size) * 2
            return (2.0 * f.pairs * per_expert / unit).combine(nbytes / bw, max) * 1e3

        balanced = table[table.distribution == "balanced"]
        # the fixed cost of the routed-expert pipeline (permute, two GEMMs, activation, unpermute):
        # single-token latency minus its ideal time, median over shapes
        single = balanced[balanced.num_tokens == 1]
        floor_ms = float((single.latency - ideal(single)).median())
        usable = balanced.assign(latency=balanced.latency - floor_ms + OVERHEAD_MS)
        curves[key] = {
            "pairs_per_expert": MOE_GRID,
            "efficiency": _median_curve(_eff(usable, ideal), "pairs_per_expert", MOE_GRID),
            "overhead_us": round(floor_ms * 1e3, 1),
            "source": f"{path.relative_to(root.parent.parent)} ({kernel}, {dtype}, balanced)",
        }
        shape = ["num_tokens", "hidden_size", "inter_size", "topk", "num_experts", "moe_ep_size"]
        skewed = table[table.distribution == "power_law_1.01"][[*shape, "latency"]]
        joined = balanced.merge(skewed, on=shape, suffixes=("", "_skewed"))
        joined = joined.assign(ratio=joined.latency_skewed / joined.latency)
        factors[key] = {
            "pairs_per_expert": MOE_GRID,
            "factor": _median_curve(joined, "pairs_per_expert", MOE_GRID, "ratio"),
        }
    return curves, factors


def attention_curves(root: Path, peak: dict[str, float], bw: float) -> dict[str, Any]:
    import pandas as pd

    bf16 = peak["bf16"]
    ctx = pd.read_parquet(next(root.glob("attention/trtllm/*/context_attention_perf.parquet")))
    ctx = ctx[(ctx.attn_dtype == "bfloat16") & (ctx.kv_cache_dtype == "bfloat16") & (ctx.head_dim == 128)]
    ctx = ctx[ctx.window_size == 0]

    def gqa_prefill(f: Any) -> Any:
        pairs = f.batch_size * f.num_heads * f.isl * (f.isl + 1) / 2
        nbytes = 2 * f.batch_size * f.isl * (f.num_heads + f.num_key_value_heads) * 256 * 2
        return (4.0 * pairs * 128 / bf16).combine(nbytes / bw, max) * 1e3

    gen = pd.read_parquet(next(root.glob("attention/trtllm/*/generation_attention_perf.parquet")))
    gen = gen[(gen.attn_dtype == "bfloat16") & (gen.head_dim == 128) & (gen.window_size == 0)]
    gen = gen.assign(kvb=gen.kv_cache_dtype.map({"bfloat16": 2, "fp8": 1}), ctx=gen.isl + gen.step)
    gen = gen.assign(read=gen.batch_size * gen.ctx * gen.num_key_value_heads * 256 * gen.kvb)

    def gqa_decode(f: Any) -> Any:
        pairs = f.batch_size * f.num_heads * f.ctx
        nbytes = f.read + 2 * f.batch_size * f.num_heads * 256 * 2
        return (4.0 * pairs * 128 / bf16).combine(nbytes / bw, max) * 1e3

    mla_ctx = pd.read_parquet(next(root.glob("mla/trtllm/*/context_mla_perf.parquet")))
    mla_ctx = mla_ctx[(mla_ctx.mla_dtype == "bfloat16") & (mla_ctx.kv_cache_dtype == "bfloat16")]

    def mla_prefill(f: Any) -> Any:
        pairs = f.batch_size * f.num_heads * f.isl * (f.isl + 1) / 2
        nbytes = 2 * f.batch_size * f.isl * f.num_heads * (192 + 192 + 128 + 128)
        return (2.0 * pairs * (192 + 128) / bf16).combine(nbytes / bw, max) * 1e3

    mla_gen = pd.read_parquet(next(root.glob("mla/trtllm/*/generation_mla_perf.parquet")))
    mla_gen = mla_gen[mla_gen.mla_dtype == "bfloat16"]
    mla_gen = mla_gen.assign(
        kvb=mla_gen.kv_cache_dtype.map({"bfloat16": 2, "fp8": 1}), ctx=mla_gen.isl + mla_gen.step
    )
    mla_gen = mla_gen.assign(read=mla_gen.batch_size * mla_gen.ctx * 576 * mla_gen.kvb)

    def mla_decode(f: Any) -> Any:
        pairs = f.batch_size * f.num_heads * f.ctx
        nbytes = f.read + f.batch_size * f.num_heads * (576 + 512) * 2
        return (2.0 * pairs * (576 + 512) / bf16).combine(nbytes / bw, max) * 1e3

    return {
        "prefill": {
            "gqa": {"seq": SEQ_GRID, "efficiency": _median_curve(_eff(ctx, gqa_prefill), "isl", SEQ_GRID)},
            "mla": {
                "seq": SEQ_GRID,
                "efficiency": _median_curve(_eff(mla_ctx, mla_prefill), "isl", SEQ_GRID),
            },
        },
        "decode": {
            "gqa": {
                "kv_bytes": BYTES_GRID,
                "efficiency": _median_curve(_eff(gen, gqa_decode), "read", BYTES_GRID),
            },
            "mla": {
                "kv_bytes": BYTES_GRID,
                "efficiency": _median_curve(_eff(mla_gen, mla_decode), "read", BYTES_GRID),
            },
        },
    }


def all_reduce_curve(root: Path, link_bw: float) -> dict[str, Any]:
    """Ring bus efficiency of TensorRT-LLM's custom all-reduce on 8 GPUs, by message bytes."""
    import pandas as pd

    table = pd.read_parquet(next(root.glob("comm/trtllm/*/custom_allreduce_perf.parquet")))
    table = table[table.num_gpus == 8].sort_values("message_size")
    latency = float(table.latency.min())
    nbytes = table.message_size * 2  # message_size counts bf16 elements
    eff = 2 * 7 / 8 * nbytes / ((table.latency - latency).clip(lower=1e-4) * 1e-3) / link_bw
    frame = table.assign(nbytes=nbytes, eff=eff.clip(upper=1.0))
    frame = frame[frame.nbytes >= 2**16]
    grid = [2**p for p in range(16, 31, 2)]
    return {
        "latency_us": round(latency * 1e3, 2),
        "bytes": grid,
        "efficiency": _median_curve(frame, "nbytes", grid),
    }


def calibrate(system: str, device_name: str) -> dict[str, Any]:
    device = get_device(device_name)
    peak = {k: v for k, v in device.peak_flops.items()}
    bw = device.hbm_bandwidth
    root = _tables(system)
    grouped, imbalance = moe_curves(root, peak, bw)
    gemm = gemm_curves(root, peak, bw)
    from importlib.metadata import version

    return {
        "name": f"{system}_measured",
        "source": (
            f"derived by kimi_adapter_core/backends/simulation/calibrate.py from NVIDIA AIConfigurator "
            f"(aiconfigurator-core {version('aiconfigurator-core')}, Apache-2.0) measured tables "
            f"systems/data/{system}: gemm/trtllm, moe/trtllm (cutlass) and moe/sglang (marlin int4), "
            "attention/trtllm, mla/trtllm, comm/trtllm custom_allreduce; each value is the median, over the "
            "table's shapes at that grid point, of kadapt's roofline bound / (measured latency - 2 us)"
        ),
        "gemm": gemm[0],
        "gemm_memory": gemm[1],
        "grouped_gemm": grouped,
        "routing": {"power_law": imbalance},
        "attention": attention_curves(root, peak, bw),
        "all_reduce": all_reduce_curve(root, device.link_for(8).bandwidth),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", default="h200_sxm", help="AIConfigurator system folder")
    parser.add_argument("--device", default="h200", help="kadapt device profile whose peaks set the bound")
    parser.add_argument("--out", type=Path, default=KERNELS_DIR / "hopper.yaml")
    options = parser.parse_args()
    table = calibrate(options.system, options.device)
    header = (
        "# Generated by `python -m kimi_adapter_core.backends.simulation.calibrate`; do not edit by hand.\n"
    )
    dumper = type("NoAliases", (yaml.SafeDumper,), {"ignore_aliases": lambda *_: True})
    body = yaml.dump(table, Dumper=dumper, sort_keys=False, width=120, default_flow_style=None)
    atomic_write_text(options.out, header + body)
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
