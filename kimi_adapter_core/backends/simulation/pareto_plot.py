"""Write a sweep's throughput plot: every fitting configuration, the Pareto front highlighted.

Chosen by the file suffix: ``.svg`` and ``.html`` are written by hand (a self-contained SVG, in an
HTML page for ``.html``; no scripts, fonts or other network assets, so it opens offline and can be
attached to a report); ``.png`` needs matplotlib, which kadapt does not depend on. Both axes are
logarithmic: throughputs of one sweep span orders of magnitude. Every point carries a tooltip
(``<title>``) naming its layout. Written atomically.
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...atomic import atomic_write_bytes, atomic_write_text
from ...errors import KadaptError, UsageError

SUFFIXES = (".svg", ".html", ".htm", ".png")
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_W, _H = 860, 540
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 180, 50, 60


@dataclass(frozen=True)
class PlotPoint:
    x: float  # tokens/s per user
    y: float  # tokens/s per device
    series: str  # one colour per series (the weight mode)
    label: str  # tooltip
    front: bool


def write_plot(path: Path, points: Sequence[PlotPoint], title: str) -> None:
    """Write ``points`` to ``path`` in the format its suffix names."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UsageError(f"--plot {path}: the suffix must be one of {', '.join(SUFFIXES)}")
    if not points:
        raise KadaptError(f"no configuration fits in memory: nothing to plot in {path}")
    if suffix == ".png":
        atomic_write_bytes(path, _png(points, title))
        return
    svg = svg_plot(points, title)
    if suffix == ".svg":
        atomic_write_text(path, svg)
    else:
        page = (
            f'<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>{html.escape(title)}'
            f"</title></head>\n<body>\n{svg}\n</body>\n</html>\n"
        )
        atomic_write_text(path, page)


class _LogAxis:
    """Maps a positive value to a pixel on a log10 axis spanning whole decades around the data."""

    def __init__(self, values: Sequence[float], start: float, end: float) -> None:
        self.lo = math.floor(math.log10(min(values)))
        self.hi = max(self.lo + 1, math.ceil(math.log10(max(values))))
        self.start, self.end = start, end

    def __call__(self, value: float) -> float:
        return self.start + (math.log10(value) - self.lo) / (self.hi - self.lo) * (self.end - self.start)

    def ticks(self) -> list[float]:
        return [10.0**e for e in range(self.lo, self.hi + 1)]


def _tick(value: float) -> str:
    return f"{value:g}" if 1e-3 <= value < 1e6 else f"1e{round(math.log10(value))}"


def svg_plot(points: Sequence[PlotPoint], title: str) -> str:
    """The plot as one self-contained ``<svg>`` element."""
    x = _LogAxis([p.x for p in points], _LEFT, _W - _RIGHT)
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
    front = sorted((p for p in points if p.front), key=lambda p: p.x)
    if len(front) > 1:
        path = " ".join(f"{x(p.x):.1f},{y(p.y):.1f}" for p in front)
        out.append(f'<polyline points="{path}" fill="none" stroke="black" stroke-width="1.5"/>')
    for p in sorted(points, key=lambda p: p.front):  # front points drawn last, on top
        radius, stroke = (5, ' stroke="black" stroke-width="1.5"') if p.front else (3, "")
        out.append(
            f'<circle cx="{x(p.x):.1f}" cy="{y(p.y):.1f}" r="{radius}" fill="{colour[p.series]}" '
            f'fill-opacity="{1 if p.front else 0.45}"{stroke}><title>{html.escape(p.label)}</title></circle>'
        )
    for i, name in enumerate(series):
        ly = _TOP + 10 + 20 * i
        out.append(f'<circle cx="{_W - _RIGHT + 20}" cy="{ly}" r="5" fill="{colour[name]}"/>')
        out.append(f'<text x="{_W - _RIGHT + 32}" y="{ly + 4}">{html.escape(name)}</text>')
    ly = _TOP + 10 + 20 * len(series)
    out.append(f'<line x1="{_W - _RIGHT + 14}" y1="{ly}" x2="{_W - _RIGHT + 26}" y2="{ly}" stroke="black"/>')
    out.append(f'<text x="{_W - _RIGHT + 32}" y="{ly + 4}">Pareto front</text>')
    out.append("</svg>")
    return "\n".join(out)


def _png(points: Sequence[PlotPoint], title: str) -> bytes:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as exc:
        raise KadaptError(
            "a .png plot needs matplotlib, which is not installed; write .html or .svg instead"
        ) from exc
    figure, axes = pyplot.subplots(figsize=(8.6, 5.4))
    try:
        for name in dict.fromkeys(p.series for p in points):
            mine = [p for p in points if p.series == name]
            axes.scatter([p.x for p in mine], [p.y for p in mine], s=12, alpha=0.45, label=name)
        front = sorted((p for p in points if p.front), key=lambda p: p.x)
        axes.plot([p.x for p in front], [p.y for p in front], "ko-", markersize=5, label="Pareto front")
        axes.set(xscale="log", yscale="log", xlabel="tokens/s per user", ylabel="tokens/s per device")
        axes.set_title(title)
        axes.grid(True, which="major", color="#ddd")
        axes.legend(loc="best", fontsize=8)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
        return buffer.getvalue()
    finally:
        pyplot.close(figure)
