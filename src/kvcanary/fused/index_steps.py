"""Steps from index lists, as compiled loops: transformers continuous batching's read and write
indices (physical token rows, one list per layer group) and its batch's lengths and token ids,
into the step buffers of :class:`kvcanary.engines.transformers.compiled.StepBuilder`.

The physical rows are compacted into the canary's slots as
:class:`kvcanary.geometry.token_pages.TokenPages` numbers them, ``(i // block_stride) *
tokens_per_page + i % block_stride``, with the group's numbers passed in (the tests hold both
against each other).
"""

from __future__ import annotations

import numpy as np

from kvcanary.fused._core import JIT
from kvcanary.fused.cache import njit


@njit(**JIT)
def fill_common(q, past, book, book_rows, cu_src, tok_src, pos_src, cu, tokens, positions, erows, exp_new):  # type: ignore[no-untyped-def]
    """The fields every group's step shares: ``cu`` (int64 ``[R + 1]``), ``tokens`` and ``positions``
    (``[T]``) copied from the batch's own tensors; with a token book (``erows`` has rows), each
    row's row of the book in ``erows`` and each new token's expected token in ``exp_new``."""
    r = q.shape[0]
    for i in range(r + 1):
        cu[i] = cu_src[i]
    for t in range(tokens.shape[0]):
        tokens[t] = tok_src[t]
        positions[t] = pos_src[t]
    if erows.shape[0] == 0:
        return
    width = book.shape[1]
    t = 0
    for row in range(r):
        b = book_rows[row]
        erows[row] = b
        for j in range(q[row]):
            pos = past[row] + j
            exp_new[t] = book[b, pos] if pos < width else -1
            t += 1


@njit(**JIT)
def fill_group(read, cu_k, q, past, write, stride, tpp, trash, table, starts, wslot):  # type: ignore[no-untyped-def]
    """One group's slot table (int32 or int64 ``[R + 1, width + 1]``; row ``R`` and column ``width`` are
    scratch), read starts and new tokens' slots, from its read index (row ``r``'s reads at
    ``cu_k[r] .. cu_k[r + 1]``, its cached positions first) and write index (one entry per new
    token). Physical indices are compacted to ``(i // stride) * tpp + i % stride``; a write to the
    trash index is padding (-1)."""
    r = past.shape[0]
    width = table.shape[1] - 1
    table[r, :] = -1
    nread = read.shape[0]
    for row in range(r):
        nc = 0
        if nread:
            nc = cu_k[row + 1] - cu_k[row] - q[row]
        lo = past[row] - nc
        starts[row] = lo
        # -1 outside the positions filled below (each entry written once)
        for pos in range(0, min(max(lo, 0), width + 1)):
            table[row, pos] = -1
        for pos in range(max(past[row] + q[row], 0), width + 1):
            table[row, pos] = -1
        base = cu_k[row]
        # a page's entries are consecutive indices: the compact slot then moves on by one, and the
        # divisions are done only where a run of them starts
        prev = np.int64(-2)
        rem = c = np.int64(0)
        for j in range(nc):
            e = base + j
            pos = lo + j
            if 0 <= pos <= width:
                if e < nread:
                    p = np.int64(read[e])
                    if p == prev + 1 and rem + 1 < stride:
                        rem += 1
                        c += 1
                    else:
                        blk = p // stride
                        rem = p - blk * stride
                        c = blk * tpp + rem
                    prev = p
                    table[row, pos] = c
                else:
                    table[row, pos] = -1
    t = 0
    for row in range(r):
        for j in range(q[row]):
            p = np.int64(write[t])
            s = np.int64(-1) if p == trash else (p // stride) * tpp + p % stride
            wslot[t] = s
            table[row, min(past[row] + j, width)] = s
            t += 1
