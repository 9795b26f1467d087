"""Reporting drained violations to their sinks, and coverage as shares of what was read."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable

from kvcanary import eventlog
from kvcanary.diagnosis import annotate
from kvcanary.errors import KvCorruptionError
from kvcanary.violations import Violation, events

log = logging.getLogger("kvcanary")


def report(found: list[Violation], lost: int, mode: str,
           callbacks: Iterable[Callable[[list[Violation]], None]] = (), log_path: str | None = None,
           writer_of: Callable[[Violation], tuple[int, str] | None] | None = None,
           holders_of: Callable[[Violation], list[str] | None] | None = None, **context: Any) -> int:
    """Report drained violations: appended to the JSONL violation log (``log_path``, one line per
    event, with ``context`` such as the engine and rank), then the callbacks, then one log line
    per event, or in ``raise`` mode :class:`KvCorruptionError`. Every sink runs even when one
    before it fails. Returns how many sinks failed (counted as internal errors by the caller); in
    ``raise`` mode the :class:`KvCorruptionError` is raised all the same, carrying the sinks'
    exceptions (``sink_errors``, the first as its ``__cause__``)."""
    if not found and not lost:
        return 0
    try:  # a diagnosis that fails leaves the events undiagnosed, never unreported
        evs = annotate(events(found), writer_of, holders_of)
    except Exception:
        log.exception("kvcanary: diagnosing violations failed (reported without a diagnosis)")
        evs = events(found)
    failed: list[Exception] = []
    sinks: list[Callable[[], object]] = [lambda: eventlog.append(log_path, evs, **context)] if log_path else []
    sinks += [functools.partial(cb, found) for cb in callbacks]
    for sink in sinks:
        try:
            sink()
        except Exception as e:  # the violations are reported all the same, by the other sinks and the error
            failed.append(e)
            log.error("kvcanary: a violation sink (log file or on_violation callback) failed (%s)",
                      "attached to the KvCorruptionError" if mode == "raise" else "counted, not raised", exc_info=e)
    if mode == "raise":
        err = KvCorruptionError(found, lost, sink_errors=failed)
        if failed:
            raise err from failed[0]
        raise err
    for ev in evs:
        log.warning("kvcanary violation %s", ev.describe())
    if lost:
        log.warning("kvcanary: %d violations overflowed the ring before they were drained", lost)
    return len(failed)


def coverage_of(stats: dict[str, int]) -> dict[str, float]:
    """How much the checks covered, from (summed) canary stats: of read slots, those whose bytes
    were re-fingerprinted (``content_verified``) and those in the unknown state (``unverifiable``);
    the bound on how many forwards ago a stamped slot's bytes were last fingerprinted
    (``unverified_age_max_steps``); the patrol scrub's passes over the pool (``scrub_passes``, with
    the fraction of the current one)."""
    read = stats.get("slots_verified", 0)
    share = (lambda k: stats.get(k, 0) / read) if read else (lambda k: 0.0)
    pool = stats.get("num_slots", 0)
    return {"content_verified": share("content_slots_verified"), "unverifiable": share("slots_unverifiable"),
            "scrub_passes": stats.get("scrub_passes", 0) + (stats.get("scrub_position", 0) / pool if pool else 0.0),
            "unverified_age_max_steps": float(stats.get("unverified_age_max_steps", 0))}
