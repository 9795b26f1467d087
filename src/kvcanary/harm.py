"""Harm as a number: tokens sampled by forwards that read corrupted KV before the canary reported it.

A changed slot is reported by the first check that looks at its bytes; under a content budget
that may be some forwards after the change, and every forward that read the slot in between
sampled its tokens from corrupted KV. Two pieces count them:

- :class:`CheckLedger` (one per canary, CPU backends): the forward each slot's bytes were last
  fingerprinted (stamped, verified in the rotating window, scrubbed, verified at a first read or a
  landing), and the one before, so that the last good check of a slot reported now is known.
- :class:`HarmCounter` (one per engine adapter): the tokens each request sampled in each recent
  forward. A reported slot's readers sampled ``harmful`` tokens in the forwards after its last good
  check and before the report, and in the reporting forward itself unless healing dropped that
  forward's output (``quarantine``, ``repair``).

The change happened somewhere after the last good check, so the count is an upper bound; with every
read byte verified (``content_budget_bytes=None``) a changed byte is reported before any forward
reads it, and the count under ``repair`` is 0. The Triton path keeps no ledger (it would read device
tensors on the host): there the count covers the reporting forward only.
"""

from __future__ import annotations

import collections

import numpy as np
import torch

ALL, BEFORE_WRITES = 0, 1  # kvcanary.ops' verify parts (that module imports the canary's backends)
from kvcanary.step import Step
from kvcanary.violations import Check, Site, Violation


class CheckLedger:
    """The forward each slot's bytes were last fingerprinted, and the forward before that."""

    def __init__(self, num_slots: int, every_read: bool = False) -> None:
        self.at = np.full(num_slots, -1, dtype=np.int64)
        self.before = np.full(num_slots, -1, dtype=np.int64)
        # every read slot's bytes are verified before each read (no content budget): a slot reported at
        # a read was good at its reader's previous read, and verifies mark nothing here
        self.every_read = every_read

    def mark(self, slots: torch.Tensor | np.ndarray, forward: int) -> None:
        """``slots`` (ids in the pool) had their bytes fingerprinted at ``forward``."""
        s = slots.numpy() if isinstance(slots, torch.Tensor) else slots
        if not s.size:
            return
        s = s[(s >= 0) & (s < self.at.shape[0])]
        cur = self.at[s]
        moved = cur != forward
        self.before[s[moved]] = cur[moved]
        self.at[s] = forward

    def last_good(self, slot: int, forward: int, read: bool = False) -> int:
        """The last forward before ``forward`` whose check of ``slot``'s bytes passed (-1: none);
        ``read``: the report came from a read's check."""
        if read and self.every_read:
            return forward - 1
        if not 0 <= slot < self.at.shape[0]:
            return -1
        at = int(self.at[slot])
        return int(self.before[slot]) if at >= forward else at

    @staticmethod
    def window(step: Step, part: int, cursor: int, content_slots: int | None) -> np.ndarray:
        """The slots a verify of ``step``'s reads (``part``: :data:`kvcanary.ops.ALL`, or those before
        or after its own writes) fingerprints: the window of ``content_slots`` read entries (every
        one for ``None``) from ``cursor`` modulo the reads, as the ops take it. Host numpy on a CPU
        step; nothing per read slot beyond the window."""
        cached = step.cached_lens.numpy().astype(np.int64)
        start = np.zeros_like(cached) if step.read_starts is None else step.read_starts.numpy().astype(np.int64)
        if part != ALL and step.written_from is not None:  # Step.split_reads, on the host
            e = np.minimum(np.maximum(step.written_from.numpy().astype(np.int64), start), cached)
            cached, start = (e, start) if part == BEFORE_WRITES else (cached, e)
        counts = np.where(step.valid_rows().numpy(), cached - start, 0).clip(min=0)
        n = int(counts.sum())
        if n == 0 or content_slots == 0:
            return np.empty(0, dtype=np.int64)
        k = n if content_slots is None else min(content_slots, n)
        entry = (cursor % n + np.arange(k)) % n
        ends = np.cumsum(counts)
        row = np.searchsorted(ends, entry, side="right")
        pos = start[row] + entry - (ends - counts)[row]
        trow = row if step.table_rows is None else step.table_rows.numpy()[row]
        table = step.table.numpy()
        if step.slot_table is not None:
            return table[trow, np.minimum(pos, table.shape[1] - 1)].astype(np.int64)
        bs = step.block_size
        return table[trow, np.minimum(pos // bs, table.shape[1] - 1)].astype(np.int64) * bs + pos % bs


class HarmCounter:
    """The tokens each request sampled in each recent forward, and the harmful ones among them."""

    def __init__(self, keep: int = 4096) -> None:
        self.sampled: dict[str, collections.deque[tuple[int, int]]] = {}
        self.keep = keep
        self.harmful = 0

    def forward(self, forward: int, sampled: dict[str, int]) -> None:
        """Request id -> tokens it sampled in ``forward``."""
        for rid, n in sampled.items():
            if n:
                self.sampled.setdefault(rid, collections.deque(maxlen=self.keep)).append((forward, n))

    def forget(self, rid: str) -> None:
        self.sampled.pop(rid, None)

    def count(self, found: list[Violation], ledger_of: dict[str | None, CheckLedger | None], healed: bool) -> int:
        """Add the harmful tokens of one forward's reported violations (``ledger_of``: the ledger of
        each violation's group); returns the forward's count."""
        spans: dict[str, tuple[int, int]] = {}  # request -> (first harmful forward, reporting forward)
        for v in found:
            if v.request is None or v.step < 0:
                continue
            first = v.step if not healed else v.step + 1
            if v.checks & Check.CONTENT:
                ledger = ledger_of.get(v.group)
                if ledger is not None:
                    good = ledger.last_good(v.slot, v.step, read=v.site in (Site.VERIFY, Site.FIRST_READ))
                    first = min(first, good + 1) if good >= 0 else first
            lo, hi = spans.get(v.request, (first, v.step))
            spans[v.request] = (min(lo, first), max(hi, v.step))
        n = 0
        for rid, (lo, hi) in spans.items():
            last = hi if not healed else hi - 1
            n += sum(k for f, k in self.sampled.get(rid, ()) if lo <= f <= last)
        self.harmful += n
        return n
