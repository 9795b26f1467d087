"""Step building for engine adapters on CPU pools, as compiled loops, each equal to the torch
construction it replaces: the slot table of a forward from the engine's flat read and write indices
(transformers continuous batching, :func:`kvcanary.engines.transformers_steps.build_steps`), and where each row's reads of this step's own writes start
(:func:`kvcanary.engines.base.written_from`, vLLM)."""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.fused._core import JIT
from kvcanary.fused._step import BSIZE, CL, IS_BLOCK, NNEW, NO, NROWS, NS, describe, lookup, rd, start, valid
from kvcanary.fused.cache import njit
from kvcanary.step import Step


@njit(**JIT)
def rows_table(read, cu_k, q, past, write, stride, tpp, trash, table, ncached, wslot, exp, exp_new):  # type: ignore[no-untyped-def]
    """Fill ``table`` (int64 ``[R + 1, width + 1]``, row ``R`` and column ``width`` scratch) with the
    compact slot of every cached read and every write of the forward, ``ncached`` with each row's
    cached reads, ``wslot`` with each new token's slot (-1 for the trash slot) and, when ``exp`` has
    rows, ``exp_new`` with each new token's expected token.

    ``read``: the group's read index (reads of row ``r`` at ``cu_k[r] .. cu_k[r + 1]``, its cached
    positions first); ``q``, ``past``: each row's new and cached tokens (host lengths); ``write``:
    the group's write index, one entry per new token in row order. Physical indices are compacted
    to ``(i // stride) * tpp + i % stride``.
    """
    r = past.shape[0]
    width = table.shape[1] - 1
    table[:] = -1
    nread = read.shape[0]
    for row in range(r):
        nc = 0
        if nread:
            nc = cu_k[row + 1] - cu_k[row] - q[row]
        ncached[row] = nc
        base = cu_k[row]
        for j in range(nc):
            e = base + j
            pos = past[row] - nc + j
            if e < nread and 0 <= pos <= width:
                p = np.int64(read[e])
                table[row, pos] = (p // stride) * tpp + p % stride
    t = 0
    for row in range(r):
        for j in range(q[row]):
            p = np.int64(write[t])
            s = np.int64(-1) if p == trash else (p // stride) * tpp + p % stride
            wslot[t] = s
            pos = past[row] + j
            table[row, pos] = s
            if exp.shape[0]:
                exp_new[t] = exp[row, pos]
            t += 1


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
    for r in range(d[NROWS]):
        cached = rd(d, CL, r)
        lo = max(start(d, r), 0)  # positions before the row's read window are not read
        first = cached
        if d[IS_BLOCK] != 0:
            for c in range(lo // bs, (max(cached, 0) + bs - 1) // bs):
                s = lookup(d, r, c * bs)  # the block's first slot; a negative one holds no written slot
                if s < 0:
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


def written_from(step: Step) -> torch.Tensor:
    """:func:`kvcanary.engines.base.written_from` on a CPU step: per row, the first position of its
    read window whose slot this step writes (``cached_len`` if none), by one pass over each row's table
    entries against the sorted written slots."""
    step.validate_shapes()
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
