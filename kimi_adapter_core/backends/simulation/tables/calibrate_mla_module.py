"""MLA curves of a module measured whole: vLLM's MLA (``DeepseekV2MLAAttention``), which it measured
only as a module, not as a standalone kernel, and SGLang's MLA module under DP attention (its wide-EP
path: FP8-block attention math, an FP8 cache, FP8-block q_b / kv_b / o projections).

From the module rows: the attention curves (decode less the module's flat floor, prefill less its
projections as this table's GEMM curves price them inside a module) and the module floors
(``module_floor``: the module's time besides its attention, per measured shape). vLLM's replace the
MLA curves borrowed from another framework; SGLang's wide-EP ones price only the layouts that run
that path (their curves match ``graph``, their floors are kinds of their own: ``WIDE_EP_MODULES``).
Separate from ``calibrate_attention`` because taking the attention out of a module is its own
derivation, with its own shapes (DeepSeek-V3's MLA sizes and projection dtypes) and a GEMM pricing
of its own (``_gemm_ms``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .calibrate_attention import (
    ATTENTION_LAYOUT,
    BY_BATCH,
    BY_CACHE,
    DECODE_SHAPE,
    MLA_SHAPE,
    _by_cache_dtype,
    _kv_read,
    _mla_decode_ms,
    _mla_prefill_ms,
    _prefill_shapes,
)
from .calibrate_fit import (
    BY_SHAPE,
    BYTES_GRID,
    OVERHEAD_MS,
    SEQ_GRID,
    _eff,
    _exact_curve,
    _median_curve,
    _shape_curves,
)
from .calibrate_rows import Measured, RowFilter, _read_table, _version
from .curves import Curve

# The MLA attention module (vLLM's ``DeepseekV2MLAAttention`` forward: q_a + kv_a, norms, q_b, rope,
# the attention with its absorbed bmms, o_proj) measured whole, for a framework that measured no
# standalone MLA kernel: AIConfigurator measured it on DeepSeek-V3 only, whose MLA sizes these are
MLA_MODULE_MODEL = "deepseek-ai/DeepSeek-V3"
MLA_MODULE = {"hidden": 7168, "q_lora": 1536, "kv_lora": 512, "rope": 64, "nope": 128, "v": 128}
# the module's projection dtype (gemm_type) -> (kadapt kernel, weight bytes per parameter, peak key)
MODULE_GEMMS = {"bfloat16": ("bf16", 2.0, "bf16"), "fp8_block": ("fp8_block", 1.0, "fp8")}
MODULE_ATTENTION_SHAPE = MLA_SHAPE | DECODE_SHAPE
FLOOR_READ_MS = 0.001  # a decode module row whose cache read is this short measures the module's floor
MODULE_SHAPE = MODULE_ATTENTION_SHAPE | {"projections": "gemm_type"}
# SGLang's MLA module under DP attention (AIConfigurator's ``WideEpContextMla`` /
# ``WideEpGenerationMla``, its large-EP graph's attention), per phase: (its rows, the ``graph`` its
# attention curves match: ``cost.table_shape`` gives it to a wide-EP layout's ops, the module-floor
# kind). Measured with the fused q_a + kv_a downscale outside (SGLang's communicator runs it before
# the module; AIConfigurator prices it apart), at FP8-block attention math, with two attention
# backends: FlashInfer is AIConfigurator's default for the module
WIDE_EP_MODULES = {
    "generation": ("wideep_generation_mla_perf.parquet", "wide_ep_generation", "wide_ep_generation_mla"),
    "context": ("wideep_context_mla_perf.parquet", "wide_ep_context", "wide_ep_context_mla"),
}
WIDE_EP_MLA = {"mla_dtype": "fp8_block", "kernel": "flashinfer"}
# the projections a wide-EP module's measurement does not hold (``module_floor.<kind>.outside``)
WIDE_EP_OUTSIDE = ["q_a_proj", "kv_a_proj_with_mqa"]


def module_rows(
    root: Path,
    framework: str,
    file: str,
    row_filter: RowFilter,
    mla_dtype: str = "bfloat16",
    kernel: str | None = None,
) -> Measured | None:
    """The rows of ``framework``'s own MLA module table (its newest version that has any): DeepSeek-V3's
    module, attention compute in ``mla_dtype``, projections in a dtype kadapt prices
    (``MODULE_GEMMS``), the attention backend ``kernel`` where the table measured it, else the one it
    measured most (every one: None; AIConfigurator takes the only backend measured whatever it is
    asked for: SGLang's wide-EP module on B200 / GB200 is TRT-LLM's MLA kernel alone); None where the
    framework measured no module. Never borrowed: a module prices only its own framework. A version
    whose table does not name the model and projections (SGLang 0.5.6's wide-EP rows) is skipped."""
    paths = sorted(root.glob(f"mla/{framework}/*/{file}"), key=lambda p: _version(p.parent.name))
    for path in reversed(paths):
        t = _read_table(path)
        if not {"model", "gemm_type"} <= set(t.columns):
            continue
        keep = (t.model == MLA_MODULE_MODEL) & (t.mla_dtype == mla_dtype) & (t.tp_size == 1)
        rows = row_filter("mla", t[keep & t.gemm_type.isin(list(MODULE_GEMMS))])
        if kernel is not None and len(rows):
            counts = rows.kernel_source.value_counts()
            rows = rows[rows.kernel_source == (kernel if kernel in counts.index else counts.idxmax())]
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


def wide_ep_module_curves(
    root: Path,
    framework: str,
    peak: dict[str, float],
    bw: float,
    row_filter: RowFilter,
    gemm: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> tuple[list[Any], list[Any], dict[str, Any]] | None:
    """(prefill attention shapes, decode attention shapes, module floors per kind) of ``framework``'s
    own MLA module under DP attention (``WIDE_EP_MODULES``: SGLang's), taken out of the module as
    vLLM's is (``module_decode``, ``module_prefill``) but without the q_a + kv_a downscale, which the
    measurement does not hold; None where the framework measured no such module. The attention
    curves match the layout's ``graph``, so they price only a wide-EP layout's MLA kernel (its
    standalone kernel elsewhere), and the floors carry the projections left outside the module
    (``outside``). Without them the roofline priced SGLang's wide-EP MLA as its standalone bf16
    kernel and its projections apart: 352 ms in an H100 DP16 EP16 prefill of DeepSeek-V3 (16 x 4k)
    against the module's 167."""
    found = {
        phase: module_rows(root, framework, file, row_filter, **WIDE_EP_MLA)
        for phase, (file, _graph, _kind) in WIDE_EP_MODULES.items()
    }
    generation, context = found["generation"], found["context"]
    if generation is None or context is None:
        return None
    (_, decode_graph, decode_kind), (_, prefill_graph, prefill_kind) = WIDE_EP_MODULES.values()
    decode, floor = module_decode(generation, peak, bw, {"graph": decode_graph}, keys="isl")
    prefill, prefill_floor = module_prefill(
        context, peak, bw, gemm, {"graph": prefill_graph}, downscale=False
    )
    return (
        [shape | {"source": context.source} for shape in prefill["shapes"]],
        [shape | {"source": generation.source} for shape in decode.get("shapes", ())],
        {
            decode_kind: floor | {"outside": WIDE_EP_OUTSIDE},
            prefill_kind: prefill_floor | {"outside": WIDE_EP_OUTSIDE},
        },
    )


def module_decode(
    found: Measured,
    peak: dict[str, float],
    bw: float,
    layout: dict[str, Any] = ATTENTION_LAYOUT,
    keys: str = "step",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Decode MLA from the module rows: (attention curve, module floor), both measured under
    ``layout``; ``keys`` is the column holding the keys a row attends (vLLM's ``step``, its own token
    included; SGLang's wide-EP rows hold it as ``isl``, at step 0).

    At one batch the module's time is flat over short contexts (vLLM 0.24, H200, 16 heads, FP8 cache
    and projections: 0.14 ms from 2 to 256 keys at b128) and then grows with the cache read (0.24 ms
    at 4k): the flat part is the module's projections, norms, rope and launches, the rest the
    attention. So the floor of each (shape, batch) is the median of its rows whose cache read takes
    under ``FLOOR_READ_MS`` at full bandwidth (one row alone is +-5 us of noise), and the attention
    curve is fitted on the rows less their floor. The floor is not the module's GEMMs as
    the standalone GEMM table prices them: vLLM's fp8-block GEMM rows take ~85 us each at M = 128
    whatever N (five of them exceed the whole module), its bf16 ones ~40 us for all five (a third of
    the floor); so an op of a measured module shape prices as the module (``cost.fold_modules``)."""
    shape = ["num_heads", "kv_cache_dtype", "gemm_type", "batch_size"]
    rows = _kv_read(found.rows.assign(ctx=found.rows[keys]))
    short = rows[rows.read / bw * 1e3 < FLOOR_READ_MS]
    floor = short.groupby(shape, as_index=False).latency.median()
    rows = rows.merge(floor, on=shape, suffixes=("", "_floor"))
    net = _eff(rows.assign(latency=rows.latency - rows.latency_floor), lambda f: _mla_decode_ms(f, peak, bw))
    exact = _shape_curves(
        net,
        MODULE_ATTENTION_SHAPE,
        lambda own: _exact_curve(own, "read", names=("kv_bytes", "efficiency")),
        layout,
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
            layout | {"hidden": MLA_MODULE["hidden"]},
        ),
    }


def module_prefill(
    found: Measured,
    peak: dict[str, float],
    bw: float,
    gemm: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
    layout: dict[str, Any] = ATTENTION_LAYOUT,
    downscale: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Prefill MLA from the module rows (no cached prefix): (attention curve, module floor by tokens),
    both measured under ``layout``.

    The attention is fitted on the rows with bf16 projections (every row where none has them) less
    the module's GEMMs as this table's GEMM curves price them inside a module (q_a + kv_a where the
    module holds that ``downscale``, q_b, kv_b, o_proj at M = the new tokens, at their efficiencies
    plus one op overhead: without the standalone call's fixed cost, ``gemm_floor``, which a GEMM
    inside the module does not pay - vLLM 0.24's whole module takes 0.18 ms at one 1,024-token
    sequence on GB200, DeepSeek-V3 at 16 heads, where one standalone fp8-block GEMM row takes
    0.27-0.32 ms); the norms and rope are left in. The attention
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
    bf16 = bool((rows.gemm_type == "bfloat16").any())
    own = rows[rows.gemm_type == "bfloat16"] if bf16 else rows
    own = own.assign(latency=own.latency - _module_gemms_ms(own, peak, bw, gemm, downscale))
    net = _eff(own, lambda f: _mla_prefill_ms(f, peak, bw))
    keys = ["num_heads", "kv_cache_dtype", "batch_size", "isl"]
    ideal = _mla_prefill_ms(own, peak, bw) + OVERHEAD_MS  # the attention as priced: never above 1
    attention_ms = own.assign(attention=own.latency.combine(ideal, max))[[*keys, "attention"]]
    rest = rows.merge(attention_ms.groupby(keys, as_index=False).attention.median(), on=keys)
    rest = rest.assign(latency_us=(rest.latency - rest.attention) * 1e3)
    rest = rest.groupby(
        ["num_heads", "kv_cache_dtype", "gemm_type", "tokens"], as_index=False
    ).latency_us.median()
    gemms = "q_a + kv_a, q_b, kv_b and o_proj" if downscale else "q_b, kv_b and o_proj"
    fitted_on = "the rows with bf16 projections" if bf16 else "its rows"
    attention = {
        "seq": SEQ_GRID,
        "efficiency": _median_curve(net, "isl", SEQ_GRID),
        "source": (
            f"{found.source}, less the module's {gemms} GEMMs priced by this "
            f"table's gemm curves inside a module, on {fitted_on}; {BY_SHAPE}; "
            f"{BY_BATCH}"
        ),
        "shapes": _prefill_shapes(
            net,
            MODULE_ATTENTION_SHAPE,
            lambda own: _exact_curve(own, "isl", names=("seq", "efficiency")),
            layout,
        ),
    }
    return attention, {
        "source": (
            f"{found.source}: the module's time at one call of new tokens (no cached prefix) less its "
            f"attention as the prefill curve prices it ({'the bf16-projection' if bf16 else 'its'} rows less "
            "their GEMMs), by "
            "new tokens (median over batches): its projections, norms, rope and launches, per shape "
            "(match), in us; a head count not measured takes it from those around it (cost.module_floor)"
        ),
        "shapes": _shape_curves(
            rest,
            MODULE_SHAPE,
            lambda own: _exact_curve(own, "tokens", "latency_us", ("tokens", "latency_us")),
            layout | {"hidden": MLA_MODULE["hidden"]},
        ),
    }


def _module_gemm_shapes(heads: Any, downscale: bool = True) -> list[tuple[Any, Any]]:
    """(N, K) of the MLA module's projections at ``heads`` per rank (DeepSeek-V3's MLA sizes): the
    fused q_a + kv_a downscale (where the module holds it), q_b, kv_b (the prefill's latent
    expansion), o_proj."""
    d = MLA_MODULE
    return [
        *([(d["q_lora"] + d["kv_lora"] + d["rope"], d["hidden"])] if downscale else []),
        (heads * (d["nope"] + d["rope"]), d["q_lora"]),
        (heads * (d["nope"] + d["v"]), d["kv_lora"]),
        (d["hidden"], heads * d["v"]),
    ]


def _module_gemms_ms(
    rows: Any, peak: dict[str, float], bw: float, gemm: tuple[dict[str, Any], ...], downscale: bool = True
) -> list[float]:
    """Each module row's projections (``_module_gemm_shapes`` at its heads, M = its new ``tokens``) in
    ms, summed, as ``_gemm_ms`` prices each: row by row (a ``Curve`` takes one point), on plain
    numbers with each dtype's curves built once (a pandas row apply took ~0.3 s per vLLM table)."""
    curves = {projections: _gemm_curves(gemm, projections) for projections in rows.gemm_type.unique()}
    return [
        sum(
            _gemm_ms(m, n, k, projections, curves[projections], peak, bw)
            for n, k in _module_gemm_shapes(heads, downscale)
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
