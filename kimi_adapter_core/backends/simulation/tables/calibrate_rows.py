"""AIConfigurator's measured tables as the calibration reads them: where they are, and which rows a
curve is fitted on.

``measured`` takes the rows a fit selects from the NEWEST version of the serving framework that has
any (then the other frameworks', in ``FRAMEWORKS`` order), narrowed to one kernel, and names them in
a ``source``; ``_read_table`` keeps the last few parquet files read, since one table's fits select
from the same files again. Separate from the fits (``calibrate_gemm``, ``calibrate_experts``,
``calibrate_attention``, ``calibrate_mla_module``, ``calibrate_all_reduce``) because choosing the data is
one rule for every op kind, and the only code here that knows AIConfigurator's folder layout.

``broken_ep_sizes`` is the rule that leaves a routed-expert shape's broken EP sizes out: the calibration
applies it to the rows it fits on, the measured cost model (``estimate/measured.py``) to the rows
AIConfigurator prices from, so both leave out the same measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from ....errors import KadaptError

FRAMEWORKS = ("trtllm", "sglang", "vllm")  # the order a missing kernel is borrowed in
RowFilter = Callable[[str, Any], Any]  # (op, rows) -> the rows to fit on
# a balanced expert row is slower than the fastest smaller EP size's at the same tokens where it takes
# over SLOWER_RATIO x that row and over SLOWER_MS more; an EP size with over BROKEN_SHARE of its rows so
# is left out (``broken_ep_sizes``)
SLOWER_RATIO = 1.3
SLOWER_MS = 0.05
BROKEN_SHARE = 0.5


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


@dataclass(frozen=True)
class BrokenEp:
    """An EP size of one routed-expert shape whose balanced rows are left out, and how many were slower."""

    ep: int
    slower: int  # rows slower than the fastest smaller EP size's at the same tokens
    compared: int  # rows at a token count a smaller EP size kept also measured


def broken_ep_sizes(latency: Mapping[int, Mapping[int, float]]) -> tuple[BrokenEp, ...]:
    """The EP sizes of one routed-expert shape (same model shape, quant, framework and kernel) whose
    balanced rows are a broken measurement, from ``latency`` (EP size -> tokens -> ms).

    Why a larger EP size may not be slower: at the same tokens a rank of EP ``e`` holds ``1/e`` of the
    experts and runs ``tokens x top_k / e`` token-expert pairs, at the same pairs per local expert, so
    its grouped GEMMs do a fraction ``e'/e`` of an EP ``e'`` rank's work at the same efficiency, and its
    fixed pipeline cost (routing and permuting every token on the TP path) is the same. So a row over
    ``SLOWER_RATIO`` x the fastest smaller EP size's row at the same tokens, and over ``SLOWER_MS``
    slower (the pipeline's run-to-run spread at a few tokens, where rows take 0.05-0.2 ms), was not a
    measurement of less work. One such row is kept: AIConfigurator's tables hold them at one to a few
    tokens and past 12k tokens at EP 32-256 in every table (Blackwell's included), never more than a
    third of an EP size's rows. An EP size with over ``BROKEN_SHARE`` of its rows so is left out whole
    (every one found holds 59-100%, all TensorRT-LLM 1.3.0rc20's on H100 / H200: bf16 hidden 4096 x
    1,024, 512 experts top-10 at EP4 on H100 takes 5.08 ms at 64 tokens against 2.14 at EP2 and 0.55
    at EP8, rc10's 1.52): its rows at the few token counts it passes are the same broken run, and the
    shape then prices from the EP sizes around it. The EP sizes left out set no reference for larger
    ones. The same EP sizes are left out at a ratio of 1.2 to 1.5 (``SLOWER_RATIO``); without the
    ``SLOWER_MS`` margin 11 more would be, all Hopper's at EP 128-256, whose rows of tens of
    microseconds (mostly the fixed cost) sit under 50 us above a smaller EP size's.
    Checked smallest EP size first; the smallest measured is never left out (nothing to compare)."""
    fastest: dict[int, float] = {}  # tokens -> the fastest row of the smaller EP sizes kept
    broken = []
    for ep in sorted(latency):
        rows = latency[ep]
        compared = [(tokens, ms) for tokens, ms in rows.items() if tokens in fastest]
        slower = sum(
            ms > SLOWER_RATIO * fastest[tokens] and ms - fastest[tokens] > SLOWER_MS
            for tokens, ms in compared
        )
        if compared and slower > BROKEN_SHARE * len(compared):
            broken.append(BrokenEp(int(ep), slower, len(compared)))
            continue
        for tokens, ms in rows.items():
            fastest[tokens] = min(ms, fastest.get(tokens, ms))
    return tuple(broken)
