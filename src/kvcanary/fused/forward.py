"""A canary's forward hooks on the fused CPU path as one compiled call each.

:meth:`Canary.before_forward <kvcanary.canary.Canary.before_forward>` is the step's value check and
the verify of its reads, with the harm ledger's marks of the content window;
:meth:`Canary.after_forward <kvcanary.canary.Canary.after_forward>` is the value check, the stamp,
the last-writer record, the ledger's marks of the written slots, and, where nothing is left for
the Python side (no padding writes to check, no reads of this step's own writes), the guard slots,
the step count and the forward's share of the patrol scrub. Each runs the same compiled loops as the
separate ops (:mod:`kvcanary.fused.ops`, :mod:`kvcanary.fused.scrub`), in the same order, so the two
paths agree bit for bit (``tests/test_fused_forward.py``); what the Python side passes per call is
the step's descriptor and a few integers, everything else is bound once per canary in
:class:`ForwardArgs`: the canary's addresses and sizes in one int64 record, this call's values in
another, each field named below.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcanary.fused._core import JIT, ld_i64
from kvcanary.fused._step import CL, NNEW, NROWS, NS, WF, bump, checked_out, rd
from kvcanary.fused.cache import njit
from kvcanary.fused.ops import _NO_FOLD, _NO_LEDGER, _STEPS, _seeds, _stamp, _verify, mark_checked
from kvcanary.fused.scrub import _K_SCBYTES, _K_SCRUBBED, _guard, scrub_run
from kvcanary.fused.steps import _note_writers, values_bad
from kvcanary.violations import Site

INVALID, DONE, STAMPED = -1, 0, 1  # what the after-forward entry did (see _after)
_SITE_SCRUB = int(Site.SCRUB)

# a canary's record (bound once): the addresses of its stamps, counters, cursor and ring, its sizes,
# and its guard slots' addresses and counts (kvcanary.guards)
C_STAMPS, C_NUM_SLOTS, C_COUNTERS, C_CURSOR, C_RING, C_CAP, C_BPS = range(7)
C_GUARD, C_NRES, C_NGUARD, C_GBASE, C_GHIT, C_GWAS, C_GGOT = range(7, 14)
C_REGIONS, C_NREGIONS, C_SNAP = range(14, 17)  # the reserved slots' snapshot (kvcanary.fused.snapshot)
CANARY_FIELDS = 17
# one call's record: the content budget in slots (-1: all), verify's part, whether to check the
# step's values, the forward's number, whether the after entry runs the forward's tail (the guard,
# the step count, the patrol), and the patrol's first slot and slot count
K_CONTENT, K_PART, K_CHECK, K_FORWARD, K_TAIL, K_PATROL_FROM, K_PATROL_N = range(7)
CALL_FIELDS = 7


@njit(**JIT)
def _before(d, c, k, src, runs, keys, led_at, led_before):  # type: ignore[no-untyped-def]
    """-1 when the step's values fail the check (nothing verified), else the read slots verified."""
    n = c[C_NUM_SLOTS]
    if k[K_CHECK] and values_bad(d, n):
        return -1
    return _verify(d, c[C_STAMPS], n, src, runs, keys, c[C_COUNTERS], c[C_CURSOR], k[K_CONTENT], c[C_RING], c[C_CAP],
                   c[C_BPS], k[K_PART], led_at, led_before, k[K_FORWARD])


@njit(**JIT)
def _after(d, c, k, src, runs, keys, writers, led_at, led_before, pre_acc, pre_cnt):  # type: ignore[no-untyped-def]
    """INVALID: the step's values fail the check, nothing done. STAMPED: the writes are stamped and
    recorded, and the rest of the forward's work is the caller's (``K_TAIL`` was 0, or some row
    reads slots this step wrote). DONE: that rest ran too: the guard slots, the step count, and the
    patrol's ``K_PATROL_N`` slots from ``K_PATROL_FROM`` (marked in the ledger at the forward the
    canary counts next, as a separate patrol call after the forward would). ``pre_acc`` and
    ``pre_cnt``: the new tokens' fingerprints folded during the forward (:func:`kvcanary.fused.ops._stamp`)."""
    stamps, num_slots, counters, ring, cap, bps = c[C_STAMPS], c[C_NUM_SLOTS], c[C_COUNTERS], c[C_RING], c[C_CAP], \
        c[C_BPS]
    forward = k[K_FORWARD]
    if k[K_CHECK] and values_bad(d, num_slots):
        return INVALID
    nrows = d[NROWS]
    seed = np.empty(nrows, dtype=np.int64)
    mode = np.empty(nrows, dtype=np.int64)
    _seeds(d, stamps, num_slots, seed, mode)
    _stamp(d, stamps, num_slots, src, runs, keys, counters, ring, cap, bps, seed, mode, pre_acc, pre_cnt)
    _note_writers(d, writers, num_slots, ld_i64(counters + 8 * _STEPS))
    if led_at.shape[0]:
        for t in range(d[NNEW]):
            s = rd(d, NS, t)
            if 0 <= s < num_slots:
                mark_checked(led_at, led_before, s, forward)
    if not k[K_TAIL]:
        return STAMPED
    if d[WF] != 0:
        for r in range(nrows):
            if rd(d, WF, r) < rd(d, CL, r):
                return STAMPED
    if c[C_NGUARD]:
        _guard(stamps, src, runs, keys, c[C_GUARD], c[C_NRES], c[C_NGUARD], c[C_GBASE], c[C_GHIT], c[C_GWAS],
               c[C_GGOT], counters, ring, cap, c[C_REGIONS], c[C_NREGIONS], c[C_SNAP])
    bump(counters, _STEPS, 1)
    patrol_n, patrol_from = k[K_PATROL_N], k[K_PATROL_FROM]
    if patrol_n:
        live = scrub_run(stamps, num_slots, src, runs, keys, patrol_from, patrol_n, counters, ring, cap, _SITE_SCRUB,
                         ld_i64(counters + 8 * _STEPS))
        if led_at.shape[0]:
            for i in range(patrol_n):
                mark_checked(led_at, led_before, (patrol_from + i) % num_slots, forward + 1)
        bump(counters, _K_SCRUBBED, live)
        bump(counters, _K_SCBYTES, live * bps)
    return DONE


@njit(**JIT)
def _set_blocks(stamps, blocks, bs, s0, s1, s2, s3):  # type: ignore[no-untyped-def]
    """``stamps[s] = (s0, s1, s2, s3)`` for every slot ``s`` of ``blocks`` (``bs`` slots each)."""
    for b in blocks:
        for s in range(b * bs, (b + 1) * bs):
            stamps[s, 0], stamps[s, 1], stamps[s, 2], stamps[s, 3] = s0, s1, s2, s3


class ForwardArgs:
    """One canary's arguments to the compiled forward entries, bound once: the canary's record (the
    addresses of its stamps, counters, ring, cursor and guard state, and its sizes), its layout
    table and ledger arrays. The tensors behind them live as long as the canary and are never
    reallocated."""

    def __init__(self, canary: Any) -> None:
        c = canary
        n = c.num_slots
        g = c.guards
        self._keep = (c.stamps, c.ring, c.cursor, c.writers, g.every, c.table)
        ring = c.ring.rows
        table = c.table
        ledger = c.ledger
        self.led = (ledger.at, ledger.before) if ledger is not None else (_NO_LEDGER, _NO_LEDGER)
        self.tables = (table.src, table.runs, table.keys)
        self.writers = c.writers.numpy()
        nres = int(g.reserved.shape[0])
        ng = int(g.every.shape[0])
        record = np.zeros(CANARY_FIELDS, dtype=np.int64)
        record[[C_STAMPS, C_NUM_SLOTS, C_COUNTERS, C_CURSOR, C_RING, C_CAP, C_BPS]] = (
            checked_out(c.stamps, (n, 4)), n, checked_out(c.ring.counters, (c.ring.counters.shape[0],)),
            checked_out(c.cursor, (1,)), checked_out(ring, tuple(ring.shape)), ring.shape[0], table.bytes_per_slot)
        record[[C_GUARD, C_NRES, C_NGUARD]] = checked_out(g.every, (ng,)) if ng else 0, nres, ng
        record[[C_GBASE, C_GHIT, C_GWAS, C_GGOT]] = [checked_out(t, (nres,)) for t in (g.base, g.hit, g.was, g.got)]
        record[[C_REGIONS, C_NREGIONS, C_SNAP]] = g.snapshot_args()
        self.record = record
        self.call = np.zeros(CALL_FIELDS, dtype=np.int64)  # rewritten by every call
        self.stamps = c.stamps.numpy()  # the same memory, for the loops that take it as an array

    def set_blocks(self, blocks: list[int], block_size: int, stamp: tuple[int, int, int, int]) -> None:
        """Every slot of ``blocks`` (checked: in the pool) stamped ``stamp``, in one compiled loop."""
        _set_blocks(self.stamps, np.asarray(blocks, dtype=np.int64), block_size, *stamp)

    def before(self, d: np.ndarray, content_slots: int, part: int, check: bool, forward: int) -> int:
        k = self.call
        k[K_CONTENT], k[K_PART], k[K_CHECK], k[K_FORWARD] = content_slots, part, check, forward
        return int(_before(d, self.record, k, *self.tables, *self.led))

    def after(self, d: np.ndarray, check: bool, forward: int, tail: bool, patrol_from: int, patrol_n: int,
              folded: tuple[np.ndarray, np.ndarray] | None = None) -> int:
        k = self.call
        k[K_CHECK], k[K_FORWARD], k[K_TAIL], k[K_PATROL_FROM], k[K_PATROL_N] = check, forward, tail, patrol_from, \
            patrol_n
        acc, cnt = folded if folded is not None else (_NO_FOLD, _NO_LEDGER)
        if acc.dtype != np.uint64 or cnt.dtype != np.int64 or acc.shape != cnt.shape or acc.ndim != 1:
            raise ValueError(f"folded: expected uint64 and int64 arrays of one length, got {acc.dtype} "
                             f"{acc.shape} and {cnt.dtype} {cnt.shape}")
        return int(_after(d, self.record, k, *self.tables, self.writers, *self.led, acc, cnt))


def warm_up(d: np.ndarray, record: np.ndarray, tables: tuple[np.ndarray, ...], writers: np.ndarray) -> None:
    """Both entries, and the block release, once on a tiny canary's arguments (:func:`kvcanary.fused.available`)."""
    led = np.full(writers.shape[0] - 1, -1, dtype=np.int64)
    k = np.zeros(CALL_FIELDS, dtype=np.int64)
    k[K_CONTENT], k[K_PART], k[K_CHECK] = -1, 1, 1
    _before(d, record, k, *tables, led, led.copy())
    k[K_TAIL], k[K_PATROL_N] = 1, 1
    _after(d, record, k, *tables, writers, led, led.copy(), _NO_FOLD, _NO_LEDGER)
    _set_blocks(np.zeros((4, 4), dtype=np.int64), np.zeros(1, dtype=np.int64), 4, -1, -1, 0, 0)
