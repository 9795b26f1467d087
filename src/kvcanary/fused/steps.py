"""Step building for engine adapters on CPU pools, as compiled loops: the slot table of a forward
from the engine's flat read and write indices (transformers continuous batching), bit for bit the
torch construction in :func:`kvcanary.engines.transformers_steps.build_steps`."""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcanary.fused._core import JIT


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
def book_window(buf, rows, upto, out):  # type: ignore[no-untyped-def]
    """``out[i, p] = buf[rows[i], p]`` for ``p < upto[i]``, else -1 (:class:`kvcanary.engines.token_book.TokenBook`)."""
    for i in range(rows.shape[0]):
        u = min(upto[i], out.shape[1])
        for p in range(out.shape[1]):
            out[i, p] = buf[rows[i], p] if p < u else -1


@njit(**JIT)
def book_write(buf, rr, pp, vals):  # type: ignore[no-untyped-def]
    for i in range(rr.shape[0]):
        buf[rr[i], pp[i]] = vals[i]
