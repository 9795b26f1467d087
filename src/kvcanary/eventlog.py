"""The JSONL violation log: one line per violation event, one format for every engine and process.

Set ``CanaryConfig(violations_log=PATH)`` (``KVCANARY_VIOLATIONS_LOG``): every event a canary or an
engine adapter drains is appended to ``PATH`` as one JSON object. Each line is written with a
single ``write`` on a file opened for appending, so the workers of a multiprocess engine can share
one file. A line::

    {"time": 1764590000.123, "pid": 4242, "engine": "transformers", "rank": 0, "group": "full_attention",
     "site": "verify", "step": 12, "request": "req_3", "row": 1, "checks": ["CONTENT"], "slots": 1,
     "summary": "[verify step 12 ...] request req_3: 1 slot(s) failed CONTENT; first: ...",
     "violations": [{"site": "verify", "checks": ["CONTENT"], "slot": 40, "position": 5, ...}]}

:func:`read` gives the lines back as dicts.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable

from kvcanary.errors import EventLogError
from kvcanary.violations import Check, Event


def record(ev: Event, **context: Any) -> dict[str, Any]:
    """One event as the log's JSON object; ``context`` (engine, rank, ...) is merged in."""
    return {
        "time": round(time.time(), 3),
        "pid": os.getpid(),
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
            os.write(fd, line.encode())
    finally:
        os.close(fd)
    return len(lines)


def read(path: str) -> list[dict[str, Any]]:
    """Every event of the log at ``path``, in order.

    Raises :class:`~kvcanary.errors.EventLogError` naming the file, the line and what was expected
    when a line is not one JSON event object (:func:`record`'s fields that a reader relies on:
    ``site``, ``step``, ``checks``, ``violations``, each of its type; the others, where present,
    of theirs); ``OSError`` when the file cannot be read.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError as e:
                raise EventLogError(path, n, f"expected a JSON object (one violation event), got text that is "
                                    f"not JSON ({e})") from None
            wrong = problem(ev)
            if wrong is not None:
                raise EventLogError(path, n, wrong)
            out.append(ev)
    return out


# an event's fields a reader relies on, and the JSON types each may hold (None: null)
_REQUIRED: dict[str, tuple[type | None, ...]] = {"site": (str,), "step": (int,), "checks": (list,),
                                                  "violations": (list,)}
_OPTIONAL: dict[str, tuple[type | None, ...]] = {
    "time": (int, float), "pid": (int,), "rank": (int,), "engine": (str,), "group": (str, None),
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
