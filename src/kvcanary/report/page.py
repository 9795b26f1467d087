"""``kvcanary report --html``: the one-page HTML report of a violation log's summary, with pictures
of the violations over time (or steps) and over the slot space, drawn as inline SVG.
"""

from __future__ import annotations

import collections
import html
from typing import Any

from kvcanary.report.summary import Summary, headline, tables, when

_COLORS = ["#d62728", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _axis(s: Summary) -> tuple[list[float], str, Any]:
    """Where each slot record lies in time: wall-clock seconds where every record has a time (the
    only order across processes), else its step; the axis's name and how to label a value."""
    if s.points and all(p[3] is not None for p in s.points):
        t0 = min(p[3] for p in s.points if p[3] is not None)
        return [float(p[3]) - t0 for p in s.points if p[3] is not None], "time", lambda v: when(t0 + v)
    return [float(p[0]) for p in s.points], "step", lambda v: f"step {int(v)}"


def _bins(lo: float, hi: float, most: int, integral: bool) -> int:
    return max(1, min(most, int(hi - lo) + 1)) if integral else (most if hi > lo else 1)


def _timeline_svg(s: Summary, w: int = 900, h: int = 220) -> str:
    """Slot records over time (or steps, where the log has no times), stacked by kind."""
    if not s.points:
        return "<p>No violations.</p>"
    names = [k.name for k in s.kinds]
    xs, axis, label = _axis(s)
    lo, hi = min(xs), max(xs)
    nb = _bins(lo, hi, 120, axis == "step")
    width = (hi - lo + (1 if axis == "step" else 0)) / nb or 1.0
    counts = [[0] * len(names) for _ in range(nb)]
    for x, p in zip(xs, s.points):
        counts[min(nb - 1, int((x - lo) / width))][names.index(p[2])] += 1
    top = max(sum(c) for c in counts) or 1
    bw = (w - 60) / nb
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
           f'aria-label="violations over {axis}">']
    for i, c in enumerate(counts):
        y = float(h - 30)
        for j, v in enumerate(c):
            if not v:
                continue
            bh = (h - 50) * v / top
            y -= bh
            out.append(f'<rect x="{50 + i * bw:.1f}" y="{y:.1f}" width="{max(bw - 1, 1):.1f}" height="{bh:.1f}" '
                       f'fill="{_COLORS[j % len(_COLORS)]}"><title>{html.escape(label(lo + i * width))}: {v} '
                       f'{html.escape(names[j])}</title></rect>')
    out.append(f'<text x="50" y="{h - 10}" font-size="12">{html.escape(label(lo))}</text>'
               f'<text x="{w - 10}" y="{h - 10}" font-size="12" text-anchor="end">{html.escape(label(hi))}</text>'
               f'<text x="5" y="20" font-size="12">{top} records</text></svg>')
    return "".join(out)


def _heatmap_svg(s: Summary, w: int = 900, h: int = 300) -> str:
    """Slot records over the slot space (x) and time or steps (y), darker where more."""
    xs, axis, label = _axis(s)
    pts = [(x, p[1]) for x, p in zip(xs, s.points) if p[1] >= 0]
    if not pts:
        return "<p>No slot records.</p>"
    s_lo, s_hi = min(p[1] for p in pts), max(p[1] for p in pts)
    t_lo, t_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    nx, ny = min(90, s_hi - s_lo + 1), _bins(t_lo, t_hi, 30, axis == "step")
    t_w = (t_hi - t_lo + (1 if axis == "step" else 0)) / ny or 1.0
    grid = collections.Counter((min(nx - 1, (p[1] - s_lo) * nx // (s_hi - s_lo + 1)),
                                min(ny - 1, int((p[0] - t_lo) / t_w))) for p in pts)
    top = max(grid.values())
    cw, ch = (w - 60) / nx, (h - 40) / ny
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
           f'aria-label="violations over the slot space">']
    for (x, y), v in grid.items():
        a = 0.15 + 0.85 * v / top
        out.append(f'<rect x="{50 + x * cw:.1f}" y="{10 + y * ch:.1f}" width="{cw:.1f}" height="{ch:.1f}" '
                   f'fill="#d62728" fill-opacity="{a:.2f}"><title>slots ~{s_lo + x * (s_hi - s_lo + 1) // nx}, '
                   f'{html.escape(label(t_lo + y * t_w))}: {v} records</title></rect>')
    out.append(f'<text x="50" y="{h - 10}" font-size="12">slot {s_lo}</text>'
               f'<text x="{w - 10}" y="{h - 10}" font-size="12" text-anchor="end">slot {s_hi}</text>'
               f'<text x="5" y="20" font-size="12">{html.escape(label(t_lo))}</text>'
               f'<text x="5" y="{h - 30}" font-size="12">{html.escape(label(t_hi))}</text></svg>')
    return "".join(out)


def html_page(s: Summary, path: str) -> str:
    """The one-page report: headline, a timeline, a heat map over the slot space, the tables."""
    names = [k.name for k in s.kinds]
    legend = " ".join(f'<span style="color:{_COLORS[i % len(_COLORS)]}">&#9632;</span> {html.escape(n)}'
                      for i, n in enumerate(names))
    parts = []
    for title, (head, rows, note) in tables(s).items():
        if not rows and not note:
            continue
        th = "".join(f"<th>{html.escape(x)}</th>" for x in head)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        table = f"<table><tr>{th}</tr>{trs}</table>" if rows else ""
        parts.append(f"<h2>{html.escape(title)}</h2>{table}" + (f"<p>{html.escape(note)}</p>" if note else ""))
    axis = _axis(s)[1] if s.points else "time"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvcanary report: {html.escape(path)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1000px}} table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left;vertical-align:top}}
h1{{font-size:20px}} h2{{font-size:16px;margin-top:1.5em}} .head{{font-size:15px}}</style></head>
<body><h1>kvcanary report: {html.escape(path)}</h1>
<p class="head">{html.escape(headline(s))}</p>
<h2>Violations over {"time (UTC)" if axis == "time" else "steps"}</h2><p>{legend}</p>{_timeline_svg(s)}
<h2>Violations over the slot space</h2>{_heatmap_svg(s)}
{''.join(parts)}
</body></html>
"""
