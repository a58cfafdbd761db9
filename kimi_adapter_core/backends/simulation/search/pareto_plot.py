"""Write a sweep's throughput plot: every fitting configuration, the Pareto front highlighted.

Chosen by the file suffix: ``.svg`` and ``.html`` are written by hand (a self-contained SVG, in an
HTML page for ``.html``; no scripts, fonts or other network assets, so it opens offline and can be
attached to a report); ``.png`` needs matplotlib, which kadapt does not depend on. Both axes are
logarithmic (throughputs of one sweep span orders of magnitude) but fitted to the data, not to whole
decades, with 1-2-5 ticks (1..9 when the range is narrow): a decade-only axis left half the plot
empty and two ticks to read values by. Each front point carries its layout as a visible label (the
point to deploy should be readable without hovering); every point keeps a tooltip (``<title>``) with
its figures. With an SLA, a dashed vertical line marks the slowest per-user speed the TPOT target
allows, and points that miss the SLA are drawn hollow. Written atomically.
"""

from __future__ import annotations

import html
import importlib.util
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ....atomic import atomic_write_bytes, atomic_write_text
from ....errors import KadaptError, UsageError

SUFFIXES = (".svg", ".html", ".htm", ".png")
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_W, _H = 860, 540
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 180, 50, 60


@dataclass(frozen=True)
class PlotPoint:
    x: float  # tokens/s per user
    y: float  # tokens/s per device
    series: str  # one colour per series (the weight mode; serving mode and weight mode)
    label: str  # tooltip
    front: bool
    tag: str = ""  # short layout text drawn beside a front point
    meets_sla: bool = True  # False: drawn hollow (misses the TTFT or TPOT target)


@dataclass(frozen=True)
class SlaLine:
    """A vertical line at the slowest tokens/s per user the TPOT target allows."""

    x: float
    label: str


NO_MATPLOTLIB = "a .png plot needs matplotlib, which is not installed; write .html or .svg instead"


def require_writer(path: Path) -> None:
    """Refuse a plot that cannot be written before the sweep runs: a .png without matplotlib was
    refused only after every configuration had been priced (minutes for a large model)."""
    if path.suffix.lower() == ".png" and importlib.util.find_spec("matplotlib") is None:
        raise KadaptError(NO_MATPLOTLIB)


def write_plot(path: Path, points: Sequence[PlotPoint], title: str, sla: SlaLine | None = None) -> None:
    """Write ``points`` to ``path`` in the format its suffix names."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UsageError(f"--plot {path}: the suffix must be one of {', '.join(SUFFIXES)}")
    if not points:
        raise KadaptError(f"no configuration fits in memory: nothing to plot in {path}")
    if suffix == ".png":
        atomic_write_bytes(path, _png(points, title, sla))
        return
    svg = svg_plot(points, title, sla)
    if suffix == ".svg":
        atomic_write_text(path, svg)
    else:
        page = (
            f'<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>{html.escape(title)}'
            f"</title></head>\n<body>\n{svg}\n</body>\n</html>\n"
        )
        atomic_write_text(path, page)


class _LogAxis:
    """Maps a positive value to a pixel on a log10 axis fitted to ``values`` (a 5% margin each side,
    at least a third of a decade in all), with 1-2-5 ticks inside it (every 1..9 when that gives
    fewer than four, then every half step)."""

    def __init__(self, values: Sequence[float], start: float, end: float) -> None:
        lo, hi = math.log10(min(values)), math.log10(max(values))
        pad = max(0.05 * (hi - lo), (1 / 3 - (hi - lo)) / 2, 0.0)
        self.lo, self.hi = lo - pad, hi + pad
        self.start, self.end = start, end

    def __call__(self, value: float) -> float:
        return self.start + (math.log10(value) - self.lo) / (self.hi - self.lo) * (self.end - self.start)

    def ticks(self) -> list[float]:
        for mantissas in ((1, 2, 5), tuple(range(1, 10)), tuple(m / 2 for m in range(2, 20))):
            found = [
                m * 10.0**e
                for e in range(math.floor(self.lo), math.ceil(self.hi) + 1)
                for m in mantissas
                if self.lo <= math.log10(m * 10.0**e) <= self.hi
            ]
            if len(found) >= 4:
                return found
        return found


def _tick(value: float) -> str:
    if 1e-3 <= value < 1e6:
        return f"{value:.6g}"
    exponent = math.floor(math.log10(value))
    return f"{value / 10**exponent:.3g}e{exponent}"


def svg_plot(points: Sequence[PlotPoint], title: str, sla: SlaLine | None = None) -> str:
    """The plot as one self-contained ``<svg>`` element."""
    x = _LogAxis([p.x for p in points] + ([sla.x] if sla else []), _LEFT, _W - _RIGHT)
    y = _LogAxis([p.y for p in points], _H - _BOTTOM, _TOP)
    series = list(dict.fromkeys(p.series for p in points))
    colour = {name: _COLOURS[i % len(_COLOURS)] for i, name in enumerate(series)}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
        'font-family="sans-serif" font-size="12">',
        f"<title>{html.escape(title)}</title>",
        f'<rect x="0" y="0" width="{_W}" height="{_H}" fill="white"/>',
        f'<text x="{_W / 2:.1f}" y="24" text-anchor="middle" font-size="15">{html.escape(title)}</text>',
    ]
    for value in x.ticks():
        px = x(value)
        out.append(f'<line x1="{px:.1f}" y1="{_TOP}" x2="{px:.1f}" y2="{_H - _BOTTOM}" stroke="#ddd"/>')
        out.append(f'<text x="{px:.1f}" y="{_H - _BOTTOM + 18}" text-anchor="middle">{_tick(value)}</text>')
    for value in y.ticks():
        py = y(value)
        out.append(f'<line x1="{_LEFT}" y1="{py:.1f}" x2="{_W - _RIGHT}" y2="{py:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{_LEFT - 8}" y="{py + 4:.1f}" text-anchor="end">{_tick(value)}</text>')
    out += [
        f'<rect x="{_LEFT}" y="{_TOP}" width="{_W - _LEFT - _RIGHT}" height="{_H - _TOP - _BOTTOM}" '
        'fill="none" stroke="black"/>',
        f'<text x="{(_LEFT + _W - _RIGHT) / 2:.1f}" y="{_H - 18}" text-anchor="middle">'
        "tokens/s per user</text>",
        f'<text x="20" y="{(_TOP + _H - _BOTTOM) / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 20 {(_TOP + _H - _BOTTOM) / 2:.1f})">tokens/s per device</text>',
    ]
    if sla is not None:
        px = x(sla.x)
        out.append(
            f'<line x1="{px:.1f}" y1="{_TOP}" x2="{px:.1f}" y2="{_H - _BOTTOM}" stroke="#c00" '
            'stroke-width="1.5" stroke-dasharray="6 4"/>'
        )
        out.append(f'<text x="{px + 4:.1f}" y="{_TOP + 14}" fill="#c00">{html.escape(sla.label)}</text>')
    front = sorted((p for p in points if p.front), key=lambda p: p.x)
    if len(front) > 1:
        path = " ".join(f"{x(p.x):.1f},{y(p.y):.1f}" for p in front)
        out.append(f'<polyline points="{path}" fill="none" stroke="black" stroke-width="1.5"/>')
    for p in sorted(points, key=lambda p: p.front):  # front points drawn last, on top
        radius, stroke = (5, ' stroke="black" stroke-width="1.5"') if p.front else (3, "")
        fill = (
            f'fill="{colour[p.series]}" fill-opacity="{1 if p.front else 0.45}"'
            if p.meets_sla
            else f'fill="none" stroke="{colour[p.series]}"'
        )
        out.append(
            f'<circle cx="{x(p.x):.1f}" cy="{y(p.y):.1f}" r="{radius}" {fill}{stroke}>'
            f"<title>{html.escape(p.label)}</title></circle>"
        )
    for i, p in enumerate(front):  # labels alternate above and below the front line
        if p.tag:
            dy = -9 if i % 2 == 0 else 17
            out.append(
                f'<text x="{x(p.x) + 6:.1f}" y="{y(p.y) + dy:.1f}" font-size="10" class="tag">'
                f"{html.escape(p.tag)}</text>"
            )
    for i, name in enumerate(series):
        ly = _TOP + 10 + 20 * i
        out.append(f'<circle cx="{_W - _RIGHT + 20}" cy="{ly}" r="5" fill="{colour[name]}"/>')
        out.append(f'<text x="{_W - _RIGHT + 32}" y="{ly + 4}">{html.escape(name)}</text>')
    ly = _TOP + 10 + 20 * len(series)
    out.append(f'<line x1="{_W - _RIGHT + 14}" y1="{ly}" x2="{_W - _RIGHT + 26}" y2="{ly}" stroke="black"/>')
    out.append(f'<text x="{_W - _RIGHT + 32}" y="{ly + 4}">Pareto front</text>')
    if any(not p.meets_sla for p in points):
        ly += 20
        out.append(f'<circle cx="{_W - _RIGHT + 20}" cy="{ly}" r="4" fill="none" stroke="black"/>')
        out.append(f'<text x="{_W - _RIGHT + 32}" y="{ly + 4}">misses the SLA</text>')
    out.append("</svg>")
    return "\n".join(out)


def _png(points: Sequence[PlotPoint], title: str, sla: SlaLine | None) -> bytes:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
        from matplotlib.ticker import NullLocator
    except ImportError as exc:
        raise KadaptError(NO_MATPLOTLIB) from exc
    figure, axes = pyplot.subplots(figsize=(8.6, 5.4))
    try:
        for name in dict.fromkeys(p.series for p in points):
            mine = [p for p in points if p.series == name]
            scatter = axes.scatter([p.x for p in mine], [p.y for p in mine], s=12, alpha=0.45, label=name)
            colour = scatter.get_facecolor()[0]
            scatter.set_facecolor([colour if p.meets_sla else "none" for p in mine])
            scatter.set_edgecolor([colour for _ in mine])
        front = sorted((p for p in points if p.front), key=lambda p: p.x)
        axes.plot([p.x for p in front], [p.y for p in front], "ko-", markersize=5, label="Pareto front")
        for p in front:
            if p.tag:
                axes.annotate(p.tag, (p.x, p.y), textcoords="offset points", xytext=(5, 5), fontsize=7)
        if sla is not None:
            axes.axvline(sla.x, color="#c00", linestyle="--", label=sla.label)
        axes.set(xscale="log", yscale="log", xlabel="tokens/s per user", ylabel="tokens/s per device")
        xs = [p.x for p in points] + ([sla.x] if sla else [])
        for which, values in (("x", xs), ("y", [p.y for p in points])):
            axis = _LogAxis(values, 0.0, 1.0)  # the SVG's range and ticks, not matplotlib's decades
            getattr(axes, f"set_{which}lim")(10**axis.lo, 10**axis.hi)
            getattr(axes, f"set_{which}ticks")(axis.ticks(), [_tick(v) for v in axis.ticks()])
            getattr(axes, f"{which}axis").set_minor_locator(NullLocator())
        axes.set_title(title)
        axes.grid(True, which="both", color="#eee")
        axes.legend(loc="best", fontsize=8)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
        return buffer.getvalue()
    finally:
        pyplot.close(figure)
