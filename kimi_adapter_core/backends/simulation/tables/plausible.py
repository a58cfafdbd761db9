"""Which per-shape power-law routing curves of a kernel table are plausible enough to price with.

A shape's ``routing.power_law`` curve is AIConfigurator's power-law / balanced latency ratio on
that shape's rows, net of its pipeline floor (``calibrate_experts._factor_curve``). Where one side
of a shape's rows is itself wrong the ratio is wrong at every point: H200 / TensorRT-LLM
1.3.0rc20, bf16, hidden 4096 x 1,024, 512 experts, top-10, EP4: its power-law rows take 4.0 ms at
256 tokens against 0.78 balanced (5.1x; EP2 and EP8 of the same model 0.82x and 0.82x), flat from 64
to 1,024 tokens - the power_law_1.2 rows' times - so every point of its curve is 3.7-10, and the
lookups carried it to every narrower model at EP4 (Qwen3-Next's experts at 5.7x balanced, 62 ms a
2k prefill on H200 against 8 on B200); other shapes' curves hold 20-990x (a 128-expert
top-1 model at EP8-64, a 256-expert one at EP64) or the 0.001 clamp at 1-64 pairs per expert
(wide-EP sizes on the TP path).

The bands are fitted from the table's own spread: over every point at one or more pairs per local
expert of every shape curve of that dtype, Tukey's fences in log(factor) - the quartiles +- 3
interquartile ranges ("far out": [0.28, 3.8] for H200 / TensorRT-LLM bf16, [0.32, 3.6] for its
fp8-block experts) and +- 6 ([0.09, 11.8], [0.11, 10.2]). A shape curve is not used where over a
quarter of its checked points lie outside the first band (its rows are wrong across the range: the
audited shape, every point 3.7-10) or any point outside the second (a 0.001 clamp or a 20-750x
point); a point or a few just outside the first band is the rows' noise and stays (MXFP4 on H100 /
SGLang, a band of [0.52, 2.11]: gpt-oss at EP32, 2.3-2.5 from 256 pairs per expert, the hottest of
32 single-expert ranks). Its shape prices from the next more general curve (the model shape's other
EP sizes around it, else the other model widths at its EP size, else the median over every shape:
``curves.measured_across``), and the op's ``source`` says so (``KernelTable.imbalance_note``). Below
one pair per expert the points are not checked: the time above the pipeline floor is a fraction of
one expert's pass and the curve's ``floor_factor`` prices the rank routed fewer experts. Only the
routing factors: a shape's balanced rows slower than a smaller EP size's never reach a table (the
calibration leaves them out: ``calibrate_rows.broken_ep_sizes``).

Separate from ``kernels`` (loading and queries) because this is one rule on one section's values,
applied where a table is loaded so every table, shipped or user, is held to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .curves import Curve, Match

TUKEY_FAR = 3.0  # interquartile ranges past the quartiles (log factor): Tukey's "far out" fences
TUKEY_ANY = 6.0  # ... past which no single point of a curve priced with may lie
OUTSIDE_SHARE = 0.25  # the share of a curve's checked points that may lie outside the far-out band
# whatever a table's spread, a factor past these is a fit gone wrong (0.001 is the fit's clamp; the
# widest fences fitted, B200 / TensorRT-LLM MXFP4 on 14 shapes, reach 0.02-107)
FAR_LIMITS, ANY_LIMITS = (0.1, 10.0), (0.05, 20.0)
CHECKED_FROM = 1.0  # pairs per local expert from which a shape curve's factors are checked


@dataclass(frozen=True)
class RoutingCheck:
    """One dtype's routing curve as the table holds it, the band and the shapes left out."""

    raw: Curve  # with every per-shape curve the file holds
    band: tuple[float, float]  # the far-out fences, at CHECKED_FROM pairs per expert and up
    outer: tuple[float, float]  # the fences no point of a curve priced with lies outside
    dropped: tuple[Match, ...]  # the shapes whose curve had a factor outside the band

    def note(self, was: float, now: float) -> str:
        """What an op's source says where a left-out curve would have priced it at ``was``: the
        bands, and ``now``, the factor the next more general curve gives ("" where they agree)."""
        if was == now:
            return ""
        (low, high), (lowest, highest) = self.band, self.outer
        return (
            f" (power-law factor {was:.3g} from a per-shape curve outside the plausible bands (a quarter "
            f"of its points past [{low:.2f}, {high:.2f}] or one past [{lowest:.2f}, {highest:.2f}]) not "
            f"used; {now:.3g} from the curves around it)"
        )


def _quartile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values``, linear between order statistics."""
    at = q * (len(values) - 1)
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def factor_bands(curve: Curve) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """Tukey's fences (``TUKEY_FAR``, ``TUKEY_ANY``) of log(factor) over every checked point of
    ``curve``'s shapes, each within its limits (None: fewer than 8 points, too few to tell an
    outlier)."""
    logs = sorted(
        math.log(y)
        for _, shaped in curve.shapes
        for x, y in zip(shaped.xs, shaped.ys, strict=True)
        if x >= CHECKED_FROM and y > 0
    )
    if len(logs) < 8:
        return None
    q1, q3 = _quartile(logs, 0.25), _quartile(logs, 0.75)

    def fences(k: float, limits: tuple[float, float]) -> tuple[float, float]:
        spread = k * (q3 - q1)
        return max(limits[0], math.exp(q1 - spread)), min(limits[1], math.exp(q3 + spread))

    return fences(TUKEY_FAR, FAR_LIMITS), fences(TUKEY_ANY, ANY_LIMITS)


def checked(curve: Curve) -> tuple[Curve, RoutingCheck | None]:
    """``curve`` without its shape curves outside the bands (and the check, None where none was
    dropped)."""
    bands = factor_bands(curve)
    if bands is None:
        return curve, None
    (low, high), (lowest, highest) = bands

    def plausible(shaped: Curve) -> bool:
        points = [y for x, y in zip(shaped.xs, shaped.ys, strict=True) if x >= CHECKED_FROM]
        outside = sum(not low <= y <= high for y in points)
        return outside <= OUTSIDE_SHARE * len(points) and all(lowest <= y <= highest for y in points)

    kept = tuple(entry for entry in curve.shapes if plausible(entry[1]))
    if len(kept) == len(curve.shapes):
        return curve, None
    dropped = tuple(match for match, shaped in curve.shapes if not plausible(shaped))
    return replace(curve, shapes=kept), RoutingCheck(curve, bands[0], bands[1], dropped)
