"""The violation log's summary (:func:`summarize`): per kind of failure, the requests hurt, the
processes, the slots and groups hit most; its headline, its tables as the terminal shows them
(``rich`` where installed, plain text otherwise) and as one JSON object (:func:`as_dict`).
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

SKIPPED = 4  # the exit status bit for lines skipped
SHOWN = {"requests": 20, "slots": 10, "skipped": 10}  # rows of the tables that could run long


def when(t: float | None) -> str:
    """A wall-clock time as ``2026-01-02 10:11:12.345`` (UTC); ``-`` for none."""
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f".{int(round(t % 1 * 1000)) % 1000:03d}"


def lasting(seconds: float) -> str:
    """A duration in words: ``12.3 s``, ``4 min 2 s``, ``3 h 5 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


@dataclass
class Span:
    """The first and last step (per process) and wall-clock time of some events."""

    first_time: float | None = None
    last_time: float | None = None
    steps: dict[str, list[int]] = field(default_factory=dict)  # process -> [first step, last step]

    def add(self, source: str, step: int, t: float | None) -> None:
        lo_hi = self.steps.setdefault(source, [step, step])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], step), max(lo_hi[1], step)
        if t is not None:
            self.first_time = t if self.first_time is None else min(self.first_time, t)
            self.last_time = t if self.last_time is None else max(self.last_time, t)

    @property
    def first_step(self) -> int | None:
        return min((a for a, _ in self.steps.values()), default=None)

    @property
    def last_step(self) -> int | None:
        return max((b for _, b in self.steps.values()), default=None)

    def step_text(self, several: bool) -> str:
        """``12 .. 40``; with ``several`` processes in the log, each process's range named."""
        if not several:
            return f"{self.first_step} .. {self.last_step}"
        parts = [f"{a} .. {b} ({src})" for src, (a, b) in list(self.steps.items())[:3]]
        more = len(self.steps) - 3
        return "; ".join(parts) + (f"; +{more} more process(es)" if more > 0 else "")


@dataclass
class Kind(Span):
    """One kind of failure: the failed checks of events at one site."""

    site: str = ""
    checks: tuple[str, ...] = ()
    diagnosis: str = ""  # the most likely bug class (kvcanary.diagnosis), where the reporter diagnosed it
    events: int = 0
    slots: set[int] = field(default_factory=set)
    requests: set[str] = field(default_factory=set)
    first_summary: str = ""

    @property
    def name(self) -> str:
        what = f"{self.site}: {'|'.join(self.checks)}"
        return f"{self.diagnosis} ({what})" if self.diagnosis else what


@dataclass
class Hurt(Span):
    """One request that read corrupted KV: its events, when, and which processes reported it."""

    events: int = 0


@dataclass
class Summary:
    """What a violation log holds, aggregated, and what of it could not be read."""

    events: int
    records: int
    kinds: list[Kind]
    requests: collections.Counter[str]
    slots: collections.Counter[int]
    groups: collections.Counter[str]
    sources: collections.Counter[str]  # engine, rank, pid and host of the reporting process
    first_time: float | None
    last_time: float | None
    points: list[tuple[int, int, str, float | None]]  # (step, slot, kind name, time) of every per-slot record
    hurt: dict[str, Hurt] = field(default_factory=dict)  # by request id
    processes: dict[str, Span] = field(default_factory=dict)  # by reporting process
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line, what it holds) of lines not read
    lines: int = 0  # non-blank lines in the log
    cut: str | None = None  # a compressed log that ends early: why

    @property
    def several(self) -> bool:
        """Whether several processes reported (their step numbers are not comparable)."""
        return len(self.processes) > 1


def source_of(ev: dict[str, Any]) -> str:
    """The reporting process of an event: ``transformers rank 0 pid 4242 on node-7``."""
    where = f" on {ev['host']}" if ev.get("host") else ""
    return f"{ev.get('engine', '?')} rank {ev.get('rank', 0)} pid {ev.get('pid', '?')}{where}"


def summarize(events: Iterable[dict[str, Any]], skipped: Iterable[tuple[int, str]] = (), lines: int | None = None,
              cut: str | None = None) -> Summary:
    """Aggregate events as :func:`kvcanary.eventlog.read` (or :func:`~kvcanary.eventlog.scan`)
    returns them; ``skipped``, ``lines`` and ``cut``: what a scan could not read."""
    kinds: dict[tuple[str, tuple[str, ...], str], Kind] = {}
    requests: collections.Counter[str] = collections.Counter()
    slots: collections.Counter[int] = collections.Counter()
    groups: collections.Counter[str] = collections.Counter()
    sources: collections.Counter[str] = collections.Counter()
    hurt: dict[str, Hurt] = {}
    processes: dict[str, Span] = {}
    points: list[tuple[int, int, str, float | None]] = []
    times: list[float] = []
    n = records = 0
    for ev in events:
        n += 1
        diag = (ev.get("diagnosis") or {}).get("kind", "")
        key = (str(ev.get("site")), tuple(ev.get("checks") or ()), diag)
        k = kinds.setdefault(key, Kind(site=key[0], checks=key[1], diagnosis=key[2]))
        k.events += 1
        step = int(ev.get("step", -1))
        t = float(ev["time"]) if ev.get("time") is not None else None
        src = source_of(ev)
        k.add(src, step, t)
        processes.setdefault(src, Span()).add(src, step, t)
        k.first_summary = k.first_summary or str(ev.get("summary", ""))
        if ev.get("request"):
            rid = str(ev["request"])
            k.requests.add(rid)
            requests[rid] += 1
            h = hurt.setdefault(rid, Hurt())
            h.events += 1
            h.add(src, step, t)
        groups[str(ev.get("group"))] += 1
        sources[src] += 1
        if t is not None:
            times.append(t)
        for v in ev.get("violations") or ():
            records += 1
            sl = int(v.get("slot", -1))
            k.slots.add(sl)
            slots[sl] += 1
            points.append((int(v.get("step", step)), sl, k.name, t))
    order = sorted(kinds.values(), key=lambda k: (-k.events, k.name))
    bad = list(skipped)
    return Summary(n, records, order, requests, slots, groups, sources, min(times, default=None),
                   max(times, default=None), points, hurt, processes, bad, n + len(bad) if lines is None else lines,
                   cut)


def _more(total: int, shown: int, what: str) -> str:
    return f"... and {total - shown} more {what} (--json lists every one)" if total > shown else ""


def tables(s: Summary) -> dict[str, tuple[list[str], list[list[str]], str]]:
    """The summary's tables: title -> (header, rows, a note under the table: what was left out)."""
    kinds = [[k.name, str(k.events), str(len(k.slots)), str(len(k.requests)), when(k.first_time), when(k.last_time),
              k.step_text(s.several), k.first_summary[:240]] for k in s.kinds]
    top = s.requests.most_common(SHOWN["requests"])
    reqs = [[r, str(c), when(s.hurt[r].first_time), when(s.hurt[r].last_time),
             "; ".join(f"{src} step {a}" + (f" .. {b}" if b != a else "") for src, (a, b) in s.hurt[r].steps.items())]
            for r, c in top]
    slot_rows = [[str(sl), str(c)] for sl, c in s.slots.most_common(SHOWN["slots"])]
    procs = [[p, str(c), s.processes[p].step_text(False), when(s.processes[p].first_time),
              when(s.processes[p].last_time)] for p, c in s.sources.most_common()]
    bad = [[str(n), why] for n, why in s.skipped[: SHOWN["skipped"]]]
    return {
        "Violations by kind": (["kind", "events", "slots", "requests", "first seen (UTC)", "last seen (UTC)",
                                "steps" + (" (per process)" if s.several else ""), "first event"], kinds, ""),
        "Requests hurt (retry them)": (["request", "events", "first seen (UTC)", "last seen (UTC)",
                                        "reported by, at steps"], reqs,
                                       _more(len(s.requests), len(top), "request(s)")),
        "Slots hit most": (["slot", "records"], slot_rows, _more(len(s.slots), len(slot_rows), "slot(s)")),
        "Layer groups": (["group", "events"], [[g, str(c)] for g, c in s.groups.most_common()], ""),
        "Reported by": (["process", "events", "steps", "first seen (UTC)", "last seen (UTC)"], procs,
                        "step numbers count the forwards of one process and start again in each"
                        if s.several else ""),
        "Lines skipped (not violation events)": (["line", "what it holds"], bad,
                                                  _more(len(s.skipped), len(bad), "line(s)") or (s.cut or "")),
    }


def _lines_note(s: Summary, shown: int = 3) -> str:
    """``2 line(s) skipped (lines 5, 9)``: the lines of the log that are not violation events."""
    if not s.skipped and not s.cut:
        return ""
    nums = ", ".join(str(n) for n, _ in s.skipped[:shown]) + (", ..." if len(s.skipped) > shown else "")
    out = f"{len(s.skipped)} of {s.lines} line(s) skipped, not violation events" + (f" (line {nums})" if nums else "")
    return out + (f"; {s.cut}" if s.cut else "")


def headline(s: Summary) -> str:
    """One line for the incident: what, how much, whom, when."""
    note = _lines_note(s)
    if not s.events:
        return "no violations in the log" + (f" ({note})" if note else "")
    worst = s.kinds[0]
    out = (f"{s.events} violation event(s), {s.records} slot record(s), {len(s.kinds)} kind(s); most: {worst.name} "
           f"({worst.events} events); {len(s.requests)} request(s) hurt")
    if s.first_time is not None and s.last_time is not None:
        out += f"; {when(s.first_time)} .. {when(s.last_time)} UTC ({lasting(s.last_time - s.first_time)})"
    if s.several:
        out += f"; reported by {len(s.processes)} processes (steps count per process)"
    else:
        out += (f"; steps {min(k.first_step or 0 for k in s.kinds)} .. "
                f"{max(k.last_step or 0 for k in s.kinds)}")
    return out + (f"; {note}" if note else "")


def print_summary(s: Summary, path: str) -> None:
    """The summary on the terminal (rich tables when rich is installed)."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # plain text
        print(f"{path}: {headline(s)}")
        for title, (head, rows, note) in tables(s).items():
            if not rows and not note:
                continue
            print(f"\n{title}\n  " + " | ".join(head))
            for r in rows:
                print("  " + " | ".join(r))
            if note:
                print(f"  {note}")
        return
    con = Console(width=None if sys.stdout.isatty() else 160)  # a pipe or file: no wrapping at 80 columns
    con.print(Text(f"{path}: {headline(s)}", style="bold"))
    for title, (head, rows, note) in tables(s).items():
        if not rows and not note:
            continue
        con.print(Text(f"\n{title}", style="bold"))
        if rows:
            t = Table()
            for h in head:
                t.add_column(h, overflow="fold")
            for r in rows:
                t.add_row(*(Text(c) for c in r))  # Text: a record's "[verify step 3]" is not markup
            con.print(t)
        if note:
            con.print(Text(note))


def as_dict(s: Summary) -> dict[str, Any]:
    """The summary as one JSON object (``kvcanary report --json``): every request and skipped line."""
    def span(x: Span) -> dict[str, Any]:
        return {"first_time": x.first_time, "last_time": x.last_time, "first_seen": when(x.first_time),
                "last_seen": when(x.last_time), "first_step": x.first_step, "last_step": x.last_step,
                "steps_by_process": {src: list(ab) for src, ab in x.steps.items()}}

    return {"headline": headline(s), "events": s.events, "records": s.records,
            "first_time": s.first_time, "last_time": s.last_time, "first_seen": when(s.first_time),
            "last_seen": when(s.last_time), "times": "UTC",
            "kinds": [{"kind": k.name, "events": k.events, "slots": len(k.slots), "requests": sorted(k.requests),
                       **span(k)} for k in s.kinds],
            "requests": dict(s.requests.most_common()),
            "requests_hurt": [{"request": r, "events": c, **span(s.hurt[r])} for r, c in s.requests.most_common()],
            "processes": [{"process": p, "events": c, **span(s.processes[p])} for p, c in s.sources.most_common()],
            "lines": s.lines, "skipped_lines": len(s.skipped),
            "skipped": [{"line": n, "reason": why} for n, why in s.skipped], "cut": s.cut}
