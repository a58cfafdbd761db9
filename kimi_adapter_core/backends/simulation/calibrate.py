"""Derive kernel-efficiency tables (``kernels/*.yaml``) from AIConfigurator's measured kernel tables.

Run: ``python -m kimi_adapter_core.backends.simulation.calibrate`` (every shipped table) or
``... --system h200_sxm --framework sglang [--out PATH]`` (one). Needs the ``measured`` extra
(``aiconfigurator-core``, Apache-2.0, whose parquet tables hold NVIDIA's measured kernel latencies).
The simulator never imports this module: it reads the YAML it writes.

One table per AIConfigurator system and serving framework (``<system>_<framework>.yaml``). Each curve
comes from the NEWEST version of that framework that measured the kernel - not the version with the
most rows: an old SGLang's int4 Marlin MoE kernel is ~4.7x slower than the current one, and a curve
fitted to it priced Kimi-K2.5's experts 4x too slow. Within that version the kernel with the most
rows at the selected shapes is taken (ties: the later name, which picks the CUDA-graph all-reduce
lane over the eager one). Where the framework measured no such kernel on the system (TensorRT-LLM
has no int4 MoE) the other frameworks are tried in ``FRAMEWORKS`` order; vLLM measured its MLA only
as a whole module, and its MLA curves come from those rows (``mla_module_curves``). Every curve
records what it came from in its ``source`` (system/op/framework/version/file and the kernel), so
the choice is visible in the table.

Every efficiency is the fraction of kadapt's *own* roofline bound a measured kernel reached:
``eff = ideal / (measured - op_overhead)`` with ``ideal = max(flops / peak, bytes / hbm_bw)`` computed
exactly as ``cost.py`` computes it for the same op (same FLOP and byte formulas, bf16 activations,
the weight's packed bytes), on the kadapt profile of the measuring device (``SYSTEMS``), so pricing
``ideal / eff + op_overhead`` reproduces the measurement on that device. Each grid point is the
median over the table's shapes at that point (model-sized N, K only: 256 to 16384), which keeps one
odd kernel from setting the curve. Rows faster than 3 op overheads are dropped (their time is launch
cost, not work). ``row_filter`` lets a caller fit on part of the data (the held-out experiment in
``benchmarks/bench_simulation.py``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from packaging.version import InvalidVersion, Version

from ...atomic import atomic_write_text
from ...errors import KadaptError
from .device import get_device
from .kernels import KERNELS_DIR, Curve

OVERHEAD_MS = 0.002  # the device profiles' op_overhead (2 us on Hopper and Blackwell)
M_GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SEQ_GRID = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
BYTES_GRID = [2**p for p in range(16, 34, 2)]  # 64 KiB .. 8 GiB read per decode-attention call
MOE_GRID = [0.25, 1, 4, 16, 64, 256, 1024]  # token-expert pairs per local expert
FRAMEWORKS = ("trtllm", "sglang", "vllm")  # the order a missing kernel is borrowed in
# AIConfigurator system -> the kadapt device profile measured there (its peaks set the bound)
SYSTEMS = {"h100_sxm": "h100", "h200_sxm": "h200", "b200_sxm": "b200", "gb200": "gb200"}
# kadapt grouped-GEMM kernel -> (AIConfigurator moe_dtype, weight bytes per parameter, peak key)
MOE_DTYPES = {
    "fp8_block": ("fp8_block", 1.0 + 4 / 16384, "fp8"),
    "fp8": ("fp8", 1.0, "fp8"),
    "bf16": ("bfloat16", 2.0, "bf16"),
    "w4a16": ("int4_wo", 0.5 + 2 / 32, "bf16"),
}
RowFilter = Callable[[str, Any], Any]  # (op, rows) -> the rows to fit on
# op attribute -> the measured table's column: the shape a per-shape curve is fitted at and matched by
EXPERT_SHAPE = {
    "hidden": "hidden_size",
    "width": "inter_size",
    "experts": "num_experts",
    "top_k": "topk",
    "ep": "moe_ep_size",
}
# the expert table times the kernel as AIConfigurator's TP/EP graph runs it (every rank holds all
# tokens; its attention-DP graphs price DeepEP-path tables instead): a shape's own curve prices that
# layout only (at EP64, 4 experts per rank, the power-law rows run 3.6x balanced - the hottest rank
# of a TP-path broadcast - which would triple a wide-EP decode's experts)
EXPERT_LAYOUT = {"attention_dp": 1}
# likewise the standalone attention rows: AIConfigurator's attention-DP graphs price MLA as modules
# measured under DP attention, so a head count's own curve prices layouts without attention DP
ATTENTION_LAYOUT = {"attention_dp": 1}
MLA_SHAPE = {"heads": "num_heads"}  # query heads per rank
GQA_SHAPE = {"heads": "num_heads", "kv_heads": "num_key_value_heads"}
DECODE_SHAPE = {"kv_dtype": "kv_cache_dtype"}  # decode reads either cache dtype; prefill rows are bf16
KV_DTYPES = {"bfloat16": "bf16", "fp8": "fp8"}  # AIConfigurator's cache dtype -> kadapt's kv_dtype
BY_SHAPE = (
    "the curve is the median over every shape measured; each of shapes is the same fit on the rows of "
    "one shape only (match: the op attributes it is measured at), which prices an op of that shape"
)
BY_CACHE = "; after them one curve per cache dtype (match: kv_dtype alone) for a shape not measured"
# a prefill call's sequences: the table measured each shape at several, and one sequence of 1,024
# tokens at 8 query / 1 KV head per rank (GB200, TensorRT-LLM) takes 29 us where the median over
# batches at that length gives 7 us, so a prefill shape's rows are fitted per batch as well
PREFILL_BATCH = {"batch": "batch_size"}
BY_BATCH = (
    "prefill shapes come first per batch (match: batch, the sequences of one call), each fitted on "
    "that batch's rows only, then per shape over every batch (the median at each length) for a batch "
    "not measured"
)
# The MLA attention module (vLLM's ``DeepseekV2MLAAttention`` forward: q_a + kv_a, norms, q_b, rope,
# the attention with its absorbed bmms, o_proj) measured whole, for a framework that measured no
# standalone MLA kernel: AIConfigurator measured it on DeepSeek-V3 only, whose MLA sizes these are
MLA_MODULE_MODEL = "deepseek-ai/DeepSeek-V3"
MLA_MODULE = {"hidden": 7168, "q_lora": 1536, "kv_lora": 512, "rope": 64, "nope": 128, "v": 128}
# the module's projection dtype (gemm_type) -> (kadapt kernel, weight bytes per parameter, peak key)
MODULE_GEMMS = {"bfloat16": ("bf16", 2.0, "bf16"), "fp8_block": ("fp8_block", 1.0, "fp8")}
MODULE_ATTENTION_SHAPE = MLA_SHAPE | DECODE_SHAPE
FLOOR_WORK_MS = 0.002  # a GEMM row whose ideal time is this short measures the call's fixed cost
FLOOR_READ_MS = 0.001  # a decode module row whose cache read is this short measures the module's floor
MODULE_SHAPE = MODULE_ATTENTION_SHAPE | {"projections": "gemm_type"}


def _tables(system: str) -> Path:
    import aiconfigurator_core

    return Path(aiconfigurator_core.__file__).parent / "systems" / "data" / system


def _version(text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        return Version("0")


@dataclass(frozen=True)
class Measured:
    """The rows one curve is fitted on and where they came from."""

    rows: Any  # pandas DataFrame
    source: str  # <system>/<op>/<framework>/<version>/<file> (<kernel>)


def _all_rows(_op: str, rows: Any) -> Any:
    return rows


@lru_cache(maxsize=4)
def _read_table(path: Path) -> Any:
    """One of AIConfigurator's measured tables (a DataFrame), kept for the next fits of the same table
    (``calibrate`` clears it): each expert and GEMM dtype and both all-reduce fits select from the same
    file (a table's fits read 15-19 files, 7-8 distinct; up to 25 MB each, hence only the last few).
    Shared, so its users only select from it."""
    import pandas as pd

    return pd.read_parquet(path)


def measured(
    root: Path,
    pattern: tuple[str, str],
    framework: str,
    select: Callable[[Any], Any],
    row_filter: RowFilter = _all_rows,
    served: tuple[str, ...] = (),
) -> Measured:
    """The rows ``select`` keeps from the newest version of ``framework`` (then of the others, in
    ``FRAMEWORKS`` order) that has any, narrowed to the kernel with the most of them - unless no
    ``served`` shape (those columns) was measured by two kernels: then the kernels are the
    framework's dispatch, one per shape, and every row is kept (vLLM 0.24's fp8-block GEMMs on
    Hopper: FlashInfer at M <= 17, 58 us per call at M = 1 on H200, DeepGEMM from M = 32, 85 us; the
    DeepGEMM rows alone priced every decode GEMM at their 85 us)."""
    op, file = pattern
    for candidate in (framework, *(f for f in FRAMEWORKS if f != framework)):
        paths = sorted(root.glob(f"{op}/{candidate}/*/{file}"), key=lambda p: _version(p.parent.name))
        for path in reversed(paths):
            rows = row_filter(op, select(_read_table(path)))
            if len(rows) == 0:
                continue
            counts = rows.kernel_source.value_counts()
            where = path.relative_to(root.parent)
            if served and len(counts) > 1 and rows.groupby(list(served)).kernel_source.nunique().max() == 1:
                return Measured(rows.copy(), f"{where} ({', '.join(sorted(counts.index))}: one per shape)")
            kernel = max(counts.index, key=lambda name: (int(counts[name]), str(name)))
            return Measured(
                rows[rows.kernel_source == kernel].copy(),
                f"{where} ({kernel})",
            )
    raise KadaptError(f"AIConfigurator's {root.name} tables hold no {op}/{file} rows for {framework}")


def _median_curve(frame: Any, key: str, grid: list[float], value: str = "eff") -> list[float]:
    """Median of ``value`` at each grid point (rows binned to the nearest grid point in log space)."""
    return _binned_curve(frame[key].to_numpy(float), frame[value].to_numpy(float), grid, key)


def _binned_curve(x: Any, values: Any, grid: list[float], key: str) -> list[float]:
    """``_median_curve`` of two arrays (the rows' ``key`` and their values)."""
    import numpy as np

    logs = np.log([float(g) for g in grid])
    index = np.abs(np.log(x)[:, None] - logs[None, :]).argmin(axis=1)
    out = [float("nan")] * len(grid)
    for i, median in zip(*_medians_by(index, values), strict=True):
        out[i] = float(median)
    known = [(i, v) for i, v in enumerate(out) if not math.isnan(v)]
    if not known:
        raise KadaptError(f"no usable rows to fit a curve by {key}")
    # a grid point with no rows takes its nearest measured neighbour's value; three decimals, but
    # never 0 (a table's efficiencies are positive: a kernel under 0.05% of its bound is 0.001)
    return [
        max(0.001, round(v if not math.isnan(v) else min(known, key=lambda kv: abs(kv[0] - i))[1], 3))
        for i, v in enumerate(out)
    ]


def _exact_curve(
    frame: Any, key: str, value: str = "eff", names: tuple[str, str] | None = None
) -> dict[str, Any]:
    """``{axis: points, values: medians}`` (``names``, default ``key`` and ``efficiency``; empty without
    rows): the median of ``value`` at every distinct ``key`` measured, for the rows of one shape,
    whose measured points are the curve's own grid. None is binned to a shared grid: MLA decode at
    8 heads per rank reads 604 MB at 0.80 of its bound at every batch, but the 4x-wide bin around it
    mixes in reads twice and half as large (0.70 median)."""
    axis, name = names or (key, "efficiency")
    return _point_curve(frame[key].to_numpy(float), frame[value].to_numpy(float), (axis, name))


def _point_curve(x: Any, values: Any, names: tuple[str, str]) -> dict[str, Any]:
    """``_exact_curve`` of two arrays (the rows' points and their values), ``names`` its keys: the
    per-shape expert fits run on arrays, a few pandas operations per shape being most of their time."""
    points, medians = _medians_by(_four_digits(x), values)
    if not len(points):
        return {}
    axis, name = names
    return {axis: [float(p) for p in points], name: [max(0.001, round(float(v), 3)) for v in medians]}


def _four_digits(values: Any) -> Any:
    """``values`` (a float array) at four significant digits, as ``f"{x:.4g}"`` writes each: the
    measured points of one shape, which the tables' axes record. Formatted once per distinct value
    (a table repeats each point over its other columns)."""
    import numpy as np

    distinct, where = np.unique(values, return_inverse=True)
    return np.array([float(f"{x:.4g}") for x in distinct.tolist()])[where]


def _medians_by(keys: Any, values: Any) -> tuple[Any, Any]:
    """The distinct ``keys`` ascending and the median of ``values`` at each (arrays, no NaN: the
    measured tables hold none), taken as pandas' groupby median takes it - the middle value, or the
    mean of the two middle ones at an even count - so a curve is the same to the last bit. In numpy,
    sorted once: the fits take thousands of medians per table, and a pandas groupby for each shape's
    took a quarter of a table's time."""
    import numpy as np

    order = np.lexsort((values, keys))  # by key, then value
    keys, values = keys[order], values[order]
    points, first, count = np.unique(keys, return_index=True, return_counts=True)
    return points, (values[first + (count - 1) // 2] + values[first + count // 2]) / 2


def _by_shape(frame: Any, columns: dict[str, str]) -> list[tuple[dict[str, int | str], Any]]:
    """The rows of ``frame`` per distinct shape, each with its ``match`` (op attribute -> the value of
    the table column it is measured as, in kadapt's terms), in the table's order."""

    def value(v: Any) -> int | str:
        return KV_DTYPES.get(v, v) if isinstance(v, str) else int(v)

    groups = frame.groupby(list(columns.values()), sort=True)
    return [(dict(zip(columns, map(value, values), strict=True)), rows) for values, rows in groups]


def _shape_curves(
    frame: Any,
    columns: dict[str, str],
    fit: Callable[[Any], dict[str, Any]],
    layout: dict[str, int] | None = None,
) -> list[Any]:
    """``fit`` on the rows of each measured shape, with its ``match`` (plus ``layout``: what every row
    was measured under); a shape whose rows are all launch-bound (dropped by ``_eff``) gets no curve
    and prices with the median one."""
    fitted = [(match, fit(rows)) for match, rows in _by_shape(frame, columns)]
    return [{"match": match | (layout or {}), **curve} for match, curve in fitted if curve]


def _prefill_shapes(rows: Any, columns: dict[str, str], fit: Callable[[Any], dict[str, Any]]) -> list[Any]:
    """A prefill attention curve's ``shapes``: each shape at each measured batch first (``measured_at``
    takes the first match, so a measured batch x length prices from its own rows: at one sequence the
    kernel is launch- and occupancy-bound, 0.2x the efficiency of the batches that set the median),
    then each shape over every batch, which prices the batches not measured."""
    return _shape_curves(rows, columns | PREFILL_BATCH, fit, ATTENTION_LAYOUT) + _shape_curves(
        rows, columns, fit, ATTENTION_LAYOUT
    )


def _by_cache_dtype(rows: Any, key: str, axis: str) -> list[Any]:
    """A decode curve's fallbacks, after its exact shapes: one curve per cache dtype (match:
    ``kv_dtype`` alone, the median over every shape of that dtype), for a shape not measured; none
    where one dtype was measured. A cache dtype can set the kernel: SGLang's MLA decode with an FP8
    cache takes 1.04 ms at 128 x 4k on H200 against 0.156 ms with a bf16 one, flat in heads, and the
    median over both priced an unmeasured head count's FP8 cache at 0.73-0.75 of AIConfigurator."""
    groups = _by_shape(rows, DECODE_SHAPE)
    if len(groups) < 2:
        return []
    return [
        {
            "match": match | ATTENTION_LAYOUT,
            axis: BYTES_GRID,
            "efficiency": _median_curve(own, key, BYTES_GRID),
        }
        for match, own in groups
    ]


def _eff(frame: Any, ideal_ms: Callable[[Any], Any]) -> Any:
    """Rows with their ``ideal`` time and efficiency, less the launch-bound ones (``_efficiency``)."""
    ideal = ideal_ms(frame).to_numpy()
    keep, eff = _efficiency(frame.latency.to_numpy(), ideal)
    return frame[keep].assign(ideal=ideal[keep], eff=eff)


def _efficiency(latency: Any, ideal: Any) -> tuple[Any, Any]:
    """Which rows to keep (arrays of ms) and their efficiencies: launch-bound rows (faster than 3
    overheads) say nothing about the kernel's throughput and are dropped."""
    import numpy as np

    keep = latency > 3 * OVERHEAD_MS
    return keep, np.minimum(ideal[keep] / (latency[keep] - OVERHEAD_MS), 1.0)


def gemm_curves(
    root: Path, framework: str, peak: dict[str, float], bw: float, row_filter: RowFilter
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Dense GEMMs, three curves per dtype: the fixed cost of one call by M (``_gemm_floor``), and, net
    of it, the compute efficiency by M over compute-bound rows and the memory efficiency by bytes
    moved over memory-bound rows (small weights stream badly)."""
    compute: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    floors: dict[str, Any] = {}
    for dtype, key, wbytes in (
        ("bfloat16", "bf16", 2.0),
        ("fp8", "fp8", 1.0),
        ("fp8_block", "fp8_block", 1.0),
    ):

        def select(t: Any, dtype: str = dtype) -> Any:
            return t[(t.gemm_dtype == dtype) & t.n.between(256, 16384) & t.k.between(256, 16384)]

        found = measured(root, ("gemm", "gemm_perf.parquet"), framework, select, row_filter, ("m", "n", "k"))
        rows = found.rows
        unit = peak["bf16" if key == "bf16" else "fp8"]
        rows = rows.assign(
            flops_ms=2.0 * rows.m * rows.n * rows.k / unit * 1e3,
            nbytes=2.0 * rows.m * rows.k + wbytes * rows.n * rows.k + 2.0 * rows.m * rows.n,
        )
        rows = rows.assign(bytes_ms=rows.nbytes / bw * 1e3)
        floor = _gemm_floor(rows)
        fixed = Curve(tuple(floor["m"]), tuple(us * 1e-3 for us in floor["latency_us"]))
        at_m = {m: fixed(m) for m in rows.m.unique().tolist()}  # each M once: thousands of rows share it
        rows = rows.assign(net=rows.latency - rows.m.map(at_m))
        bound = rows.flops_ms >= rows.bytes_ms
        heavy = _net_eff(rows[bound], rows.flops_ms[bound])
        light = _net_eff(rows[~bound], rows.bytes_ms[~bound])
        floors[key] = {
            **floor,
            "source": (
                f"{found.source}: the median latency of the calls whose work takes under "
                f"{FLOOR_WORK_MS * 1e3:g} us at the peaks, at each M measured (the curves of gemm and "
                "gemm_memory are fitted net of it)"
            ),
        }
        compute[key] = {"m": M_GRID, "efficiency": _median_curve(heavy, "m", M_GRID), "source": found.source}
        memory[key] = {
            "bytes": BYTES_GRID,
            "efficiency": _median_curve(light, "nbytes", BYTES_GRID),
            "source": found.source,
        }
    return compute, memory, floors


def _net_eff(rows: Any, ideal_ms: Any) -> Any:
    """GEMM rows with their efficiency net of the call's fixed cost (``net``: latency less the
    floor at its M): every row is kept, one within its floor having done its work in no measurable
    time (1). Dropping the rows near the floor, as the launch-bound rows of the other kernels are
    (``_eff``), kept only the noisy slow ones at small sizes: the median memory efficiency of
    TensorRT-LLM's small bf16 GEMMs on H200 fell so low that DeepSeek-V3's router GEMM took 10 us
    against its 5 us rows."""
    return rows.assign(eff=(ideal_ms / rows.net.clip(lower=1e-6)).clip(upper=1.0))


def _gemm_floor(rows: Any) -> dict[str, list[float]]:
    """The fixed cost in us of one GEMM call at each M measured (``{m, latency_us}``): the median
    latency of the rows whose ideal time is under ``FLOOR_WORK_MS`` (their time is the call, not the
    work), at least the op overhead. Most kernels' is 3-14 us; vLLM 0.24's fp8-block rows (DeepGEMM)
    take 0.085 ms on H200, 0.18 ms on B200 and 0.30 ms on GB200 at any shape (0.27 / 0.53 ms at M = 1
    on Blackwell, and ~60 us more at an M not a multiple of 4, so not binned to a grid), which no
    efficiency of the bound prices: the median efficiency at M = 1,024, set by the floor-bound small
    shapes, priced a 1,024-token 512 x 7,168 GEMM on GB200 at 0.38 ms against its 0.27 ms row, and a
    1-token one at 0.24 ms against 0.50."""
    tiny = rows[rows[["flops_ms", "bytes_ms"]].max(axis=1) <= FLOOR_WORK_MS]
    if len(tiny) == 0:
        return {"m": [1.0], "latency_us": [OVERHEAD_MS * 1e3]}
    curve = _exact_curve(tiny.assign(us=tiny.latency * 1e3), "m", "us", ("m", "latency_us"))
    return curve | {"latency_us": [max(OVERHEAD_MS * 1e3, us) for us in curve["latency_us"]]}


def moe_curves(
    root: Path, framework: str, peak: dict[str, float], bw: float, row_filter: RowFilter
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Grouped expert GEMMs by token-expert pairs per local expert; balanced routing sets the curve,
    the power-law/balanced latency ratio at the same shape sets the imbalance factor. Gated experts
    only (kadapt's experts are gate/up/down) and fine-grained MoE of large models (hidden >= 4096,
    >= 64 experts: DeepSeek-V3, Kimi-K2.5, Qwen3-235B). The per-shape curves also price an EP size
    not measured from the model shape's EP sizes around it, and a model shape measured at no EP size
    from the model widths around it at its EP size (``kernels.measured_across``)."""
    curves: dict[str, Any] = {}
    factors: dict[str, Any] = {}
    for key, (dtype, wbytes, unit_key) in MOE_DTYPES.items():

        def select(t: Any, dtype: str = dtype) -> Any:
            keep = (t.moe_dtype == dtype) & (t.moe_tp_size == 1) & ~t.kernel_source.str.contains("nongated")
            return t[keep & (t.hidden_size >= 4096) & (t.num_experts >= 64)]

        try:
            found = measured(root, ("moe", "moe_perf.parquet"), framework, select, row_filter)
        except KadaptError:
            if row_filter is _all_rows:
                raise
            continue  # a part fit without any row of this dtype: its ops price as a dtype not measured
        table = found.rows
        local = table.num_experts / table.moe_ep_size
        pairs = table.num_tokens * table.topk / table.moe_ep_size
        table = table.assign(pairs_per_expert=pairs / local, pairs=pairs, local=local)
        unit = peak[unit_key]

        def ideal(f: Any, unit: float = unit, wbytes: float = wbytes) -> Any:
            per_expert = 3.0 * f.hidden_size * f.inter_size
            touched = f.local * (1 - (1 - 1 / f.local) ** f.pairs)
            nbytes = touched * per_expert * wbytes + f.pairs * (2 * f.hidden_size + 3 * f.inter_size) * 2
            return (2.0 * f.pairs * per_expert / unit).combine(nbytes / bw, max) * 1e3

        # each row's bound once, for every fit below to read (pricing the rows again for each of
        # hundreds of shapes took a fifth of a table's time)
        table = table.assign(ideal=ideal(table))
        balanced = table[table.distribution == "balanced"]
        floor_ms = _pipeline_floor(balanced)
        curves[key] = {
            **_expert_curve(balanced, floor_ms, MOE_GRID),
            "source": f"{found.source}, balanced; {BY_SHAPE}",
            "shapes": _shape_curves(
                balanced,
                EXPERT_SHAPE,
                lambda rows, floor=floor_ms: _expert_curve(rows, _pipeline_floor(rows, floor)),
                EXPERT_LAYOUT,
            ),
        }
        shape = ["num_tokens", "hidden_size", "inter_size", "topk", "num_experts", "moe_ep_size"]
        skewed = table[table.distribution == "power_law_1.01"][[*shape, "latency"]]
        joined = balanced.merge(skewed, on=shape, suffixes=("", "_skewed"))
        if len(joined):  # a table without power-law rows leaves routing unskewed
            joined = joined.assign(ratio=joined.latency_skewed / joined.latency)
            factors[key] = {
                "pairs_per_expert": MOE_GRID,
                "factor": _median_curve(joined, "pairs_per_expert", MOE_GRID, "ratio"),
                "source": f"{found.source}, power_law_1.01 / balanced; {BY_SHAPE}",
                "shapes": _shape_curves(
                    joined,
                    EXPERT_SHAPE,
                    lambda rows, floor=floor_ms: _factor_curve(rows, _pipeline_floor(rows, floor)),
                    EXPERT_LAYOUT,
                ),
            }
    return curves, factors


def _factor_curve(joined: Any, floor_ms: float) -> dict[str, Any]:
    """The power-law / balanced ratio of one shape at each of its measured points, net of the
    shape's pipeline floor ``floor_ms`` on both sides: pricing multiplies only the time above the
    floor by it, so ``floor + (balanced - floor) x factor`` is the measured power-law latency (the
    plain latency ratio left a prefill-sized Qwen3 expert GEMM 5% under its measured row).

    Where a power-law row is faster than the floor itself - at one to a few tokens the measured rank
    may be routed none or few of the tokens' experts, and skips most of the pipeline (B200 SGLang,
    DeepSeek-V3's experts at EP4, one token: 0.040 ms power-law, 0.073 balanced, floor 0.061) - no
    factor on the time above the floor reaches it; there the curve also carries ``floor_factor``, the
    row over the floor, which scales the floor (1 at every point above it)."""
    import numpy as np

    pairs = joined.pairs_per_expert.to_numpy(float)
    skewed, balanced = joined.latency_skewed.to_numpy(), joined.latency.to_numpy()
    net = np.maximum((skewed - floor_ms) / np.maximum(balanced - floor_ms, OVERHEAD_MS), 0.001)
    curve = _point_curve(pairs, net, ("pairs_per_expert", "factor"))
    if floor_ms <= 0 or not (skewed < floor_ms).any():
        return curve
    scale = _point_curve(pairs, np.minimum(skewed / floor_ms, 1.0), ("pairs_per_expert", "floor_factor"))
    return curve | {"floor_factor": scale["floor_factor"]}


def _pipeline_floor(balanced: Any, default: float = 0.0) -> float:
    """The fixed cost of the routed-expert pipeline (permute, two GEMMs, activation, unpermute):
    single-token latency minus its ideal time (the rows' ``ideal``), median over the rows' shapes
    (``default`` where no single-token row was measured)."""
    import numpy as np

    single = balanced.num_tokens.to_numpy() == 1
    if not single.any():
        return default
    net = balanced.latency.to_numpy()[single] - balanced.ideal.to_numpy()[single]
    return max(0.0, float(np.median(net)))


def _expert_curve(balanced: Any, floor_ms: float, grid: list[float] | None = None) -> dict[str, Any]:
    """The efficiency curve of balanced rows (with their ``ideal``) net of the pipeline's fixed cost
    ``floor_ms``: the median at each point of ``grid``, or at each measured point (``None``: the rows
    of one shape; empty when every row is launch-bound)."""
    keep, eff = _efficiency(balanced.latency.to_numpy() - floor_ms + OVERHEAD_MS, balanced.ideal.to_numpy())
    pairs = balanced.pairs_per_expert.to_numpy(float)[keep]
    curve = (
        {"pairs_per_expert": grid, "efficiency": _binned_curve(pairs, eff, grid, "pairs_per_expert")}
        if grid
        else _point_curve(pairs, eff, ("pairs_per_expert", "efficiency"))
    )
    return {**curve, "overhead_us": round(floor_ms * 1e3, 1)} if curve else {}


def attention_curves(
    root: Path, framework: str, peak: dict[str, float], bw: float, row_filter: RowFilter
) -> dict[str, Any]:
    """Prefill attention by new tokens per sequence, decode attention by KV bytes one call reads, for
    GQA (head_dim 128, no window) and DeepSeek-style MLA. The per-shape curves also price a head
    count not measured from the head counts around it (``kernels.measured_across``)."""
    bf16 = peak["bf16"]

    def gqa_ctx(t: Any) -> Any:
        keep = (t.attn_dtype == "bfloat16") & (t.kv_cache_dtype == "bfloat16") & (t.head_dim == 128)
        return t[keep & (t.window_size == 0)]

    def gqa_prefill(f: Any) -> Any:
        return _gqa_prefill_ms(f, bf16, bw)

    def gqa_gen(t: Any) -> Any:
        t = t[(t.attn_dtype == "bfloat16") & (t.head_dim == 128) & (t.window_size == 0)]
        t = t.assign(kvb=t.kv_cache_dtype.map({"bfloat16": 2, "fp8": 1}), ctx=t.isl + t.step)
        return t.assign(read=t.batch_size * t.ctx * t.num_key_value_heads * 256 * t.kvb)

    def gqa_decode(f: Any) -> Any:  # the cache read, queries and outputs, the new token's K/V written
        pairs = f.batch_size * f.num_heads * f.ctx
        nbytes = f.read + f.batch_size * (2 * f.num_heads + f.num_key_value_heads * f.kvb) * 256
        return (4.0 * pairs * 128 / bf16).combine(nbytes / bw, max) * 1e3

    def mla_ctx(t: Any) -> Any:
        return t[(t.mla_dtype == "bfloat16") & (t.kv_cache_dtype == "bfloat16")]

    def mla_gen(t: Any) -> Any:
        t = t[t.mla_dtype == "bfloat16"]
        return _kv_read(t.assign(ctx=t.isl + t.step))

    def mla_prefill(f: Any) -> Any:
        return _mla_prefill_ms(f, peak, bw)

    def mla_decode(f: Any) -> Any:
        return _mla_decode_ms(f, peak, bw)

    def curve(
        pattern: tuple[str, str],
        select: Callable[[Any], Any],
        ideal: Callable[[Any], Any],
        key: str,
        axis: str,
        columns: dict[str, str],
    ) -> dict[str, Any]:
        found = measured(root, pattern, framework, select, row_filter)
        rows = _eff(found.rows, ideal)

        def fit(own: Any) -> dict[str, Any]:
            return _exact_curve(own, key, names=(axis, "efficiency"))

        if axis == "seq":
            return {
                axis: SEQ_GRID,
                "efficiency": _median_curve(rows, key, SEQ_GRID),
                "source": f"{found.source}; {BY_SHAPE}; {BY_BATCH}",
                "shapes": _prefill_shapes(rows, columns, fit),
            }
        fallback = _by_cache_dtype(rows, key, axis)
        shaped = _shape_curves(rows, columns, fit, ATTENTION_LAYOUT) + fallback
        return {
            axis: BYTES_GRID,
            "efficiency": _median_curve(rows, key, BYTES_GRID),
            "source": f"{found.source}; {BY_SHAPE}{BY_CACHE if fallback else ''}",
            **({"shapes": shaped} if shaped else {}),
        }

    context, generation = (
        ("attention", "context_attention_perf.parquet"),
        ("attention", "generation_attention_perf.parquet"),
    )
    return {
        "prefill": {
            "gqa": curve(context, gqa_ctx, gqa_prefill, "isl", "seq", GQA_SHAPE),
            "mla": curve(("mla", "context_mla_perf.parquet"), mla_ctx, mla_prefill, "isl", "seq", MLA_SHAPE),
        },
        "decode": {
            "gqa": curve(generation, gqa_gen, gqa_decode, "read", "kv_bytes", GQA_SHAPE | DECODE_SHAPE),
            "mla": curve(
                ("mla", "generation_mla_perf.parquet"),
                mla_gen,
                mla_decode,
                "read",
                "kv_bytes",
                MLA_SHAPE | DECODE_SHAPE,
            ),
        },
    }


def _gqa_prefill_ms(f: Any, bf16: float, bw: float) -> Any:
    """kadapt's bound of GQA prefill attention (no cached prefix, bf16 cache) for each row, in ms, as
    ``rank_model.AttentionKernel`` records the op: causal pairs at head dim 128; queries and outputs
    per query head, the new tokens' K/V written and read once per KV head. (This bound once counted
    4 x 256 bytes per token for every query and KV head, 1.8x the op's at 8 / 1 heads per rank, and
    a one-sequence prefill, bandwidth-bound at 1k tokens on B200, priced 20% under its own row.)"""
    pairs = f.batch_size * f.num_heads * f.isl * (f.isl + 1) / 2
    nbytes = 2 * f.batch_size * f.isl * (f.num_heads + 2 * f.num_key_value_heads) * 256
    return (4.0 * pairs * 128 / bf16).combine(nbytes / bw, max) * 1e3


def _kv_read(rows: Any) -> Any:
    """MLA decode rows with the latent cache bytes one call reads (``ctx`` keys of 576 per sequence)."""
    rows = rows.assign(kvb=rows.kv_cache_dtype.map({"bfloat16": 2, "fp8": 1}))
    return rows.assign(read=rows.batch_size * rows.ctx * 576 * rows.kvb)


def _mla_prefill_ms(f: Any, peak: dict[str, float], bw: float) -> Any:
    """kadapt's bound of MLA prefill attention (expanded heads, causal pairs) for each row, in ms."""
    pairs = f.batch_size * f.num_heads * f.isl * (f.isl + 1) / 2
    nbytes = 2 * f.batch_size * f.isl * f.num_heads * (192 + 192 + 128 + 128)
    return (2.0 * pairs * (192 + 128) / peak["bf16"]).combine(nbytes / bw, max) * 1e3


def _mla_decode_ms(f: Any, peak: dict[str, float], bw: float) -> Any:
    """kadapt's bound of absorbed MLA decode attention (576-wide latent cache) for each row, in ms."""
    pairs = f.batch_size * f.num_heads * f.ctx
    nbytes = f.read + f.batch_size * f.num_heads * (576 + 512) * 2
    return (2.0 * pairs * (576 + 512) / peak["bf16"]).combine(nbytes / bw, max) * 1e3


def module_rows(root: Path, framework: str, file: str, row_filter: RowFilter) -> Measured | None:
    """The rows of ``framework``'s own MLA module table (its newest version that has any): DeepSeek-V3's
    module, bf16 attention compute, projections in a dtype kadapt prices (``MODULE_GEMMS``); None
    where the framework measured no module. Never borrowed: a module prices only its own framework."""
    paths = sorted(root.glob(f"mla/{framework}/*/{file}"), key=lambda p: _version(p.parent.name))
    for path in reversed(paths):
        t = _read_table(path)
        keep = (t.model == MLA_MODULE_MODEL) & (t.mla_dtype == "bfloat16") & (t.tp_size == 1)
        rows = row_filter("mla", t[keep & t.gemm_type.isin(list(MODULE_GEMMS))])
        if len(rows):
            kernels = ", ".join(sorted(rows.kernel_source.unique()))
            return Measured(rows.copy(), f"{path.relative_to(root.parent)} ({kernels})")
    return None


def mla_module_curves(
    root: Path,
    framework: str,
    peak: dict[str, float],
    bw: float,
    row_filter: RowFilter,
    gemm: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None:
    """(prefill attention, decode attention, module floors: ``mla`` decode, ``mla_prefill`` prefill) of
    a framework that measured its MLA only as a module (vLLM: no standalone MLA kernel, so its tables
    used to borrow TensorRT-LLM's); None where it measured a standalone kernel or no module. See
    ``module_decode`` and ``module_prefill`` for how the attention is taken out of the module."""
    if any(root.glob(f"mla/{framework}/*/generation_mla_perf.parquet")):
        return None
    generation = module_rows(root, framework, "mla_generation_module_perf.parquet", row_filter)
    context = module_rows(root, framework, "mla_context_module_perf.parquet", row_filter)
    if generation is None or context is None:
        return None
    decode, floor = module_decode(generation, peak, bw)
    prefill, prefill_floor = module_prefill(context, peak, bw, gemm)
    return prefill, decode, {"mla": floor, "mla_prefill": prefill_floor}


def module_decode(
    found: Measured, peak: dict[str, float], bw: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Decode MLA from the module rows: (attention curve, module floor).

    At one batch the module's time is flat over short contexts (vLLM 0.24, H200, 16 heads, FP8 cache
    and projections: 0.14 ms from 2 to 256 keys at b128) and then grows with the cache read (0.24 ms
    at 4k): the flat part is the module's projections, norms, rope and launches, the rest the
    attention. So the floor of each (shape, batch) is the median of its rows whose cache read takes
    under ``FLOOR_READ_MS`` at full bandwidth (one row alone is +-5 us of noise), and the attention
    curve is fitted on the rows less their floor. The floor is not the module's GEMMs as
    the standalone GEMM table prices them: vLLM's fp8-block GEMM rows take ~85 us each at M = 128
    whatever N (five of them exceed the whole module), its bf16 ones ~40 us for all five (a third of
    the floor); so an op of a measured module shape prices as the module (``cost.fold_modules``)."""
    keys = ["num_heads", "kv_cache_dtype", "gemm_type", "batch_size"]
    rows = _kv_read(found.rows.assign(ctx=found.rows.step))  # step: keys attended, its own included
    short = rows[rows.read / bw * 1e3 < FLOOR_READ_MS]
    floor = short.groupby(keys, as_index=False).latency.median()
    rows = rows.merge(floor, on=keys, suffixes=("", "_floor"))
    net = _eff(rows.assign(latency=rows.latency - rows.latency_floor), lambda f: _mla_decode_ms(f, peak, bw))
    exact = _shape_curves(
        net,
        MODULE_ATTENTION_SHAPE,
        lambda own: _exact_curve(own, "read", names=("kv_bytes", "efficiency")),
        ATTENTION_LAYOUT,
    )
    fallback = _by_cache_dtype(net, "read", "kv_bytes")
    attention = {
        "kv_bytes": BYTES_GRID,
        "efficiency": _median_curve(net, "read", BYTES_GRID),
        "source": (
            f"{found.source}, less the module at its shortest context (module_floor); {BY_SHAPE}"
            f"{BY_CACHE if fallback else ''}"
        ),
        **({"shapes": exact + fallback} if exact or fallback else {}),
    }
    floor = floor.assign(latency_us=floor.latency * 1e3)
    return attention, {
        "source": (
            f"{found.source}: the module's time where its cache read is under {FLOOR_READ_MS * 1e3:g} us "
            "(median over those contexts), by batch: its projections, norms, rope and launches, per "
            "shape (match), in us; a head count not measured takes it from those around it "
            "(cost.module_floor)"
        ),
        "shapes": _shape_curves(
            floor,
            MODULE_SHAPE,
            lambda own: _exact_curve(own, "batch_size", "latency_us", ("tokens", "latency_us")),
            ATTENTION_LAYOUT | {"hidden": MLA_MODULE["hidden"]},
        ),
    }


def module_prefill(
    found: Measured,
    peak: dict[str, float],
    bw: float,
    gemm: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Prefill MLA from the module rows (no cached prefix): (attention curve, module floor by tokens).

    The attention is fitted on the rows with bf16 projections (every row where none has them) less
    the module's GEMMs as this table's GEMM curves price them inside a module (q_a + kv_a, q_b, kv_b,
    o_proj at M = the new tokens, at their efficiencies plus one op overhead: without the standalone
    call's fixed cost, ``gemm_floor``, which a GEMM inside the module does not pay - vLLM 0.24's whole
    module takes 0.18 ms at one 1,024-token sequence on GB200, DeepSeek-V3 at 16 heads, where one
    standalone fp8-block GEMM row takes 0.27-0.32 ms); the norms and rope are left in. The attention
    kernel is the same whatever the projections (bf16 compute), and bf16 GEMMs carry a 3-5 us floor,
    so those rows' nets are the attention's. The floor of each shape (projections too) is then the
    module's time less that attention, by new tokens (median over the batches at the same tokens),
    which ``cost.fold_modules`` adds to the attention kernel, the module's other kernels priced 0, as
    in decode: at 16 heads on B200 the fp8-block module is the bf16 one's time (0.278 / 0.279 ms at
    one 4,096-token sequence), where the fp8-block GEMMs at their fitted efficiencies net of the
    standalone floor (1.0: the rows are the floor) priced it at 0.18.

    Fitted per batch as well (``_prefill_shapes``): with one projection dtype a shape's batch has one
    row per length, and one sequence runs below the median over batches (Kimi-K2.5's TP8 module at
    one 4,096-token sequence: 0.475 ms over every batch against its 0.515 ms row)."""
    rows = found.rows[found.rows.step == 0]
    rows = rows.assign(tokens=rows.batch_size * rows.isl)
    own = rows[rows.gemm_type == "bfloat16"] if (rows.gemm_type == "bfloat16").any() else rows
    own = own.assign(latency=own.latency - _module_gemms_ms(own, peak, bw, gemm))
    net = _eff(own, lambda f: _mla_prefill_ms(f, peak, bw))
    keys = ["num_heads", "kv_cache_dtype", "batch_size", "isl"]
    ideal = _mla_prefill_ms(own, peak, bw) + OVERHEAD_MS  # the attention as priced: never above 1
    attention_ms = own.assign(attention=own.latency.combine(ideal, max))[[*keys, "attention"]]
    rest = rows.merge(attention_ms.groupby(keys, as_index=False).attention.median(), on=keys)
    rest = rest.assign(latency_us=(rest.latency - rest.attention) * 1e3)
    rest = rest.groupby(
        ["num_heads", "kv_cache_dtype", "gemm_type", "tokens"], as_index=False
    ).latency_us.median()
    attention = {
        "seq": SEQ_GRID,
        "efficiency": _median_curve(net, "isl", SEQ_GRID),
        "source": (
            f"{found.source}, less the module's q_a + kv_a, q_b, kv_b and o_proj GEMMs priced by this "
            f"table's gemm curves inside a module, on the rows with bf16 projections; {BY_SHAPE}; "
            f"{BY_BATCH}"
        ),
        "shapes": _prefill_shapes(
            net, MODULE_ATTENTION_SHAPE, lambda own: _exact_curve(own, "isl", names=("seq", "efficiency"))
        ),
    }
    return attention, {
        "source": (
            f"{found.source}: the module's time at one call of new tokens (no cached prefix) less its "
            "attention as the prefill curve prices it (the bf16-projection rows less their GEMMs), by "
            "new tokens (median over batches): its projections, norms, rope and launches, per shape "
            "(match), in us; a head count not measured takes it from those around it (cost.module_floor)"
        ),
        "shapes": _shape_curves(
            rest,
            MODULE_SHAPE,
            lambda own: _exact_curve(own, "tokens", "latency_us", ("tokens", "latency_us")),
            ATTENTION_LAYOUT | {"hidden": MLA_MODULE["hidden"]},
        ),
    }


def _module_gemm_shapes(heads: Any) -> list[tuple[Any, Any]]:
    """(N, K) of the MLA module's projections at ``heads`` per rank (DeepSeek-V3's MLA sizes): the
    fused q_a + kv_a downscale, q_b, kv_b (the prefill's latent expansion), o_proj."""
    d = MLA_MODULE
    return [
        (d["q_lora"] + d["kv_lora"] + d["rope"], d["hidden"]),
        (heads * (d["nope"] + d["rope"]), d["q_lora"]),
        (heads * (d["nope"] + d["v"]), d["kv_lora"]),
        (d["hidden"], heads * d["v"]),
    ]


def _module_gemms_ms(
    rows: Any, peak: dict[str, float], bw: float, gemm: tuple[dict[str, Any], ...]
) -> list[float]:
    """Each module row's projections (``_module_gemm_shapes`` at its heads, M = its new ``tokens``) in
    ms, summed, as ``_gemm_ms`` prices each: row by row (a ``Curve`` takes one point), on plain
    numbers with each dtype's curves built once (a pandas row apply took ~0.3 s per vLLM table)."""
    curves = {projections: _gemm_curves(gemm, projections) for projections in rows.gemm_type.unique()}
    return [
        sum(
            _gemm_ms(m, n, k, projections, curves[projections], peak, bw)
            for n, k in _module_gemm_shapes(heads)
        )
        for m, heads, projections in zip(
            rows.tokens.tolist(), rows.num_heads.tolist(), rows.gemm_type.tolist(), strict=True
        )
    ]


def _gemm_curves(gemm: tuple[dict[str, Any], ...], projections: str) -> tuple[Curve, Curve]:
    """The compute (by M) and memory (by bytes) efficiency curves of the table's dense GEMM kernel
    for the module's projection dtype (``gemm``: ``gemm_curves``'s compute and memory curves)."""
    kernel = MODULE_GEMMS[projections][0]
    compute, memory = gemm[0][kernel], gemm[1][kernel]
    return (
        Curve(tuple(compute["m"]), tuple(compute["efficiency"])),
        Curve(tuple(memory["bytes"]), tuple(memory["efficiency"])),
    )


def _gemm_ms(
    m: int, n: int, k: int, projections: str, curves: tuple[Curve, Curve], peak: dict[str, float], bw: float
) -> float:
    """One dense GEMM of the module's ``projections`` dtype in ms as ``cost.price`` prices it with the
    table's ``curves`` (``_gemm_curves``): ``max(flops / peak / eff(M), bytes / bw / eff(bytes)) +
    op overhead``."""
    _, wbytes, unit = MODULE_GEMMS[projections]
    compute, memory = curves
    nbytes = 2.0 * m * k + wbytes * n * k + 2.0 * m * n
    flops_ms = 2.0 * m * n * k / peak[unit] * 1e3
    return max(flops_ms / compute(m), nbytes / bw * 1e3 / memory(nbytes)) + OVERHEAD_MS


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


def calibrate(system: str, framework: str, row_filter: RowFilter = _all_rows) -> dict[str, Any]:
    """The kernel table of ``framework`` on AIConfigurator's ``system``, fitted on the rows
    ``row_filter`` keeps (all of them for a shipped table). Every fit keeps its curves per measured
    shape: besides pricing the shape they were measured at, they price the shapes around them - an
    EP size not measured from the expert curves at the EP sizes around it, a head count not measured
    from the attention curves and module floors at the head counts around it
    (``kernels.measured_across``) - so a held-out fit (the benchmark's) needs them too."""
    from importlib.metadata import version

    device = get_device(SYSTEMS[system])
    peak = dict(device.peak_flops)
    bw = device.hbm_bandwidth
    root = _tables(system)
    try:
        grouped, imbalance = moe_curves(root, framework, peak, bw, row_filter)
        gemm = gemm_curves(root, framework, peak, bw, row_filter)
        attention = attention_curves(root, framework, peak, bw, row_filter)
        module = mla_module_curves(root, framework, peak, bw, row_filter, gemm)
        all_reduce = all_reduce_curve(root, framework, lambda n: device.link_for(n).bandwidth)
    finally:
        _read_table.cache_clear()  # the next table reads other files: hold none of these
    if module is not None:  # the framework's own MLA, measured as a module, replaces a borrowed kernel
        attention["prefill"]["mla"], attention["decode"]["mla"], floor = module
    table = {
        "name": f"{system}_{framework}",
        "device": device.name,
        "source": (
            f"derived by kimi_adapter_core/backends/simulation/calibrate.py from NVIDIA AIConfigurator "
            f"(aiconfigurator-core {version('aiconfigurator-core')}, Apache-2.0) measured tables "
            f"systems/data/{system}: each curve from the newest {framework} version that measured the "
            f"kernel (another framework's where {framework} measured none), named in the curve's source; "
            f"each value is the median, over the table's shapes at that grid point, of kadapt's roofline "
            f"bound on the {device.name} profile / (measured latency - 2 us)"
        ),
        "gemm": gemm[0],
        "gemm_memory": gemm[1],
        "gemm_floor": gemm[2],
        "grouped_gemm": grouped,
        "routing": {"power_law": imbalance},
        "attention": attention,
        "all_reduce": all_reduce,
    }
    return table | ({"module_floor": floor} if module is not None else {})


def shipped() -> list[tuple[str, str]]:
    """Every (system, framework) whose table ships in ``kernels/``."""
    return [(system, framework) for system in SYSTEMS for framework in FRAMEWORKS]


# libyaml's emitter writes the tables' text byte for byte as the pure-Python one does (checked on every
# shipped table) at ~2.5x its speed; the representer, which sets every scalar's text, is PyYAML's either way
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def render(table: dict[str, Any]) -> str:
    """The YAML text of a generated table, as shipped."""
    header = (
        "# Generated by `python -m kimi_adapter_core.backends.simulation.calibrate`; do not edit by hand.\n"
    )
    dumper = type("NoAliases", (_DUMPER,), {"ignore_aliases": lambda *_: True})
    return header + yaml.dump(table, Dumper=dumper, sort_keys=False, width=120, default_flow_style=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=sorted(SYSTEMS), help="one AIConfigurator system (default: all)")
    parser.add_argument("--framework", choices=FRAMEWORKS, help="one serving framework (default: all)")
    parser.add_argument("--out", type=Path, help="where to write a single table (default: kernels/NAME.yaml)")
    options = parser.parse_args()
    todo = [
        (system, framework)
        for system, framework in shipped()
        if options.system in (None, system) and options.framework in (None, framework)
    ]
    if options.out and len(todo) != 1:
        parser.error("--out needs one --system and one --framework")
    for system, framework in todo:
        out = options.out or KERNELS_DIR / f"{system}_{framework}.yaml"
        atomic_write_text(out, render(calibrate(system, framework)))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
