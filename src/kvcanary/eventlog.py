"""The JSONL violation log: one line per violation event, one format for every engine and process.

Set ``CanaryConfig(violations_log=PATH)`` (``KVCANARY_VIOLATIONS_LOG``): every event a canary or an
engine adapter drains is appended to ``PATH`` as one JSON object. Each line is written with a
single ``write`` on a file opened for appending, so the workers of a multiprocess engine can share
one file. A line::

    {"time": 1764590000.123, "pid": 4242, "host": "node-7", "engine": "transformers", "rank": 0,
     "group": "full_attention", "site": "verify", "step": 12, "request": "req_3", "row": 1,
     "checks": ["CONTENT"], "slots": 1,
     "summary": "[verify step 12 ...] request req_3: 1 slot(s) failed CONTENT; first: ...",
     "violations": [{"site": "verify", "checks": ["CONTENT"], "slot": 40, "position": 5, ...}]}

``time`` is the wall-clock time of the drain (Unix seconds, UTC), ``host`` and ``pid`` the process:
``step`` counts the forwards of one canary and starts again in every process, so only ``time``
orders the events of several processes.

:func:`read` gives the lines back as dicts and refuses a file with a line that is not an event;
:func:`scan` reads what it can of a damaged one (a crash leaves a torn last line, or NUL bytes
where a write was lost): every good event, and every other line by number with what it holds.
Both read gzip-compressed logs (rotated ones) and accept a UTF-8 byte-order mark.
"""

from __future__ import annotations

import json
import os
import socket
import time
import zlib
from dataclasses import dataclass, field
from typing import IO, Any, Iterable, Iterator

from kvcanary.errors import EventLogError
from kvcanary.violations import Check, Event


def record(ev: Event, **context: Any) -> dict[str, Any]:
    """One event as the log's JSON object; ``context`` (engine, rank, ...) is merged in."""
    return {
        "time": round(time.time(), 3),
        "pid": os.getpid(),
        "host": _host(),
        **context,
        "group": ev.group,
        "site": ev.site.name.lower(),
        "step": ev.step,
        "request": ev.request,
        "row": ev.row,
        "checks": [c.name for c in Check if c in ev.checks],
        "slots": ev.slots,
        "summary": ev.describe(),
        "diagnosis": ev.diagnosis.to_dict() if ev.diagnosis is not None else None,
        "violations": [v.to_dict() for v in ev.violations],
    }


def append(path: str, events: Iterable[Event], **context: Any) -> int:
    """Append ``events`` to the log at ``path``, one line each; returns the lines written."""
    lines = [json.dumps(record(ev, **context), separators=(",", ":")) + "\n" for ev in events]
    if not lines:
        return 0
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for line in lines:
            data = line.encode()
            while data:  # a short write (a signal, a nearly full disk) goes on with the rest
                data = data[os.write(fd, data):]
    finally:
        os.close(fd)
    return len(lines)


_hostname: list[str] = []


def _host() -> str:
    if not _hostname:
        _hostname.append(socket.gethostname())
    return _hostname[0]


@dataclass
class Scan:
    """What :func:`scan` read of a log: the events, in order, and what it could not read."""

    events: list[dict[str, Any]] = field(default_factory=list)
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line number from 1, what it holds)
    lines: int = 0  # lines that are not blank
    salvaged: int = 0  # events read from the end of a torn line
    cut: str | None = None  # a compressed log that ends before its end: why (its lines up to there are read)


def scan(path: str) -> Scan:
    """Every event of the log at ``path`` that can be read, and every line that cannot.

    A line that is not one event (:func:`problem`) is skipped and named in ``bad`` with its number
    and what it holds. A crash mid-write leaves a torn line, which the next process's first event
    continues: where a line does not parse but ends in a whole event (one that starts with
    ``{"time":``), that event is read and the line still counted as bad (the torn event is lost).
    Leading NUL bytes (a write lost by the file system) are counted the same way. Raises ``OSError``
    when the file cannot be opened.
    """
    out = Scan()
    for n, raw in _lines(path, out):
        ev, why = _parse(raw)
        if why is not None:
            out.bad.append((n, why))
            out.salvaged += ev is not None
        if ev is not None:
            out.events.append(ev)
    return out


def _lines(path: str, out: Scan) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of the (gzip-compressed or plain) file at ``path``, numbered from 1."""
    with open(path, "rb") as raw:
        magic = raw.read(2)
        raw.seek(0)
        lines: Iterable[bytes] = _gunzip(raw, out) if magic == b"\x1f\x8b" else raw
        for n, line in enumerate(lines, 1):
            if line.strip(b" \t\r\n"):
                out.lines += 1
                yield n, line


def _gunzip(raw: IO[bytes], out: Scan) -> Iterator[bytes]:
    """The lines of a gzip stream (members one after another, as ``cat a.gz b.gz``), up to where it
    ends: a stream cut short (a rotation caught mid-compression) gives its lines up to the cut, the
    last one torn, and says so in ``out.cut``."""
    d = zlib.decompressobj(wbits=31)
    buf = b""
    try:
        while chunk := raw.read(1 << 16):
            buf += d.decompress(chunk)
            while d.eof and d.unused_data:  # the next member
                rest, d = d.unused_data, zlib.decompressobj(wbits=31)
                buf += d.decompress(rest)
            *whole, buf = buf.split(b"\n")
            yield from (line + b"\n" for line in whole)
        if not d.eof:
            out.cut = "the compressed file ends before its end marker (cut short): its lines up to there were read"
    except zlib.error as e:
        out.cut = f"the compressed data is damaged ({e}): the lines before it were read"
    if buf:
        yield buf


_BOM = b"\xef\xbb\xbf"
_START = '{"time":'  # how every line record() writes begins


def _parse(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One line as ``(event, None)``; or ``(None, why)``; or ``(event, why)`` where a damaged line
    ends in a whole event."""
    line = raw.removeprefix(_BOM)
    nuls = len(line) - len(line.lstrip(b"\x00"))
    if nuls:
        rest = line.lstrip(b"\x00")
        ev, why = _parse(rest) if rest.strip() else (None, "nothing else")
        return (ev if why is None else None,
                f"expected a JSON object (one violation event), got {nuls} NUL byte(s) (a write lost in a crash)"
                + ("; the event after them was read" if why is None else ""))
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"expected UTF-8 text (one JSON violation event), got bytes that are not ({e})"
    try:
        ev = json.loads(text)
    except json.JSONDecodeError as e:
        why = f"expected a JSON object (one violation event), got text that is not JSON ({e})"
        at = text.find(_START, 1)
        while at > 0:  # a torn write, continued by the next one
            try:
                tail = json.loads(text[at:])
            except json.JSONDecodeError:
                at = text.find(_START, at + 1)
                continue
            if problem(tail) is None:
                return tail, (f"expected a JSON object (one violation event), got a torn one: {at} character(s) "
                              f"of an event cut short (a crash mid-write), then a whole event, which was read")
            break
        return None, why
    wrong = problem(ev)
    return (None, wrong) if wrong is not None else (ev, None)


def read(path: str) -> list[dict[str, Any]]:
    """Every event of the log at ``path`` (plain or gzip-compressed), in order.

    Raises :class:`~kvcanary.errors.EventLogError` naming the file, the line and what was expected
    when a line is not one JSON event object (:func:`record`'s fields that a reader relies on:
    ``site``, ``step``, ``checks``, ``violations``, each of its type; the others, where present,
    of theirs) or a compressed file ends early; ``OSError`` when the file cannot be read.
    :func:`scan` reads past such lines instead.
    """
    out = Scan()
    events: list[dict[str, Any]] = []
    for n, raw in _lines(path, out):
        ev, why = _parse(raw)
        if why is not None or ev is None:
            raise EventLogError(path, n, why or "expected a violation event")
        events.append(ev)
    if out.cut:
        raise EventLogError(path, out.lines + 1, out.cut)
    return events


# an event's fields a reader relies on, and the JSON types each may hold (None: null)
_REQUIRED: dict[str, tuple[type | None, ...]] = {"site": (str,), "step": (int,), "checks": (list,),
                                                  "violations": (list,)}
_OPTIONAL: dict[str, tuple[type | None, ...]] = {
    "time": (int, float), "pid": (int,), "host": (str,), "rank": (int,), "engine": (str,), "group": (str, None),
    "request": (str, None), "row": (int,), "slots": (int,), "summary": (str,), "diagnosis": (dict, None)}
_NAMES: dict[type | None, str] = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object", None: "null"}


def problem(ev: object) -> str | None:
    """What keeps ``ev`` (one parsed line) from being a violation event, as "expected X, got Y";
    ``None`` when it is one."""
    if not isinstance(ev, dict):
        return f"expected a JSON object (one violation event), got {_shown(ev)}"
    missing = [k for k in _REQUIRED if k not in ev]
    if missing:
        return (f"expected a violation event with fields {', '.join(_REQUIRED)}, got an object without "
                f"{', '.join(missing)} (fields: {', '.join(map(str, ev)) or 'none'})")
    for fields in (_REQUIRED, _OPTIONAL):
        for k, types in fields.items():
            if k in ev and not _is(ev[k], types):
                return f"{k}: expected {' or '.join(_NAMES[t] for t in types)}, got {_shown(ev[k])}"
    if not all(isinstance(c, str) for c in ev["checks"]):
        return f"checks: expected a list of check names, got {_shown(ev['checks'])}"
    for i, v in enumerate(ev["violations"]):
        if not isinstance(v, dict):
            return f"violations[{i}]: expected an object (one slot record), got {_shown(v)}"
        for k in ("slot", "step"):
            if k in v and not _is(v[k], (int,)):
                return f"violations[{i}].{k}: expected an integer, got {_shown(v[k])}"
    return None


def _is(value: object, types: tuple[type | None, ...]) -> bool:
    if value is None:
        return None in types
    if isinstance(value, bool):  # JSON true is not a count
        return False
    return any(t is not None and isinstance(value, t) for t in types)


def _shown(value: object) -> str:
    text = json.dumps(value)
    return f"{text[:60]}..." if len(text) > 60 else text
