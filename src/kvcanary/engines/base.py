"""What every engine adapter shares: its canaries, the request token book, the shield around the
canary's own work, and the reporting of drained violations.

An adapter subclasses :class:`Adapter`, says which canaries it runs (:meth:`Adapter.canaries`),
marks each engine hook whose body is canary work with :func:`hook` (which runs it through
:meth:`Adapter.shielded`) and hands drained, request-named violations to :meth:`Adapter.report`.
Engines that describe a forward by a block table get their steps from
:mod:`kvcanary.engines.block_table`.

Adapter contract, whatever the engine: a failure of the canary's own never reaches the engine
outside ``raise`` mode (it is counted, and every stamp it may have left stale becomes unknown);
blocks the engine frees or zeroes are released; stamps follow the engine's block copies and
offloads; every event reaches the log, the JSONL violation log and the ``on_violation`` callbacks.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import time
import weakref
import functools
from typing import Any, Callable, ContextManager, Iterable, TypeVar

import torch

from kvcanary.canary import Canary
from kvcanary.config import CanaryConfig
from kvcanary.engines.token_book import TokenBook
from kvcanary.errors import KvCorruptionError
from kvcanary.harm import HarmCounter
from kvcanary.metrics import Metrics, process_metrics, serve
from kvcanary.reporting import report
from kvcanary.step import Step
from kvcanary.violations import Violation

log = logging.getLogger("kvcanary")
F = TypeVar("F", bound=Callable[..., Any])


def hook(where: str) -> Callable[[F], F]:
    """An engine hook of an :class:`Adapter`: its body is the canary's work, run by
    :meth:`Adapter.shielded` (``where`` names it in the log of an internal error), so a failure of
    the canary's own never reaches the engine outside ``raise`` mode."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: "Adapter", *args: Any, **kwargs: Any) -> Any:
            # the body looked up on each call (``__wrapped__``), so a test can make it fail
            return self.shielded(where, wrapper.__wrapped__, self, *args, **kwargs)  # type: ignore[attr-defined]

        return wrapper  # type: ignore[return-value]

    return deco


class Adapter:
    """The engine-independent half of an engine adapter.

    Attributes
    ----------
    config : the canary configuration
    violations : every violation drained so far, request ids filled in
    internal_errors : failures of the canary's own, counted (never raised outside ``raise`` mode)
    seconds : host time spent in the canary's hooks
    pending : ``raise`` mode: the error that stopped the engine, for the caller's thread
    """

    engine = "engine"  # the name events carry in the JSONL violation log

    def __init__(self, config: CanaryConfig, on_violation: Callable[[list[Violation]], None] | None = None) -> None:
        self.config = config
        self.on_violation = on_violation
        self.book = TokenBook()
        self.violations: list[Violation] = []
        self.internal_errors = 0
        self.seconds = 0.0
        self.pending: BaseException | None = None
        self.harm = HarmCounter()  # tokens sampled from corrupted KV before a report (kvcanary.harm)
        self.metrics: Metrics | None = None
        # the engine's write check and read audit (kvcanary.engines.audit.EngineAudit), where it has one
        self.audit: Any = None
        if config.metrics or config.metrics_port is not None:
            self.metrics = process_metrics()  # a clear error here when prometheus-client is missing
            if config.metrics_port is not None:
                serve(config.metrics_port)
        # canary name -> this forward's first reads (slots, request), in the order verified; and how
        # many reports of each (name, slot) were matched to them so far
        self._first_reads: dict[str, list[tuple[torch.Tensor, str]]] = {}
        self._first_read_hits: dict[tuple[str, int], int] = {}
        self._published = time.monotonic()
        self._unpublished = 0
        if self.metrics is not None:  # the last counts of a process, where no hook says it ends
            me = weakref.ref(self)  # an adapter gone before the exit is not kept alive for it
            atexit.register(lambda: _final_metrics(me()))

    def canaries(self) -> Iterable[Canary]:
        """The adapter's canaries (one per layer group, worker or rank)."""
        return ()

    def verify_first_read(self, name: str, step: Step, row: int, start: int, end: int, rid: str) -> None:
        """Verify every byte of positions ``[start, end)`` of ``row`` before this forward: request
        ``rid`` reads KV there for the first time that it did not write (a prefix-cache hit)."""
        c = self.named_canaries()[name]
        pos = torch.arange(start, end, device=step.cached_lens.device)
        slots = step.lookup(torch.full_like(pos, row), pos)
        slots = slots[(slots >= 0) & (slots < c.num_slots)]
        if slots.numel():
            c.first_read(slots)
            self._first_reads.setdefault(name, []).append((slots, rid))

    def first_reader(self, name: str, v: Violation) -> str | None:
        """The request a ``first_read`` violation of canary ``name`` was verified for: the ring keeps
        the order the reads were verified in, so the k-th report of a slot is its k-th first read.
        Looked up only when there is a report; the verification records no more than its slots."""
        key = (name, v.slot)
        k = self._first_read_hits.get(key, 0)
        readers = [rid for slots, rid in self._first_reads.get(name, []) if bool((slots == v.slot).any())]
        if k >= len(readers):
            return None
        self._first_read_hits[key] = k + 1
        return readers[k]

    def verify_new_readers(self, steps: dict[str, Step], rids: list[str], seen: set[str]) -> None:
        """Every request of this forward not in ``seen`` (added to it) reads for the first time: in
        each canary's step (by name), the positions ``[read_start, written_from)`` of its row, which it
        did not write, are verified byte for byte before the forward (:meth:`verify_first_read`); the
        record of the last forward's first reads is dropped first. ``rids[r]`` is row ``r``'s request
        (``""``: padding). Every step needs its ``written_from``."""
        self.forget_first_reads()
        if not set(rids).difference(seen, ("",)):
            return  # no request new to this adapter
        for i, rid in enumerate(rids):
            if not rid or rid in seen:
                continue
            seen.add(rid)
            for name, step in steps.items():
                assert step.written_from is not None
                start, end = int(step.starts()[i]), int(step.written_from[i])
                if end > start:
                    self.verify_first_read(name, step, i, start, end, rid)

    def forget_first_reads(self) -> None:
        """Drop the record of the forward's first reads (once its reports are out)."""
        self._first_reads.clear()
        self._first_read_hits.clear()

    def named_canaries(self) -> dict[str, Canary]:
        """The adapter's canaries by the name of what each watches (a layer group, a pool)."""
        return {str(i): c for i, c in enumerate(self.canaries())}

    def count_harm(self, found: list[Violation], healed: bool) -> int:
        """Add the tokens sampled from the KV these violations report, before the report (and in the
        reporting forward unless ``healed``: its output was dropped); :mod:`kvcanary.harm`."""
        named = self.named_canaries()
        ledgers: dict[str | None, Any] = {name: c.ledger for name, c in named.items()}
        if len(named) == 1:
            ledgers[None] = next(iter(named.values())).ledger
        return self.harm.count(found, ledgers, healed)

    def heal_counts(self) -> dict[str, int]:
        """The adapter's healing counters (requests repaired and failed, blocks evicted, harmful
        tokens)."""
        return {"harmful_tokens": self.harm.harmful}

    def own_counts(self) -> dict[str, int]:
        """The adapter's own counters, published with its first canary's metrics: its healing
        counters, its write check's and read audit's (:meth:`EngineAudit.counts
        <kvcanary.engines.audit.EngineAudit.counts>`), and any its engine adds."""
        out = self.heal_counts()
        if self.audit is not None:
            out.update(self.audit.counts())
        return out

    def request_at(self, step: int, row: int) -> str | None:
        """The request behind row ``row`` of canary step ``step``, while the adapter remembers it."""
        return None

    def holders_of(self, v: Violation) -> list[str] | None:
        """The requests whose tables (the engine's own) hold the block of a violation's slot (``None``:
        the adapter cannot tell)."""
        return None

    def writer_of(self, v: Violation) -> tuple[int, str] | None:
        """The last writer of a violation's slot: its step and request (or step row)."""
        named = self.named_canaries()
        c = named.get(v.group) if v.group is not None else None
        c = c if c is not None else next(iter(named.values()), None)
        w = c.last_writer(v.slot) if c is not None else None
        if w is None:
            return None
        return w[0], self.request_at(*w) or f"row {w[1]} of step {w[0]}"

    def metric_labels(self) -> dict[str, str]:
        """The labels of this adapter's metrics (:data:`kvcanary.metrics.LABELS`, less ``group``)."""
        return {"engine": self.engine, "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}

    def publish_metrics(self, force: bool = False) -> None:
        """Bring the Prometheus metrics up to date: every 16th call or after a second, whichever
        comes first, and when ``force``d (a protection ending, the process exiting)."""
        if self.metrics is None:
            return
        self._unpublished += 1
        if not force and self._unpublished < 16 and time.monotonic() - self._published < 1.0:
            return
        self._published, self._unpublished = time.monotonic(), 0
        labels = self.metric_labels()
        for i, (name, c) in enumerate(self.named_canaries().items()):
            st = c.stats()
            if i == 0:  # the adapter's own failures and healing, counted once
                st["internal_errors"] = st.get("internal_errors", 0) + self.internal_errors
                st.update(self.own_counts())
            self.metrics.publish(c, st, {**labels, "group": name})

    def work_context(self) -> ContextManager[Any]:
        """Where the canary's work runs (the forward's stream, one thread...); override per engine."""
        return contextlib.nullcontext()

    def shielded(self, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the canary's work of one engine hook. A failure of the canary's own never reaches the
        engine outside ``raise`` mode: it is counted, and :meth:`recover` makes every stamp it may
        have left stale unknown, so it never turns into false reports."""
        t0 = time.perf_counter()
        try:
            with self.work_context():
                return fn(*args, **kwargs)
        except KvCorruptionError:
            raise  # raise mode only (report records it as pending first)
        except Exception as e:
            if self.config.mode == "raise":
                self.pending = e
                raise
            self.internal_errors += 1
            log.error("kvcanary internal error in %s (counted, not raised)", where,
                      exc_info=e if self.internal_errors <= 3 else None)
            self.recover()
            return None
        finally:
            self.seconds += time.perf_counter() - t0

    def recover(self) -> None:
        """After a failure of the canary's own: a fresh token book, every slot unknown."""
        try:
            self.book = TokenBook()
            for c in self.canaries():
                c.forget_all()
        except Exception:  # nothing more can be done; the counters already say something failed
            log.exception("kvcanary: recovery after an internal error failed")

    def report(self, found: list[Violation], **context: Any) -> None:
        """Record request-named violations, then send them to the JSONL log, ``on_violation`` and the
        log (one line per event); ``raise`` mode raises :class:`KvCorruptionError` after recording."""
        if not found:
            return
        self.violations += found
        if self.metrics is not None:
            self.metrics.count(found, self.metric_labels())
        mode = "log" if self.config.mode in ("quarantine", "repair") else self.config.mode
        try:
            self.internal_errors += report(found, 0, mode, [self.on_violation] if self.on_violation else [],
                                           self.config.violations_log, writer_of=self.writer_of,
                                           holders_of=self.holders_of, engine=self.engine,
                                           **context)
        except KvCorruptionError as e:
            self.pending = e
            raise

    def raise_pending(self) -> None:
        """Raise, in the calling thread, the error that stopped the engine in ``raise`` mode."""
        err, self.pending = self.pending, None
        if err is not None:
            raise err

    def stats(self) -> dict[str, int]:
        """Every canary's counters summed (the worst of each canary's bounds in forwards), with the
        adapter's own."""
        out: dict[str, int] = {}
        for c in self.canaries():
            for k, v in c.stats().items():
                out[k] = max(out.get(k, 0), v) if k in WORST_OF else out.get(k, 0) + v
        out["internal_errors"] = out.get("internal_errors", 0) + self.internal_errors
        out.update(self.heal_counts())
        out["canary_us"] = int(self.seconds * 1e6)
        return out


def named(v: Violation, rids: list[str]) -> Violation:
    """``v`` with the request of its step row (``rids[row]``; none for a padding row or a record of
    no row, such as the patrol's)."""
    rid = rids[v.row] if 0 <= v.row < len(rids) and rids[v.row] else None
    return dataclasses.replace(v, request=rid)


WORST_OF = frozenset({"patrol_pass_steps", "unverified_age_max_steps"})  # bounds: the largest, not the sum


def _final_metrics(adapter: "Adapter | None") -> None:
    try:
        if adapter is not None:
            adapter.publish_metrics(force=True)
    except Exception:  # at exit: nothing to recover, and nothing to raise into
        pass
