"""Attention curves from AIConfigurator's standalone attention and MLA kernel tables.

Prefill attention by new tokens per sequence, decode attention by the KV bytes one call reads, for
GQA (head dim 128, no window) and DeepSeek-style MLA, each with its curves per measured shape (head
counts, cache dtype, and in prefill the batch), and kadapt's roofline bound of each row exactly as
``serving_kernels.AttentionKernel`` records the op (``_gqa_prefill_ms``, ``_mla_prefill_ms``,
``_mla_decode_ms``). Separate from the other op kinds' fits because its shapes, grids and bounds are
its own; the MLA module fit (``calibrate_mla_module``) reuses these bounds and shape rules.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .calibrate_fit import (
    BY_SHAPE,
    BYTES_GRID,
    SEQ_GRID,
    _by_shape,
    _eff,
    _exact_curve,
    _median_curve,
    _shape_curves,
)
from .calibrate_rows import RowFilter, measured

# the standalone attention rows, like the expert table's (``calibrate_experts.EXPERT_LAYOUT``):
# AIConfigurator's attention-DP graphs price MLA as modules measured under DP attention, so a head
# count's own curve prices layouts without attention DP
ATTENTION_LAYOUT = {"attention_dp": 1}
MLA_SHAPE = {"heads": "num_heads"}  # query heads per rank
GQA_SHAPE = {"heads": "num_heads", "kv_heads": "num_key_value_heads"}
DECODE_SHAPE = {"kv_dtype": "kv_cache_dtype"}  # decode reads either cache dtype; prefill rows are bf16
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


def _prefill_shapes(
    rows: Any,
    columns: dict[str, str],
    fit: Callable[[Any], dict[str, Any]],
    layout: dict[str, Any] = ATTENTION_LAYOUT,
) -> list[Any]:
    """A prefill attention curve's ``shapes``: each shape at each measured batch first (``measured_at``
    takes the first match, so a measured batch x length prices from its own rows: at one sequence the
    kernel is launch- and occupancy-bound, 0.2x the efficiency of the batches that set the median),
    then each shape over every batch, which prices the batches not measured; all under ``layout``
    (what the rows were measured under)."""
    per_batch = _shape_curves(rows, columns | PREFILL_BATCH, fit, layout)
    return per_batch + _shape_curves(rows, columns, fit, layout)


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


def attention_curves(
    root: Path, framework: str, peak: dict[str, float], bw: float, row_filter: RowFilter
) -> dict[str, Any]:
    """Prefill attention by new tokens per sequence, decode attention by KV bytes one call reads, for
    GQA (head_dim 128, no window) and DeepSeek-style MLA. The per-shape curves also price a head
    count not measured from the head counts around it (``curves.measured_across``)."""
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
    ``serving_kernels.AttentionKernel`` records the op: causal pairs at head dim 128; queries and outputs
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
