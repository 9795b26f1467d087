"""``kvcanary report``: a JSONL violation log (:mod:`kvcanary.eventlog`) read back as a summary a
person can act on, and as a one-page HTML report with pictures of the violations over time and
over the slot space.

The summary says, per kind of failure (the diagnosed bug class, the failed checks and the site),
how many events and slots, which requests were hurt, when (wall-clock, UTC) and at which steps of
which process (steps count the forwards of one process: they start again in every process); then
the requests to retry with the first and last time each was hurt, the slots and layer groups hit
most, and the processes that reported. A log a crash left damaged is read as far as it goes: lines
that are not violation events are skipped, counted and named by number. Logs compressed with gzip
are read as they are. ``rich`` renders the tables when it is installed; plain text otherwise.

Exit status of :func:`main` (``kvcanary report``): 0 no violations; 1 violations; 2 not a violation
log (no line of it is one), or a file or page that cannot be read or written; 4 is added when lines
were skipped (4: skipped lines and no violations in the rest; 5: skipped lines and violations).
"""

from __future__ import annotations

import json
import os
import sys

from kvcanary.eventlog import read, scan
from kvcanary.report.page import html_page
from kvcanary.report.summary import SKIPPED, Kind, Summary, as_dict, headline, print_summary, summarize

__all__ = ["read", "scan", "summarize", "headline", "html_page", "as_dict", "main", "Summary", "Kind"]


def main(path: str, html_out: str | None = None, as_json: bool = False) -> int:
    """``kvcanary report``; returns the exit status (:data:`kvcanary.cli.REPORT_EXIT_CODES`): 0 when the log has no
    violations, 1 when it has, 2 when it is not a violation log, cannot be read, or the page cannot
    be written (said on stderr before anything is printed); 4 added when lines were skipped."""
    unwritable = html_out and _unwritable(html_out)
    if unwritable:
        print(f"kvcanary report: --html {html_out}: {unwritable}", file=sys.stderr)
        return 2
    try:
        got = scan(path)
    except OSError as e:
        print(f"kvcanary report: cannot read {path!r} as a JSONL violation log: {e}", file=sys.stderr)
        return 2
    if not got.events and (got.bad or got.cut):  # not one event: not a violation log at all
        first = (f"line {got.bad[0][0]}: {got.bad[0][1]}" if got.bad else str(got.cut))
        also = f" (none of its {got.lines} line(s) is a violation event)" if got.lines > 1 else ""
        print(f"kvcanary report: cannot read {path!r} as a JSONL violation log: {first}{also}", file=sys.stderr)
        return 2
    s = summarize(got.events, got.bad, got.lines, got.cut)
    if s.skipped or s.cut:  # on stderr too: a script reading --json sees it, and the status says it
        named = "; ".join(f"line {n}: {why}" for n, why in s.skipped[:3])
        more = f"; and {len(s.skipped) - 3} more" if len(s.skipped) > 3 else ""
        print(f"kvcanary report: {path}: skipped {len(s.skipped)} of {s.lines} line(s) that are not violation "
              f"events" + (f" ({named}{more})" if named else "") + (f"; {s.cut}" if s.cut else ""), file=sys.stderr)
    if as_json:
        print(json.dumps(as_dict(s)))
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
    return (1 if s.events else 0) + (SKIPPED if s.skipped or s.cut else 0)


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
