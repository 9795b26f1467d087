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
    """Every event of the log at ``path``, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
