"""Step pieces for engine adapters on CPU pools, as compiled loops, each equal to the torch
construction it replaces: where each row's reads of this step's own writes start
(:func:`kvcanary.engines.block_table.written_from`, vLLM), and each written slot's last writer; and
the step's value check (:func:`validate`: :meth:`kvcanary.step.Step.validate_values` in one pass)."""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.errors import KvCanaryError
from kvcanary.fused._core import JIT
from kvcanary.fused._step import (BSIZE, CL, ER, ET, IS_BLOCK, NNEW, NO, NP, NROWS, NS, RS, SPAN, TAB, TR, describe,
                                  lookup, rd, rd2, start, table_row, valid)
from kvcanary.fused.cache import njit
from kvcanary.step import Step


@njit(**JIT)
def _written_from(d, out):  # type: ignore[no-untyped-def]
    nnew = d[NNEW]
    new = np.empty(nnew, dtype=np.int64)
    m = 0
    for t in range(nnew):
        s = rd(d, NS, t)
        if s >= 0:
            new[m] = s
            m += 1
    new = np.sort(new[:m])
    bs = d[BSIZE]
    # the blocks holding a written slot, marked by block number: a row's table entries are checked
    # with one load each, and only a marked block is searched for the slot
    nmark = new[m - 1] // bs + 1 if m and d[IS_BLOCK] != 0 else 0
    marked = np.zeros(nmark, dtype=np.uint8)
    if nmark:
        for i in range(m):
            marked[new[i] // bs] = 1
    for r in range(d[NROWS]):
        cached = rd(d, CL, r)
        lo = max(start(d, r), 0)  # positions before the row's read window are not read
        first = cached
        if d[IS_BLOCK] != 0:
            for c in range(lo // bs, (max(cached, 0) + bs - 1) // bs):
                s = lookup(d, r, c * bs)  # the block's first slot; a negative one holds no written slot
                if s < 0 or s // bs >= nmark or marked[s // bs] == 0:
                    continue
                i = np.searchsorted(new, s + max(0, lo - c * bs))
                if i < m and new[i] < s + bs:
                    pos = c * bs + (new[i] - s)
                    if pos < cached:
                        first = pos
                        break
        else:
            for p in range(lo, max(cached, 0)):
                s = lookup(d, r, p)
                i = np.searchsorted(new, s)
                if s >= 0 and i < m and new[i] == s:
                    first = p
                    break
        out[r] = first


def written_from(step: Step, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`kvcanary.engines.block_table.written_from` on a CPU step: per row, the first position of its
    read window whose slot this step writes (``cached_len`` if none), by one pass over each row's table
    entries against the sorted written slots. ``out``: int64 ``[R]`` to fill (it may be the step's own
    ``written_from``, which the pass does not read: the step's checked shapes and descriptor stay)."""
    step.validate_shapes()
    if out is None:
        out = torch.empty(step.num_rows, dtype=torch.int64)
    _written_from(describe(step), out.numpy())
    return out


@njit(**JIT)
def _note_writers(d, writers, num_slots, step_id):  # type: ignore[no-untyped-def]
    for r in range(d[NROWS]):
        if not valid(d, r):
            continue
        for t in range(rd(d, NO, r), rd(d, NO, r + 1)):
            s = rd(d, NS, t)
            if 0 <= s < num_slots:
                writers[s, 0] = step_id
                writers[s, 1] = r


def note_writers(step: Step, writers: torch.Tensor, num_slots: int, step_id: int) -> None:
    """Record ``step_id`` and the step row as the last writer of every slot the step wrote
    (``writers``: int64 ``[num_slots + 1, 2]``)."""
    _note_writers(describe(step), writers.numpy(), num_slots, step_id)


@njit(**JIT)
def values_bad(d, num_slots):  # type: ignore[no-untyped-def]
    """0 when :meth:`kvcanary.step.Step.validate_values` would pass, else 1 (no message: the torch
    check runs again to word it)."""
    nrows, nnew = d[NROWS], d[NNEW]
    if rd(d, NO, 0) != 0 or rd(d, NO, nrows) != nnew:
        return 1
    span_max = d[SPAN]
    bs = d[BSIZE]
    for r in range(nrows):
        cnt = rd(d, NO, r + 1) - rd(d, NO, r)
        cached = rd(d, CL, r)
        if cnt < 0 or cached < 0:
            return 1
        ok = valid(d, r)
        span = cached + cnt
        if ok and span > span_max:
            return 1
        lo = 0
        if d[RS] != 0:
            lo = rd(d, RS, r)
            if lo < 0 or lo > cached or not (lo < cached or cached == 0 or cnt == 0 or not ok):
                return 1
        if d[TR] != 0:
            t = rd(d, TR, r)
            if t < 0 or t >= d[TAB + 4]:
                return 1
        if d[ER] != 0:
            t = rd(d, ER, r)
            if t < 0 or t >= d[ET + 4]:
                return 1
        if d[IS_BLOCK] != 0 and ok:
            t = table_row(d, r)
            for c in range(lo // bs, min(d[TAB + 5], (span + bs - 1) // bs)):
                first = c * bs
                last_off = min(span, first + bs) - 1 - first
                limit = (num_slots - 1 - last_off) // bs
                e = rd2(d, TAB, t, c)
                if e < 0 or e > limit:
                    return 1
    for t in range(nnew):
        if rd(d, NS, t) >= num_slots or rd(d, NP, t) < 0:
            return 1
    return 0


def validate(step: Step, num_slots: int) -> None:
    """:meth:`kvcanary.step.Step.validate_values` at the cost of one pass over the step's rows; on
    a bad value the torch check runs to word the error."""
    if values_bad(describe(step), num_slots):
        step.validate_values(num_slots)
        raise KvCanaryError("kvcanary internal error: the fused step check refused a step the torch check accepts")
