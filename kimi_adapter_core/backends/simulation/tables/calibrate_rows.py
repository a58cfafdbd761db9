"""AIConfigurator's measured tables as the calibration reads them: where they are, and which rows a
curve is fitted on.

``measured`` takes the rows a fit selects from the NEWEST version of the serving framework that has
any (then the other frameworks', in ``FRAMEWORKS`` order), narrowed to one kernel, and names them in
a ``source``; ``_read_table`` keeps the last few parquet files read, since one table's fits select
from the same files again. Separate from the fits (``calibrate_gemm``, ``calibrate_experts``,
``calibrate_attention``, ``calibrate_mla_module``, ``calibrate_all_reduce``) because choosing the data is
one rule for every op kind, and the only code here that knows AIConfigurator's folder layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from ....errors import KadaptError

FRAMEWORKS = ("trtllm", "sglang", "vllm")  # the order a missing kernel is borrowed in
RowFilter = Callable[[str, Any], Any]  # (op, rows) -> the rows to fit on


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
