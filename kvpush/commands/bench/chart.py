"""Charts of scenario results: ``line_chart`` draws ``Panel``s of ``Series`` as one small,
self-contained SVG document (no plotting dependency).

A pure function: the scenario writes the returned text next to its JSON. Runs in the
orchestrator process, on the thread that runs the scenario.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]
    color: str = ""
    style: str = "line"  # "line" (with markers), "trace" (dense: no markers) or "dots"
    dash: bool = False


@dataclass
class Panel:
    title: str
    series: list[Series]
    xlabel: str
    ylabel: str
    logx: bool = False
    logy: bool = False
    spans: list[tuple[float, float, str]] = field(default_factory=list)  # shaded x ranges
    hlines: list[tuple[float, str]] = field(default_factory=list)
    marks: list[float] = field(default_factory=list)  # x positions of host stalls (red ticks)
    marks_label: str = "red ticks: host stalls (a 5 ms timer in the bench woke > 20 ms late)"
    xticks: list[tuple[float, str]] | None = None


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    start = math.ceil(lo / step) * step
    ticks = []
    x = start
    while x <= hi + step * 1e-9:
        ticks.append(round(x, 10))
        x += step
    return ticks


def _log_ticks(lo: float, hi: float) -> list[float]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    return [10.0**k for k in range(a, b + 1)]


def _tick_label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e6 or abs(v) < 1e-3:
        return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:g}"


def line_chart(panels: Sequence[Panel], title: str, width: int = 900, panel_h: int = 260) -> str:
    """A stack of panels sharing a width; returns SVG text."""
    ml, mr, mt, mb = 70, 170, 30, 45
    top = 34
    h = top + len(panels) * (panel_h + mt + mb)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
        f'viewBox="0 0 {width} {h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{h}" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="15" '
        f'font-weight="bold">{html.escape(title)}</text>',
    ]
    for pi, p in enumerate(panels):
        y0 = top + pi * (panel_h + mt + mb) + mt
        parts.extend(_panel(p, ml, y0, width - ml - mr, panel_h, pi))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


@dataclass(frozen=True)
class _Frame:
    """One panel's box on the page and its value ranges: where a value is drawn."""

    p: Panel
    x0: float
    y0: float
    w: float
    h: float
    xlo: float
    xhi: float
    ylo: float
    yhi: float

    def sx(self, x: float) -> float:
        if self.p.logx:
            lo, hi = math.log10(self.xlo), math.log10(self.xhi)
            return self.x0 + (math.log10(x) - lo) / (hi - lo) * self.w
        return self.x0 + (x - self.xlo) / (self.xhi - self.xlo) * self.w

    def sy(self, y: float) -> float:
        if self.p.logy:
            lo, hi = math.log10(self.ylo), math.log10(self.yhi)
            return self.y0 + self.h - (math.log10(max(y, self.ylo)) - lo) / (hi - lo) * self.h
        return self.y0 + self.h - (y - self.ylo) / (self.yhi - self.ylo) * self.h


def _frame(p: Panel, x0: float, y0: float, w: float, h: float) -> _Frame:
    """The panel's ranges: every point, span and line in view, with a little room."""
    pts = [pt for s in p.series for pt in s.points if _ok(pt, p)] or [(1.0, 1.0), (10.0, 10.0)]
    xs = [x for x, _ in pts] + [a for a, _, _ in p.spans] + [b for _, b, _ in p.spans]
    ys = [y for _, y in pts] + [y for y, _ in p.hlines]
    xlo, xhi, ylo, yhi = min(xs), max(xs), min(ys), max(ys)
    if p.logy:
        ylo, yhi = 10 ** math.floor(math.log10(ylo)), 10 ** math.ceil(math.log10(yhi))
    else:
        ylo, yhi = min(0.0, ylo), (yhi * 1.08 if yhi > 0 else 1.0)
    if p.logx:
        xlo, xhi = xlo / 1.3, xhi * 1.3
    elif xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1
    return _Frame(p, x0, y0, w, h, xlo, xhi, ylo, yhi)


def _panel(p: Panel, x0: float, y0: float, w: float, h: float, idx: int) -> list[str]:
    f = _frame(p, x0, y0, w, h)
    clip = f"clip{idx}"
    out = [
        f'<text x="{x0}" y="{y0 - 10}" font-size="13" font-weight="bold">'
        f"{html.escape(p.title)}</text>",
        f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#444"/>',
        f'<clipPath id="{clip}"><rect x="{x0}" y="{y0}" width="{w}" height="{h}"/></clipPath>',
    ]
    out += _spans(f)
    out += _grid(f)
    out += _marks(f)
    out += _hlines(f)
    out.append(
        f'<text x="{x0 + w / 2}" y="{y0 + h + 34}" text-anchor="middle">'
        f"{html.escape(p.xlabel)}</text>"
    )
    out.append(
        f'<text x="{x0 - 52}" y="{y0 + h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 {x0 - 52} {y0 + h / 2})">{html.escape(p.ylabel)}</text>'
    )
    for si, s in enumerate(p.series):
        out += _series(f, s, si, clip)
    return out


def _spans(f: _Frame) -> list[str]:
    out = []
    for a, b, label in f.p.spans:
        out.append(
            f'<rect x="{f.sx(a):.1f}" y="{f.y0}" width="{max(1.0, f.sx(b) - f.sx(a)):.1f}" '
            f'height="{f.h}" fill="#f4c542" fill-opacity="0.25"/>'
        )
        out.append(
            f'<text x="{f.sx(a) + 3:.1f}" y="{f.y0 + 14}" font-size="11" fill="#8a6d00">'
            f"{html.escape(label)}</text>"
        )
    return out


def _grid(f: _Frame) -> list[str]:
    """The y grid with its labels, then the x grid with its labels."""
    p, out = f.p, []
    yt = _log_ticks(f.ylo, f.yhi) if p.logy else _nice_ticks(f.ylo, f.yhi)
    for v in (v for v in yt if f.ylo <= v <= f.yhi):
        y = f.sy(v)
        line = (f"{f.x0}", f"{f.x0 + f.w}", f"{y:.1f}", f"{y:.1f}", "#ddd")
        out += _grid_line(line, (f"{f.x0 - 6}", f"{y + 4:.1f}", "end"), _tick_label(v))
    xt = p.xticks or [
        (v, _tick_label(v))
        for v in (_log_ticks(f.xlo, f.xhi) if p.logx else _nice_ticks(f.xlo, f.xhi))
    ]
    for v, label in ((v, label) for v, label in xt if f.xlo <= v <= f.xhi):
        x = f"{f.sx(v):.1f}"
        line = (x, x, f"{f.y0}", f"{f.y0 + f.h}", "#eee")
        out += _grid_line(line, (x, f"{f.y0 + f.h + 16}", "middle"), label)
    return out


def _grid_line(
    line: tuple[str, str, str, str, str], text: tuple[str, str, str], label: str
) -> list[str]:
    """One grid line (``x1, x2, y1, y2, stroke``) and its tick label (``x, y, text-anchor``)."""
    x1, x2, y1, y2, stroke = line
    tx, ty, anchor = text
    return [
        f'<line x1="{x1}" x2="{x2}" y1="{y1}" y2="{y2}" stroke="{stroke}"/>',
        f'<text x="{tx}" y="{ty}" text-anchor="{anchor}">{html.escape(label)}</text>',
    ]


def _marks(f: _Frame) -> list[str]:
    p, out = f.p, []
    for xm in (xm for xm in p.marks if f.xlo <= xm <= f.xhi):
        out.append(
            f'<line x1="{f.sx(xm):.1f}" x2="{f.sx(xm):.1f}" y1="{f.y0 + f.h - 14}" '
            f'y2="{f.y0 + f.h}" stroke="#d00" stroke-width="2"/>'
        )
    if p.marks:
        out.append(
            f'<text x="{f.x0 + 4}" y="{f.y0 + f.h - 18}" font-size="10" fill="#d00">'
            f"{html.escape(p.marks_label)}</text>"
        )
    return out


def _hlines(f: _Frame) -> list[str]:
    out = []
    for yv, label in f.p.hlines:
        y = f.sy(yv)
        out.append(
            f'<line x1="{f.x0}" x2="{f.x0 + f.w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#888" '
            'stroke-dasharray="4 3"/>'
        )
        out.append(
            f'<text x="{f.x0 + f.w - 4}" y="{y - 4:.1f}" text-anchor="end" fill="#666" '
            f'font-size="11">{html.escape(label)}</text>'
        )
    return out


def _series(f: _Frame, s: Series, si: int, clip: str) -> list[str]:
    """One series, clipped to the panel, and its legend entry."""
    color = s.color or PALETTE[si % len(PALETTE)]
    spts = [(f.sx(x), f.sy(y)) for x, y in s.points if _ok((x, y), f.p)]
    g = [f'<g clip-path="url(#{clip})">']
    if s.style == "dots":
        r = "1.6" if len(spts) > 50 else "3.5"
        g.extend(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{color}" fill-opacity="0.7"/>'
            for x, y in spts
        )
    elif spts:
        d = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(spts))
        dash = ' stroke-dasharray="6 4"' if s.dash else ""
        sw = "2" if s.style == "line" else "1"
        g.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{sw}"{dash}/>')
        if s.style == "line":
            g.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in spts)
    g.append("</g>")
    ly, lx = f.y0 + 12 + si * 18, f.x0 + f.w + 12
    g.append(f'<rect x="{lx}" y="{ly - 9}" width="12" height="12" fill="{color}"/>')
    g.append(f'<text x="{lx + 18}" y="{ly + 1}">{html.escape(s.name)}</text>')
    return g


def _ok(pt: tuple[float, float], p: Panel) -> bool:
    x, y = pt
    if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
        return False
    if p.logx and x <= 0:
        return False
    return not (p.logy and y <= 0)
