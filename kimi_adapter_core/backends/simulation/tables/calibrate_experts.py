"""Routed-expert curves from AIConfigurator's MoE tables: grouped GEMM efficiency and power-law routing.

Per expert dtype (``MOE_DTYPES``): the grouped GEMMs' efficiency by token-expert pairs per local
expert on balanced routing, net of the routed-expert pipeline's fixed cost (``_pipeline_floor``), and
the power-law / balanced slowdown on the time above that floor (``_factor_curve``), each with its
curves per model shape and EP size (``EXPERT_SHAPE``), and per expert-TP size where the same kernel
was measured with each expert's width sharded (``_expert_tp_curves``: matched by ``moe_tp`` and the
width a rank holds; the median curves stay those of whole experts). Separate from the other op
kinds' fits because the experts are priced by their own axis, floor and routing factor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ....errors import KadaptError
from .calibrate_fit import (
    BY_SHAPE,
    MOE_GRID,
    OVERHEAD_MS,
    _binned_curve,
    _efficiency,
    _median_curve,
    _point_curve,
    _shape_curves,
)
from .calibrate_rows import SLOWER_MS, SLOWER_RATIO, RowFilter, _all_rows, broken_ep_sizes, measured

# kadapt grouped-GEMM kernel -> (AIConfigurator moe_dtype, weight bytes per parameter, peak key)
MOE_DTYPES = {
    "fp8_block": ("fp8_block", 1.0 + 4 / 16384, "fp8"),
    "fp8": ("fp8", 1.0, "fp8"),
    "bf16": ("bfloat16", 2.0, "bf16"),
    "w4a16": ("int4_wo", 0.5 + 2 / 32, "bf16"),  # int4, one bf16 scale per 32 (Kimi-K2.5)
    "w4a16_mxfp4": ("w4a16_mxfp4", 0.5 + 1 / 32, "bf16"),  # e2m1, one e8m0 scale per 32 (gpt-oss)
    # e2m1, one ue8m0 scale per 32, MXFP8 activations (DeepSeek-V4): measured on Blackwell only, on
    # DeepSeek-V4-Flash's and -Pro's shapes (4096 x 2048 x 256 top-6, 7168 x 3072 x 384 top-6), which
    # the fine-grained filter keeps: SGLang's rows of that mode on those shapes are its FlashInfer
    # TensorRT-LLM MXFP4 kernel (``sglang_mxfp4_flashinfer_trtllm_moe``, the kernel AIConfigurator
    # prices DeepSeek-V4 with on Blackwell SGLang), its other kernel's rows being gpt-oss and Kimi-K3
    "w4a8_mxfp4": ("w4a8_mxfp4_mxfp8", 0.5 + 1 / 32, "fp8"),
}
# expert dtypes fitted on every model shape measured: AIConfigurator measured MXFP4 only on models
# that ship it (gpt-oss-20b and -120b, hidden 2880; B200 SGLang also a 3584-wide one), all of which
# the fine-grained filter (``_model_shapes``) drops. Priced as ``w4a16`` before, on Kimi-K2.5's int4
# curve (B200 SGLang: a 38 us pipeline floor), gpt-oss's experts cost twice AIConfigurator's MXFP4
# rows (1.32 ms per decode step at TP8 against 0.65: 18-19 us per layer for one token)
EVERY_SHAPE = ("w4a16_mxfp4",)
# expert dtypes AIConfigurator measured on Blackwell only (FP4 x FP8 needs its FP4 tensor cores): a
# Hopper table has none, and its ops price from the fallback (``kernels._FALLBACK``)
BLACKWELL_ONLY = ("w4a8_mxfp4",)
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
# SGLang's wide-EP path (DeepEP dispatch, DeepGEMM grouped GEMMs), measured on its own per phase
# (``num_tokens``: the EP group's tokens, as in the TP path's rows; AIConfigurator asks for one
# attention-DP rank's tokens x its DP size). Its curves match the ``graph`` the pricer gives a layout
# whose EP group is wider than the device's NVLink domain (``cost.table_shape``)
WIDE_EP_PHASES = {"context": "wide_ep_context", "generation": "wide_ep_generation"}
# expert-TP rows fitted: MoE groups (MoE-TP x EP) of up to two 8-GPU nodes, where expert TP is served
# (wider groups run DeepEP's whole experts); AIConfigurator's tables reach MoE-TP32 x EP8, and every
# row would triple a table's size. An expert-TP op outside prices from the whole-expert curves at the
# width a rank holds
EXPERT_TP_GROUP_MAX = 16


def moe_curves(
    root: Path, framework: str, peak: dict[str, float], bw: float, row_filter: RowFilter
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Grouped expert GEMMs by token-expert pairs per local expert; balanced routing sets the curve,
    the power-law/balanced latency ratio at the same shape sets the imbalance factor. Gated experts
    only (kadapt's experts are gate/up/down) and fine-grained MoE of large models (hidden >= 4096,
    >= 64 experts: DeepSeek-V3, Kimi-K2.5, Qwen3-235B), but MXFP4 at every shape measured (gpt-oss:
    ``_model_shapes``). The per-shape curves also price an EP size
    not measured from the model shape's EP sizes around it, and a model shape measured at no EP size
    from the model widths around it at its EP size (``curves.measured_across``)."""
    curves: dict[str, Any] = {}
    factors: dict[str, Any] = {}
    for key, (dtype, wbytes, unit_key) in MOE_DTYPES.items():

        def select(t: Any, dtype: str = dtype) -> Any:
            keep = (t.moe_dtype == dtype) & (t.moe_tp_size == 1) & ~t.kernel_source.str.contains("nongated")
            return _model_shapes(t[keep], dtype)

        try:
            found = measured(root, ("moe", "moe_perf.parquet"), framework, select, row_filter)
        except KadaptError:
            if row_filter is _all_rows and key not in BLACKWELL_ONLY:
                raise
            continue  # no row of this dtype here: its ops price as the dtype it falls back to
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
        balanced, left_out = _without_broken_ep(table[table.distribution == "balanced"], EXPERT_SHAPE)
        floor_ms = _pipeline_floor(balanced)
        sharded = _expert_tp_curves(root, framework, dtype, ideal, floor_ms, found.source, row_filter)
        note = _left_out_note([*left_out, *sharded[2]])
        curves[key] = {
            **_expert_curve(balanced, floor_ms, MOE_GRID),
            "source": f"{found.source}, balanced; {BY_SHAPE}{note}",
            "shapes": _shape_curves(
                balanced,
                EXPERT_SHAPE,
                lambda rows, floor=floor_ms: _expert_curve(rows, _pipeline_floor(rows, floor)),
                EXPERT_LAYOUT,
            ),
        }
        joined = _routing_pairs(table, balanced)
        if len(joined):  # a table without power-law rows leaves routing unskewed
            factors[key] = {
                "pairs_per_expert": MOE_GRID,
                "factor": _median_curve(joined, "pairs_per_expert", MOE_GRID, "ratio"),
                "source": f"{found.source}, power_law_1.01 / balanced; {BY_SHAPE}{note}",
                "shapes": _shape_curves(
                    joined,
                    EXPERT_SHAPE,
                    lambda rows, floor=floor_ms: _factor_curve(rows, _pipeline_floor(rows, floor)),
                    EXPERT_LAYOUT,
                ),
            }
        curves[key]["shapes"][:0] = sharded[0]  # first: a whole-expert shape never matches them
        if key in factors:
            factors[key]["shapes"][:0] = sharded[1]
        for phase, graph in WIDE_EP_PHASES.items():
            wide = _wide_ep_curves(root, framework, dtype, ideal, floor_ms, graph, phase, row_filter)
            curves[key]["shapes"] += wide[0]
            if key in factors:
                factors[key]["shapes"] += wide[1]
    return curves, factors


def _expert_tp_curves(
    root: Path,
    framework: str,
    dtype: str,
    ideal: Any,
    floor_ms: float,
    source: str,
    row_filter: RowFilter,
) -> tuple[list[Any], list[Any], list[str]]:
    """Efficiency and power-law curves per shape of the rows measured with expert TP (``moe_tp_size``
    > 1: each rank holds ``inter_size / moe_tp_size`` of every local expert and runs all of its EP
    shard's pairs), from the file and kernel of the whole-expert curves (``source``; none otherwise:
    another kernel's rows are not this one's). Matched by ``moe_tp`` and the rank's width, which a
    whole-expert op (no ``moe_tp``) never matches: TensorRT-LLM's DeepSeek-V3 experts at MoE-TP8 ran
    a 4k prefill in 2.4x the time of EP8 (H200), which the width-matched whole-expert curves put at
    1.5x. Also the shapes' EP sizes left out (``_without_broken_ep``), for the whole-expert curve's
    source."""

    def select(t: Any) -> Any:
        keep = (t.moe_dtype == dtype) & (t.moe_tp_size > 1) & ~t.kernel_source.str.contains("nongated")
        keep &= t.moe_tp_size * t.moe_ep_size <= EXPERT_TP_GROUP_MAX
        return _model_shapes(t[keep], dtype)

    try:
        found = measured(root, ("moe", "moe_perf.parquet"), framework, select, row_filter)
    except KadaptError:
        return [], [], []
    if found.source != source:
        return [], [], []
    table = found.rows
    table = table.assign(inter_size=table.inter_size // table.moe_tp_size)  # the width a rank holds
    local = table.num_experts / table.moe_ep_size
    pairs = table.num_tokens * table.topk / table.moe_ep_size
    table = table.assign(pairs_per_expert=pairs / local, pairs=pairs, local=local)
    table = table.assign(ideal=ideal(table))
    columns = EXPERT_SHAPE | {"moe_tp": "moe_tp_size"}
    balanced, left_out = _without_broken_ep(table[table.distribution == "balanced"], columns)
    curves = _shape_curves(
        balanced,
        columns,
        lambda rows: _expert_curve(rows, _pipeline_floor(rows, floor_ms)),
        EXPERT_LAYOUT,
    )
    joined = _routing_pairs(table, balanced)
    factors = _shape_curves(
        joined,
        columns,
        lambda rows: _factor_curve(rows, _pipeline_floor(rows, floor_ms)),
        EXPERT_LAYOUT,
    )
    return (
        [c | {"source": f"{source}, balanced, expert TP"} for c in curves],
        [f | {"source": f"{source}, power_law_1.01 / balanced, expert TP"} for f in factors],
        left_out,
    )


def _model_shapes(rows: Any, dtype: str) -> Any:
    """The rows of the model shapes ``dtype``'s curves are fitted on: the fine-grained MoE of large
    models (hidden >= 4096, >= 64 experts) - AIConfigurator's many small models would set the
    median curves of the large ones kadapt prices - but for a dtype measured only on the models that
    ship it (``EVERY_SHAPE``), whose every shape is kept."""
    if dtype in EVERY_SHAPE:
        return rows
    return rows[(rows.hidden_size >= 4096) & (rows.num_experts >= 64)]


def _without_broken_ep(balanced: Any, columns: dict[str, str]) -> tuple[Any, list[str]]:
    """``balanced`` without the EP sizes ``calibrate_rows.broken_ep_sizes`` leaves out of each model
    shape (``columns`` but the EP size), and each one left out, named for a curve's source:
    AIConfigurator's rows of an EP size slower than a smaller one's at the same tokens are a broken
    measurement of less work, and a shape's curve fitted on them priced it so (TensorRT-LLM rc20 on
    H100, hidden 4096 x 1,024, 512 experts at EP4: efficiency ~0.2 and a 148 us floor, where its EP2
    and EP8 reach 0.83-0.94 and 35-41 us; Qwen3-Next's experts priced from it at 69 ms a 2k prefill,
    8 on B200). Their power-law rows go with them: the routing factors are joined to these rows."""
    names = {attr: column for attr, column in columns.items() if column != "moe_ep_size"}
    shape = list(names.values())
    medians = balanced.groupby([*shape, "moe_ep_size", "num_tokens"]).latency.median()
    left_out: list[tuple[int, ...]] = []
    labels = []
    for values, rows in medians.groupby(level=list(range(len(shape)))):
        latency: dict[int, dict[int, float]] = {}
        for (*_, ep, tokens), ms in rows.items():
            latency.setdefault(int(ep), {})[int(tokens)] = float(ms)
        for broken in broken_ep_sizes(latency):
            left_out.append((*map(int, values), broken.ep))
            named = ", ".join(f"{attr} {int(v)}" for attr, v in zip(names, values, strict=True))
            labels.append(f"{named}, EP {broken.ep} ({broken.slower} of {broken.compared} rows)")
    if not left_out:
        return balanced, []
    keep = ~balanced.set_index([*shape, "moe_ep_size"]).index.isin(left_out)
    return balanced[keep], labels


def _left_out_note(labels: list[str]) -> str:
    """What a dtype's curves' source says of the EP sizes left out of its shapes ("" where none is)."""
    if not labels:
        return ""
    return (
        f"; balanced rows left out where an EP size's rows took over {SLOWER_RATIO}x and "
        f"{SLOWER_MS * 1e3:.0f} us more than a smaller EP size's at the same tokens at over half its token "
        f"counts (a larger EP size runs less work per rank: a broken measurement; the shape prices from the "
        f"EP sizes around it): {'; '.join(labels)}"
    )


def _routing_pairs(table: Any, even: Any, skew: str = "power_law_1.01") -> Any:
    """``even`` (evenly routed) rows joined with the ``skew`` rows of the same shape, with their
    latency ``ratio``."""
    shape = ["num_tokens", "hidden_size", "inter_size", "topk", "num_experts", "moe_ep_size"]
    shape += ["moe_tp_size"] if "moe_tp_size" in table else []
    skewed = table[table.distribution == skew][[*shape, "latency"]]
    joined = even.merge(skewed, on=shape, suffixes=("", "_skewed"))
    return joined.assign(ratio=joined.latency_skewed / joined.latency)


def _wide_ep_curves(
    root: Path,
    framework: str,
    dtype: str,
    ideal: Any,
    floor_ms: float,
    graph: str,
    phase: str,
    row_filter: RowFilter,
) -> tuple[list[Any], list[Any]]:
    """The wide-EP path's efficiency and power-law curves per measured shape, for one phase (empty
    where ``framework`` did not measure it itself: another framework's wide-EP kernels are not this
    one's). Its rows start at 4-32 tokens, so the pipeline floor is the TP path's ``floor_ms``."""

    def select(t: Any) -> Any:
        return t[t.moe_dtype == dtype]

    try:
        found = measured(root, ("moe", f"wideep_{phase}_moe_perf.parquet"), framework, select, row_filter)
    except KadaptError:
        return [], []
    if found.source.split("/")[2] != framework:
        return [], []
    table = found.rows
    local = table.num_experts / table.moe_ep_size
    pairs = table.num_tokens * table.topk / table.moe_ep_size
    table = table.assign(pairs_per_expert=pairs / local, pairs=pairs, local=local)
    table = table.assign(ideal=ideal(table))
    even = table[table.distribution == "uniform"]
    layout = {"graph": graph}
    curves = _shape_curves(even, EXPERT_SHAPE, lambda rows: _expert_curve(rows, floor_ms), layout)
    joined = _routing_pairs(table, even)
    factors = _shape_curves(joined, EXPERT_SHAPE, lambda rows: _factor_curve(rows, floor_ms), layout)
    source = f"{found.source}, uniform"
    return [c | {"source": source} for c in curves], [
        f | {"source": f"{source} / power_law_1.01"} for f in factors
    ]


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
