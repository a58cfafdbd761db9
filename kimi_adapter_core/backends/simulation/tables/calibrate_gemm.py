"""Dense GEMM curves from AIConfigurator's GEMM tables: per dtype, a call's fixed cost and its
efficiency net of it.

Three curves per dtype (bf16, fp8, fp8_block): ``gemm_floor``, the fixed cost of one standalone call
by M (``_gemm_floor``: vLLM's DeepGEMM rows take 85-300 us whatever the shape, which no efficiency of
the bound prices), and, net of that floor, ``gemm`` (compute efficiency by M over compute-bound rows)
and ``gemm_memory`` (memory efficiency by bytes moved over memory-bound rows). Separate from the other
op kinds' fits because only GEMMs are priced as floor plus net work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .calibrate_fit import BYTES_GRID, M_GRID, OVERHEAD_MS, _exact_curve, _median_curve
from .calibrate_rows import RowFilter, measured
from .curves import Curve

FLOOR_WORK_MS = 0.002  # a GEMM row whose ideal time is this short measures the call's fixed cost


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
