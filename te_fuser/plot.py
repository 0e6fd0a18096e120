"""Line charts as SVG, with no plotting library: the reports' loss curves.

``line_chart(path, series, ...)`` writes a self-contained SVG file (text, so it
diffs, and renders in a browser or a README). When matplotlib is importable,
``line_chart(..., png=True)`` also writes a PNG beside it through matplotlib;
without it, it says so in its return value instead of failing silently.
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Sequence

__all__ = ["line_chart"]

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 860, 440, 70, 180, 56, 48


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (m * step) <= n:
            step *= m
            break
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def line_chart(path: str | Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], *, title: str,
               subtitle: str = "", xlabel: str = "", ylabel: str = "",
               markers: Sequence[tuple[float, str]] = (), png: bool = False) -> list[str]:
    """Write ``series`` (name -> (xs, ys)) as an SVG line chart at ``path`` (``.svg``);
    ``markers`` are labelled vertical lines (phase boundaries). Returns the files
    written, and a note when a PNG was asked for but matplotlib is missing."""
    path = Path(path)
    points = [(x, y) for xs, ys in series.values() for x, y in zip(xs, ys) if math.isfinite(y)]
    if not points:
        raise ValueError("line_chart: no finite points to plot")
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    x1 = x1 if x1 > x0 else x0 + 1
    pw, ph = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def sx(x):
        return _LEFT + (x - x0) / (x1 - x0) * pw

    def sy(y):
        return _TOP + (1 - (y - y0) / (y1 - y0)) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{_LEFT}" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
           f'<text x="{_LEFT}" y="40" fill="#555">{escape(subtitle)}</text>',
           f'<rect x="{_LEFT}" y="{_TOP}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{_LEFT}" x2="{_LEFT + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
                   f'<text x="{_LEFT - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{_TOP + ph + 16}" text-anchor="middle">{_fmt(t)}</text>')
    for x, label in markers:
        out.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{_TOP}" y2="{_TOP + ph}" stroke="#bbb" '
                   f'stroke-dasharray="4 3"/><text x="{sx(x) + 3:.1f}" y="{_TOP + 12}" fill="#777">'
                   f'{escape(label)}</text>')
    for i, (name, (xs, ys)) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys) if math.isfinite(y))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>')
        ly = _TOP + 14 + 18 * i
        out.append(f'<line x1="{_W - _RIGHT + 12}" x2="{_W - _RIGHT + 32}" y1="{ly - 4}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="2"/><text x="{_W - _RIGHT + 38}" y="{ly}">{escape(name)}</text>')
    out.append(f'<text x="{_LEFT + pw / 2}" y="{_H - 8}" text-anchor="middle">{escape(xlabel)}</text>')
    out.append(f'<text transform="translate(16,{_TOP + ph / 2}) rotate(-90)" text-anchor="middle">'
               f'{escape(ylabel)}</text></svg>')
    path.write_text("\n".join(out) + "\n")
    written = [str(path)]
    if png:
        written.append(_png(path.with_suffix(".png"), series, title, subtitle, xlabel, ylabel, markers))
    return written


def _png(path: Path, series, title, subtitle, xlabel, ylabel, markers) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(no PNG: matplotlib is not installed; the SVG has the same chart)"
    fig, ax = plt.subplots(figsize=(8.6, 4.4))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, label=name, linewidth=1.2)
    for x, label in markers:
        ax.axvline(x, color="#bbb", linestyle="--", linewidth=0.8)
        ax.text(x, ax.get_ylim()[1], f" {label}", va="top", color="#777", fontsize=8)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(f"{title}\n{subtitle}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
