"""How the calibration turns measured rows into a curve, whatever the op: grids, medians, efficiencies.

A curve's value at a grid point is the median over the rows binned to it (``_median_curve``), or, for
the rows of one shape, at each point measured (``_exact_curve``); medians are taken as pandas takes
them, to the last bit (``_medians_by``). ``_eff`` is a row's fraction of kadapt's roofline bound net
of the op overhead, launch-bound rows dropped; ``_shape_curves`` fits each measured shape on its own
rows and names it by a ``match`` of op attributes. Separate from the per-op fits because every one of
them uses these, and they say nothing about any op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ....errors import KadaptError

OVERHEAD_MS = 0.002  # the device profiles' op_overhead (2 us on Hopper and Blackwell)
M_GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SEQ_GRID = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
BYTES_GRID = [2**p for p in range(16, 34, 2)]  # 64 KiB .. 8 GiB read per decode-attention call
MOE_GRID = [0.25, 1, 4, 16, 64, 256, 1024]  # token-expert pairs per local expert
KV_DTYPES = {"bfloat16": "bf16", "fp8": "fp8"}  # AIConfigurator's cache dtype -> kadapt's kv_dtype
BY_SHAPE = (
    "the curve is the median over every shape measured; each of shapes is the same fit on the rows of "
    "one shape only (match: the op attributes it is measured at), which prices an op of that shape"
)


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
    layout: dict[str, Any] | None = None,
) -> list[Any]:
    """``fit`` on the rows of each measured shape, with its ``match`` (plus ``layout``: what every row
    was measured under); a shape whose rows are all launch-bound (dropped by ``_eff``) gets no curve
    and prices with the median one."""
    fitted = [(match, fit(rows)) for match, rows in _by_shape(frame, columns)]
    return [{"match": match | (layout or {}), **curve} for match, curve in fitted if curve]


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
