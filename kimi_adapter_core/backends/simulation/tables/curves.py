"""An efficiency curve of a kernel table, and how an op's shape picks the curve it prices with.

A curve maps one shape variable (tokens M, pairs per local expert, sequence length, KV bytes read,
message bytes) to an efficiency, interpolated linearly in log(shape) and held flat past its ends
(``Curve.__call__``). It is the median over every shape measured; its ``shapes`` are the same fit on
the rows of one shape only, each named by a ``match`` of op attributes (experts: ``hidden``,
``width``, ``experts``, ``top_k``, ``ep``; attention: ``heads``, ``kv_heads``, ``kv_dtype``; and the
layout measured, ``attention_dp``), and an op of a measured shape prices with its own (``Curve.at``:
the first that matches, so a prefill kernel's curves per shape and ``batch`` come before its curves
per shape over every batch, which price a batch not measured); an expert op at an EP size not
measured takes its model shape's curves at the EP sizes around it (a model shape measured at no EP
size: the curves of the model widths around it at its EP size), an attention op at a head count not
measured the curves at the head counts around it (``measured_across``).

Separate from ``kernels`` (the tables' file format, loading and per-op-kind queries) because this is
the lookup and interpolation arithmetic alone: the device profiles' curves (``device``) and the
calibration's in-memory GEMM pricing use it without any table.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Shape = Mapping[str, Any]  # an op's attributes (``heads``, ``hidden``, ``experts``, ...)
Match = tuple[tuple[str, float | str], ...]  # the op attributes a shape's curve is measured at


def measured_at(shapes: tuple[tuple[Match, Curve], ...], shape: Shape | None) -> Curve | None:
    """The curve of ``shapes`` whose every ``match`` attribute ``shape`` has, else None."""
    for match, curve in shapes if shape else ():
        if all(_matched(shape.get(key)) == value for key, value in match):
            return curve
    return None


# A routed-expert curve's model width, a coordinate derived from its shape: one expert's weight
# elements (gate, up and down: 3 x hidden x width), to which its GEMMs' bytes and FLOPs per
# token-expert pair are proportional; the model's other attributes (experts, top-k) vary with it
EXPERT_WIDTH = "expert_weights"
_DERIVED: dict[str, tuple[tuple[str, ...], Callable[[Shape], Any]]] = {
    EXPERT_WIDTH: (
        ("hidden", "width", "experts", "top_k"),
        lambda shape: _product(3.0, shape.get("hidden"), shape.get("width")),
    ),
}


def _product(*values: Any) -> float | None:
    """The product of numeric attributes (None: one is absent or not a number)."""
    numbers = [n for n in map(_matched, values) if isinstance(n, float)]
    return math.prod(numbers) if len(numbers) == len(values) else None


def measured_across(shapes: tuple[tuple[Match, Curve], ...], shape: Shape | None, key: str) -> Curve | None:
    """The curve of ``shapes`` measured at ``shape``, else one from the curves measured at other
    values of ``key`` with every other ``match`` attribute equal: linear in log(``key``) between the
    two nearest (the values, the fixed cost and the floor factor alike), the nearest one's past the
    measured range. At each value of ``key`` the first curve that matches counts, as in
    ``measured_at`` (a prefill shape's curve at the op's batch comes before the shape over every
    batch). The curves whose ``match`` does not name ``key`` (a decode curve per cache dtype, the
    median over every head count of that dtype) come after the measured neighbours: they price a
    shape only where no value of ``key`` around it was measured (None: nothing matches, or ``shape``
    has no numeric ``key``). An MLA module's floor across head counts (``cost.module_floor``), a
    routed-expert curve across EP sizes and, at an EP size, across model widths (``EXPERT_WIDTH``:
    ``key`` may name a coordinate derived from several attributes, every one of which is then free;
    ``KernelTable.grouped_eff``), an attention curve across head counts
    (``KernelTable.attention_curve``)."""
    free, coordinate = _DERIVED.get(key, ((key,), lambda s: _matched(s.get(key))))
    keyed = tuple((match, curve) for match, curve in shapes if set(free) <= dict(match).keys())
    own = measured_at(keyed, shape)
    value = coordinate(shape) if shape else None
    if own is not None or not isinstance(value, float) or value <= 0:
        return own or measured_at(shapes, shape)
    near: dict[float, Curve] = {}
    for match, curve in keyed:
        at = coordinate(dict(match))
        others = tuple(kv for kv in match if kv[0] not in free)
        if isinstance(at, float) and at > 0 and at not in near and measured_at(((others, curve),), shape):
            near[at] = curve
    below = sorted(at for at in near if at < value)
    above = sorted(at for at in near if at > value)
    if not below or not above:
        nearest = near[below[-1]] if below else near[above[0]] if above else None
        return nearest or measured_at(shapes, shape)
    (v0, c0), (v1, c1) = (below[-1], near[below[-1]]), (above[0], near[above[0]])
    t = math.log(value / v0) / math.log(v1 / v0)
    xs = tuple(sorted(set(c0.xs) | set(c1.xs)))
    floor = tuple(c0.floor_factor(x) + t * (c1.floor_factor(x) - c0.floor_factor(x)) for x in xs)
    return Curve(
        xs,
        tuple(c0(x) + t * (c1(x) - c0(x)) for x in xs),
        c0.overhead + t * (c1.overhead - c0.overhead),
        floor if c0.floor or c1.floor else (),
    )


@dataclass(frozen=True)
class Curve:
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    overhead: float = 0.0  # seconds of fixed cost per call (grouped GEMMs); 0: the device's op overhead
    # a routing factor's scale of the pipeline floor at each point of ``xs`` (empty: 1 everywhere)
    floor: tuple[float, ...] = ()
    # curves fitted on the rows of one shape only, each with the op attributes it stands for
    shapes: tuple[tuple[Match, Curve], ...] = ()

    def at(self, shape: Shape | None, *across: str) -> Curve:
        """The curve measured at ``shape`` (every ``match`` attribute equal) where the table has one,
        else, with ``across``, one from the curves measured at other values of the first of those
        attributes that has any around it (``measured_across``), else this curve (the median over
        every shape measured): a kernel's efficiency at one width or head count can sit far from the
        median over others (MLA decode at 8 heads per rank reads the cache at ~0.8 of HBM bandwidth,
        the median over 1-128 heads ~0.5)."""
        found = next(
            (curve for key in across if (curve := measured_across(self.shapes, shape, key))),
            None if across else measured_at(self.shapes, shape),
        )
        return found or self

    def __call__(self, x: float) -> float:
        """Linear in log(x) between grid points, flat past the ends."""
        return _interpolate(self.xs, self.ys, x)

    def floor_factor(self, x: float) -> float:
        """The scale of the pipeline floor at ``x`` (a routing factor's; 1 where none is recorded)."""
        return _interpolate(self.xs, self.floor, x) if self.floor else 1.0


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """``ys`` at ``x``: linear in log(x) between points of ``xs``, flat past the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + t * (y1 - y0)


def _matched(value: Any) -> float | str | None:
    """An op attribute or ``match`` value as compared: numbers as floats (``8`` is ``8.0``), names
    as they are (None: absent or neither)."""
    if isinstance(value, str):
        return value
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
