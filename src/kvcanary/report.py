"""``kvcanary report``: a JSONL violation log (:mod:`kvcanary.eventlog`) read back as a summary a
person can act on, and as a one-page HTML report with pictures of the violations over steps and
over the slot space.

The summary says, per kind of failure (the diagnosed bug class, the failed checks and the site),
how many events and slots,
which requests were hurt, the first and last step; then the requests to retry, the slots and
layer groups hit most, and the processes and ranks that reported. ``rich`` renders the tables when
it is installed; plain text otherwise.
"""

from __future__ import annotations

import collections
import html
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

from kvcanary.errors import EventLogError
from kvcanary.eventlog import read


@dataclass
class Kind:
    """One kind of failure: the failed checks of events at one site."""

    site: str
    checks: tuple[str, ...]
    diagnosis: str = ""  # the most likely bug class (kvcanary.diagnosis), where the reporter diagnosed it
    events: int = 0
    slots: set[int] = field(default_factory=set)
    requests: set[str] = field(default_factory=set)
    first_step: int | None = None
    last_step: int | None = None
    first_summary: str = ""

    @property
    def name(self) -> str:
        what = f"{self.site}: {'|'.join(self.checks)}"
        return f"{self.diagnosis} ({what})" if self.diagnosis else what


@dataclass
class Summary:
    """What a violation log holds, aggregated."""

    events: int
    records: int
    kinds: list[Kind]
    requests: collections.Counter[str]
    slots: collections.Counter[int]
    groups: collections.Counter[str]
    sources: collections.Counter[str]  # engine, rank and pid of the reporting process
    first_time: float | None
    last_time: float | None
    points: list[tuple[int, int, str]]  # (step, slot, kind name) of every per-slot record


def summarize(events: Iterable[dict[str, Any]]) -> Summary:
    """Aggregate events as :func:`kvcanary.eventlog.read` returns them."""
    kinds: dict[tuple[str, tuple[str, ...], str], Kind] = {}
    requests: collections.Counter[str] = collections.Counter()
    slots: collections.Counter[int] = collections.Counter()
    groups: collections.Counter[str] = collections.Counter()
    sources: collections.Counter[str] = collections.Counter()
    points: list[tuple[int, int, str]] = []
    times: list[float] = []
    n = records = 0
    for ev in events:
        n += 1
        diag = (ev.get("diagnosis") or {}).get("kind", "")
        key = (str(ev.get("site")), tuple(ev.get("checks") or ()), diag)
        k = kinds.setdefault(key, Kind(*key))
        k.events += 1
        step = int(ev.get("step", -1))
        k.first_step = step if k.first_step is None else min(k.first_step, step)
        k.last_step = step if k.last_step is None else max(k.last_step, step)
        k.first_summary = k.first_summary or str(ev.get("summary", ""))
        if ev.get("request"):
            k.requests.add(str(ev["request"]))
            requests[str(ev["request"])] += 1
        groups[str(ev.get("group"))] += 1
        sources[f"{ev.get('engine', '?')} rank {ev.get('rank', 0)} pid {ev.get('pid', '?')}"] += 1
        if "time" in ev:
            times.append(float(ev["time"]))
        for v in ev.get("violations") or ():
            records += 1
            s = int(v.get("slot", -1))
            k.slots.add(s)
            slots[s] += 1
            points.append((int(v.get("step", step)), s, k.name))
    order = sorted(kinds.values(), key=lambda k: (-k.events, k.name))
    return Summary(n, records, order, requests, slots, groups, sources, min(times, default=None),
                   max(times, default=None), points)


def _rows(s: Summary) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The summary's tables: title -> (header, rows)."""
    kinds = [[k.name, str(k.events), str(len(k.slots)), str(len(k.requests)), f"{k.first_step} .. {k.last_step}",
              k.first_summary[:240]] for k in s.kinds]
    return {
        "Violations by kind": (["kind", "events", "slots", "requests", "steps", "first event"], kinds),
        "Requests hurt (retry them)": (["request", "events"], [[r, str(c)] for r, c in s.requests.most_common(20)]),
        "Slots hit most": (["slot", "records"], [[str(sl), str(c)] for sl, c in s.slots.most_common(10)]),
        "Layer groups": (["group", "events"], [[g, str(c)] for g, c in s.groups.most_common()]),
        "Reported by": (["process", "events"], [[p, str(c)] for p, c in s.sources.most_common()]),
    }


def headline(s: Summary) -> str:
    """One line for the incident: what, how much, whom."""
    if not s.events:
        return "no violations in the log"
    worst = s.kinds[0]
    return (f"{s.events} violation event(s), {s.records} slot record(s), {len(s.kinds)} kind(s); most: {worst.name} "
            f"({worst.events} events); {len(s.requests)} request(s) hurt; steps "
            f"{min(k.first_step or 0 for k in s.kinds)} .. {max(k.last_step or 0 for k in s.kinds)}")


def print_summary(s: Summary, path: str) -> None:
    """The summary on the terminal (rich tables when rich is installed)."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # plain text
        print(f"{path}: {headline(s)}")
        for title, (head, rows) in _rows(s).items():
            print(f"\n{title}\n  " + " | ".join(head))
            for r in rows:
                print("  " + " | ".join(r))
        return
    con = Console(width=None if sys.stdout.isatty() else 160)  # a pipe or file: no wrapping at 80 columns
    con.print(Text(f"{path}: {headline(s)}", style="bold"))
    for title, (head, rows) in _rows(s).items():
        if not rows:
            continue
        con.print(Text(f"\n{title}", style="bold"))
        t = Table()
        for h in head:
            t.add_column(h, overflow="fold")
        for r in rows:
            t.add_row(*(Text(c) for c in r))  # Text: a record's "[verify step 3]" is not markup
        con.print(t)


# ---- the HTML page ---------------------------------------------------------------------------

_COLORS = ["#d62728", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _timeline_svg(s: Summary, w: int = 900, h: int = 220) -> str:
    """Slot records per step, stacked by kind."""
    if not s.points:
        return "<p>No violations.</p>"
    names = [k.name for k in s.kinds]
    lo, hi = min(p[0] for p in s.points), max(p[0] for p in s.points)
    nb = min(120, hi - lo + 1)
    width = (hi - lo + 1) / nb
    counts = [[0] * len(names) for _ in range(nb)]
    for step, _, kind in s.points:
        counts[min(nb - 1, int((step - lo) / width))][names.index(kind)] += 1
    top = max(sum(c) for c in counts) or 1
    bw = (w - 60) / nb
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
           f'aria-label="violations over steps">']
    for i, c in enumerate(counts):
        y = float(h - 30)
        for j, v in enumerate(c):
            if not v:
                continue
            bh = (h - 50) * v / top
            y -= bh
            out.append(f'<rect x="{50 + i * bw:.1f}" y="{y:.1f}" width="{max(bw - 1, 1):.1f}" height="{bh:.1f}" '
                       f'fill="{_COLORS[j % len(_COLORS)]}"><title>steps {lo + int(i * width)}: {v} {names[j]}'
                       f'</title></rect>')
    out.append(f'<text x="50" y="{h - 10}" font-size="12">step {lo}</text>'
               f'<text x="{w - 10}" y="{h - 10}" font-size="12" text-anchor="end">step {hi}</text>'
               f'<text x="5" y="20" font-size="12">{top} records</text></svg>')
    return "".join(out)


def _heatmap_svg(s: Summary, w: int = 900, h: int = 300) -> str:
    """Slot records over the slot space (x) and steps (y), darker where more."""
    pts = [p for p in s.points if p[1] >= 0]
    if not pts:
        return "<p>No slot records.</p>"
    s_lo, s_hi = min(p[1] for p in pts), max(p[1] for p in pts)
    t_lo, t_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    nx, ny = min(90, s_hi - s_lo + 1), min(30, t_hi - t_lo + 1)
    grid = collections.Counter((min(nx - 1, (p[1] - s_lo) * nx // (s_hi - s_lo + 1)),
                                min(ny - 1, (p[0] - t_lo) * ny // (t_hi - t_lo + 1))) for p in pts)
    top = max(grid.values())
    cw, ch = (w - 60) / nx, (h - 40) / ny
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
           f'aria-label="violations over the slot space">']
    for (x, y), v in grid.items():
        a = 0.15 + 0.85 * v / top
        out.append(f'<rect x="{50 + x * cw:.1f}" y="{10 + y * ch:.1f}" width="{cw:.1f}" height="{ch:.1f}" '
                   f'fill="#d62728" fill-opacity="{a:.2f}"><title>slots ~{s_lo + x * (s_hi - s_lo + 1) // nx}, '
                   f'steps ~{t_lo + y * (t_hi - t_lo + 1) // ny}: {v} records</title></rect>')
    out.append(f'<text x="50" y="{h - 10}" font-size="12">slot {s_lo}</text>'
               f'<text x="{w - 10}" y="{h - 10}" font-size="12" text-anchor="end">slot {s_hi}</text>'
               f'<text x="5" y="20" font-size="12">step {t_lo}</text>'
               f'<text x="5" y="{h - 30}" font-size="12">step {t_hi}</text></svg>')
    return "".join(out)


def html_page(s: Summary, path: str) -> str:
    """The one-page report: headline, a timeline, a heat map over the slot space, the tables."""
    names = [k.name for k in s.kinds]
    legend = " ".join(f'<span style="color:{_COLORS[i % len(_COLORS)]}">&#9632;</span> {html.escape(n)}'
                      for i, n in enumerate(names))
    tables = []
    for title, (head, rows) in _rows(s).items():
        if not rows:
            continue
        th = "".join(f"<th>{html.escape(x)}</th>" for x in head)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        tables.append(f"<h2>{html.escape(title)}</h2><table><tr>{th}</tr>{trs}</table>")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvcanary report: {html.escape(path)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1000px}} table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left;vertical-align:top}}
h1{{font-size:20px}} h2{{font-size:16px;margin-top:1.5em}} .head{{font-size:15px}}</style></head>
<body><h1>kvcanary report: {html.escape(path)}</h1>
<p class="head">{html.escape(headline(s))}</p>
<h2>Violations over steps</h2><p>{legend}</p>{_timeline_svg(s)}
<h2>Violations over the slot space</h2>{_heatmap_svg(s)}
{''.join(tables)}
</body></html>
"""


def main(path: str, html_out: str | None = None, as_json: bool = False) -> int:
    """``kvcanary report``: 0 when the log has no violations, 1 when it has, 2 when it cannot be
    read or the page cannot be written (said on stderr before anything is printed)."""
    unwritable = html_out and _unwritable(html_out)
    if unwritable:
        print(f"kvcanary report: --html {html_out}: {unwritable}", file=sys.stderr)
        return 2
    try:
        evs = read(path)
    except EventLogError as e:
        print(f"kvcanary report: cannot read {path!r} as a JSONL violation log: line {e.line}: {e.reason}",
              file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as e:
        print(f"kvcanary report: cannot read {path!r} as a JSONL violation log: {e}", file=sys.stderr)
        return 2
    s = summarize(evs)
    if as_json:
        print(json.dumps({"headline": headline(s), "events": s.events, "records": s.records,
                          "kinds": [{"kind": k.name, "events": k.events, "slots": len(k.slots),
                                     "requests": sorted(k.requests), "first_step": k.first_step,
                                     "last_step": k.last_step} for k in s.kinds],
                          "requests": dict(s.requests.most_common())}))
    else:
        print_summary(s, path)
    if html_out:
        try:
            with open(html_out, "w", encoding="utf-8") as f:
                f.write(html_page(s, path))
        except OSError as e:  # checked above; the disk may still fill up
            print(f"kvcanary report: --html {html_out}: cannot write the page ({e})", file=sys.stderr)
            return 2
        if not as_json:
            print(f"wrote {html_out}")
    return 1 if s.events else 0


def _unwritable(out: str) -> str | None:
    """Why the page cannot be written to ``out`` ("expected X, got Y"), or ``None``."""
    where = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        return "expected a file to write the page to, got a directory"
    if not os.path.isdir(where):
        return f"expected an existing directory to write the page in, got {where!r}, which does not exist"
    if not os.access(where, os.W_OK):
        return f"expected a writable directory to write the page in, got {where!r}, which is not writable"
    return None
