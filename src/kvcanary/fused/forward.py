"""A canary's forward hooks on the fused CPU path as one compiled call each.

:meth:`Canary.before_forward <kvcanary.canary.Canary.before_forward>` is the step's value check and
the verify of its reads, with the harm ledger's marks of the content window;
:meth:`Canary.after_forward <kvcanary.canary.Canary.after_forward>` is the value check, the stamp,
the last-writer record, the ledger's marks of the written slots, and, where nothing is left for
the Python side (no padding writes to check, no reads of this step's own writes), the guard slots,
the step count and the forward's share of the patrol scrub. Each runs the same compiled loops as the
separate ops (:mod:`kvcanary.fused.ops`), in the same order, so the two paths agree bit for bit
(``tests/test_fused_forward.py``); what the Python side passes per call is the step's descriptor
and a few integers, everything else is bound once per canary in :class:`ForwardArgs`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcanary.fused._core import JIT, ld_i64
from kvcanary.fused._step import CL, NNEW, NROWS, NS, WF, bump, checked_out, rd
from kvcanary.fused.cache import njit
from kvcanary.fused.ops import (_K_SCBYTES, _K_SCRUBBED, _NO_LEDGER, _STEPS, _guard, _seeds, _stamp, _validate,
                                _verify, mark_checked, scrub_one)
from kvcanary.fused.steps import _note_writers
from kvcanary.violations import Site

INVALID, DONE, STAMPED = -1, 0, 1  # what the after-forward entry did (see _after)
_SITE_SCRUB = int(Site.SCRUB)


@njit(**JIT)
def _before(d, stamps, num_slots, src, runs, keys, counters, cursor, content_slots, ring, cap, bps, part, check,  # type: ignore[no-untyped-def]
            led_at, led_before, forward):
    """-1 when the step's values fail the check (nothing verified), else the read slots verified."""
    if check and _validate(d, num_slots):
        return -1
    return _verify(d, stamps, num_slots, src, runs, keys, counters, cursor, content_slots, ring, cap, bps, part,
                   led_at, led_before, forward)


@njit(**JIT)
def _after(d, stamps, num_slots, src, runs, keys, counters, ring, cap, bps, check, writers, led_at, led_before,  # type: ignore[no-untyped-def]
           forward, tail, guard_slots, nres, nguard, gbase, ghit, gwas, ggot, patrol_from, patrol_n):
    """INVALID: the step's values fail the check, nothing done. STAMPED: the writes are stamped and
    recorded, and the rest of the forward's work is the caller's (``tail`` was 0, or some row reads
    slots this step wrote). DONE: that rest ran too: the guard slots, the step count, and the
    patrol's ``patrol_n`` slots from ``patrol_from`` (marked in the ledger at ``forward + 1``, the
    forward the canary counts next, as a separate patrol call after the forward would)."""
    if check and _validate(d, num_slots):
        return INVALID
    nrows = d[NROWS]
    seed = np.empty(nrows, dtype=np.int64)
    mode = np.empty(nrows, dtype=np.int64)
    _seeds(d, stamps, num_slots, seed, mode)
    _stamp(d, stamps, num_slots, src, runs, keys, counters, ring, cap, bps, seed, mode)
    _note_writers(d, writers, num_slots, ld_i64(counters + 8 * _STEPS))
    if led_at.shape[0]:
        for t in range(d[NNEW]):
            s = rd(d, NS, t)
            if 0 <= s < num_slots:
                mark_checked(led_at, led_before, s, forward)
    if not tail:
        return STAMPED
    if d[WF] != 0:
        for r in range(nrows):
            if rd(d, WF, r) < rd(d, CL, r):
                return STAMPED
    if nguard:
        _guard(stamps, src, runs, keys, guard_slots, nres, nguard, gbase, ghit, gwas, ggot, counters, ring, cap)
    bump(counters, _STEPS, 1)
    if patrol_n:
        step_id = ld_i64(counters + 8 * _STEPS)
        live = 0
        for i in range(patrol_n):
            s = (patrol_from + i) % num_slots
            live += scrub_one(stamps, num_slots, src, runs, keys, s, counters, ring, cap, _SITE_SCRUB, step_id)
            if led_at.shape[0]:
                mark_checked(led_at, led_before, s, forward + 1)
        bump(counters, _K_SCRUBBED, live)
        bump(counters, _K_SCBYTES, live * bps)
    return DONE


class ForwardArgs:
    """One canary's arguments to the compiled forward entries, bound once: the addresses of its
    stamps, counters, ring, cursor and guard state, its layout table and ledger arrays. The tensors
    behind them live as long as the canary and are never reallocated."""

    def __init__(self, canary: Any) -> None:
        c = canary
        n = c.num_slots
        g = c.guards
        self._keep = (c.stamps, c.ring, c.cursor, c.writers, g.every, c.table)
        ring = c.ring.rows
        cap = ring.shape[0]
        table = c.table
        ledger = c.ledger
        self.led = (ledger.at, ledger.before) if ledger is not None else (_NO_LEDGER, _NO_LEDGER)
        self.head = (checked_out(c.stamps, (n, 4)), n, table.src, table.runs, table.keys,
                     checked_out(c.ring.counters, (c.ring.counters.shape[0],)))
        self.ring = (checked_out(ring, tuple(ring.shape)), cap, table.bytes_per_slot)
        self.cursor = checked_out(c.cursor, (1,))
        self.writers = c.writers.numpy()
        nres = int(g.reserved.shape[0])
        ng = int(g.every.shape[0])
        guard_state = [checked_out(t, (nres,)) for t in (g.base, g.hit, g.was, g.got)]
        self.guard = (checked_out(g.every, (ng,)) if ng else 0, nres, ng, *guard_state)

    def before(self, d: np.ndarray, content_slots: int, part: int, check: bool, forward: int) -> int:
        return int(_before(d, *self.head, self.cursor, content_slots, *self.ring, part, check, *self.led, forward))

    def after(self, d: np.ndarray, check: bool, forward: int, tail: bool, patrol_from: int, patrol_n: int) -> int:
        return int(_after(d, *self.head, *self.ring, check, self.writers, *self.led, forward, tail, *self.guard,
                          patrol_from, patrol_n))
