"""Every exception kvcanary raises.

::

    KvCanaryError                      base of everything below
    ├── ConfigError (ValueError)       a CanaryConfig field out of range
    ├── LayoutError (ValueError)       a KV layout that cannot be read as described
    ├── StepError (ValueError)         step metadata with a bad shape, dtype or value
    ├── UnsupportedError (RuntimeError) a device, dtype or engine version kvcanary cannot handle
    ├── EventLogError (ValueError)     a violation log line that is not a violation event
    └── KvCorruptionError (RuntimeError) violations found in ``raise`` mode; carries the records
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from kvcanary.violations import Violation


class KvCanaryError(Exception):
    """Base class of all kvcanary errors."""


class ConfigError(KvCanaryError, ValueError):
    """A configuration value is out of range."""


class LayoutError(KvCanaryError, ValueError):
    """A KV layout cannot be read as described."""


class StepError(KvCanaryError, ValueError):
    """Step metadata has a bad shape, dtype or value."""


class UnsupportedError(KvCanaryError, RuntimeError):
    """A device, dtype or engine version kvcanary cannot handle."""


class EventLogError(KvCanaryError, ValueError):
    """A line of a JSONL violation log (:mod:`kvcanary.eventlog`) is not a violation event.

    Attributes
    ----------
    path, line : the file and the line (from 1)
    reason : what was expected and what the line holds
    """

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}, line {line}: {reason}")


class KvCorruptionError(KvCanaryError, RuntimeError):
    """Violations found in ``raise`` mode (raised by ``poll()``, and by an engine adapter in the
    caller's thread), or the error a quarantined request fails with.

    Attributes
    ----------
    violations : the decoded records (at most the ring's capacity), request ids filled in where
        the engine adapter knows them
    lost : how many further violations overflowed the ring before they could be drained
    requests : the ids of the requests the records name, sorted
    sink_errors : the exceptions of violation sinks (the JSONL log, ``on_violation`` callbacks)
        that failed while these violations were reported; the first is also the ``__cause__``
    """

    def __init__(self, violations: Sequence[Violation], lost: int = 0, message: str | None = None,
                 sink_errors: Sequence[BaseException] = ()) -> None:
        from kvcanary.violations import events

        self.violations = list(violations)
        self.lost = lost
        self.requests = sorted({v.request for v in self.violations if v.request is not None})
        self.sink_errors = list(sink_errors)
        if message is None:
            evs = events(self.violations)
            head = "; ".join(e.describe() for e in evs[:3])
            more = f" (+{len(evs) - 3} more events)" if len(evs) > 3 else ""
            lost_s = f", {lost} lost to ring overflow" if lost else ""
            who = f" hurting request(s) {', '.join(self.requests)}" if self.requests else ""
            message = f"{len(self.violations)} KV-cache violation(s){lost_s}{who}: {head}{more}"
            if self.sink_errors:
                first = self.sink_errors[0]
                message += (f" [{len(self.sink_errors)} violation sink(s) failed while reporting them; first: "
                            f"{type(first).__name__}: {first}]")
        super().__init__(message)

    @property
    def first(self) -> Violation | None:
        return self.violations[0] if self.violations else None
