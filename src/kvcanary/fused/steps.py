"""Step pieces for engine adapters on CPU pools, as compiled loops, each equal to the torch
construction it replaces: where each row's reads of this step's own writes start
(:func:`kvcanary.engines.block_table.written_from`, vLLM), and each written slot's last writer."""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.fused._core import JIT
from kvcanary.fused._step import BSIZE, CL, IS_BLOCK, NNEW, NO, NROWS, NS, describe, lookup, rd, start, valid
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
