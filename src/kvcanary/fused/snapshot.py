"""The reserved slots' bytes as a snapshot: the fused guard's fast path.

Every forward, the guard re-fingerprints each reserved slot (:mod:`kvcanary.guards`): on vLLM's CPU
pools that is the whole null block of every layer, K read element by element. Nothing writes
there, so the fused path first compares those bytes with a copy taken when the fingerprints were
last taken: equal bytes give equal fingerprints, and only a change (rare: a fault) runs the
per-slot check, which finds and records the changed slots as before, and then takes a new copy.
The result is the per-slot check's, bit for bit; only its cost changes.

Where every byte of the copy is zero (vLLM allocates its pools zeroed, and its null block stays so),
the copy says so in its first word (:data:`HEADER`) and the comparison reads the live bytes only,
each against zero: half the bytes the comparison of two copies reads, the guard's largest cost
(737 KB of a 30-layer model's null block each forward).

:func:`regions` covers every byte the fingerprint of a reserved slot reads (per slot and source,
the span from its first to its last byte, merged); a snapshot is used only where those spans hold
at most twice the bytes the fingerprints read, so a reserved slot whose span crosses live KV never
makes every forward compare and copy it for nothing.
"""

from __future__ import annotations

import numpy as np
from numba import carray

from kvcanary.fused._core import JIT, i64_pointer, ld_i64, ld_u8, prefetch, st_i64, st_u8
from kvcanary.fused.fold import A_RUN0, A_RUNW, A_WIDTH, A_WORDS, SourceTable, slot_base
from kvcanary.fused.cache import njit

R_ADDR, R_LEN, R_AT = range(3)  # a region: its address, its length, its offset in the snapshot's bytes
HEADER = 8  # the snapshot's first word (1: every byte of it is zero); its bytes follow
NO_REGIONS = np.zeros((0, 3), dtype=np.int64)
_CHUNK = 64  # words compared between two tests in same()
# bytes ahead of the comparison hinted into the caches, one line a chunk, and of the next region's first:
# the hardware's own fetching ahead stops at each 4 KiB page, and a cold page's first load waits on
# its translation too (a 30-layer null block: 30 regions of 24 KiB in as many tensors)
_AHEAD_BYTES = 8192


def _spans(table: SourceTable, slots: np.ndarray) -> np.ndarray:
    """``[n * sources, 2]``: each slot's first byte and end byte in each source, as the slot's
    fingerprint reads it (:func:`kvcanary.fused.fold.fold_slot`)."""
    out = []
    src, runs = table.src, table.runs
    for i in range(src.shape[0]):
        s = src[i]
        base = slot_base(s, slots)
        words = int(s[A_WORDS])
        if s[A_WIDTH]:  # a narrow element per word, each at its own run offset
            offs = runs[s[A_RUN0]: s[A_RUN0] + words]
            lens = np.full(words, s[A_WIDTH], dtype=np.int64)
        else:  # runs of A_RUNW 8-byte words, the last one shorter
            rw = int(s[A_RUNW])
            nruns = -(-words // rw)
            offs = runs[s[A_RUN0]: s[A_RUN0] + nruns]
            lens = np.full(nruns, 8 * rw, dtype=np.int64)
            lens[-1] = 8 * (words - (nruns - 1) * rw)
        if not words:
            continue
        lo, hi = int(offs.min()), int((offs + lens).max())
        out.append(np.stack([base + lo, base + hi], axis=1))
    return np.concatenate(out) if out else np.zeros((0, 2), dtype=np.int64)


def regions(table: SourceTable, slots: np.ndarray, bytes_per_slot: int) -> np.ndarray:
    """The snapshot's regions (``[R, 3]``: address, length, offset in the snapshot) covering every
    byte the fingerprints of ``slots`` read, or none (:data:`NO_REGIONS`) where their spans would
    hold more than twice those bytes."""
    spans = _spans(table, np.asarray(slots, dtype=np.int64))
    if not spans.shape[0] or not bytes_per_slot:
        return NO_REGIONS
    spans = spans[np.argsort(spans[:, 0], kind="stable")]
    ends = np.maximum.accumulate(spans[:, 1])
    starts_new = np.ones(spans.shape[0], dtype=bool)
    starts_new[1:] = spans[1:, 0] > ends[:-1]
    lo = spans[starts_new, 0]
    hi = np.maximum.reduceat(spans[:, 1], np.nonzero(starts_new)[0])
    lens = hi - lo
    if int(lens.sum()) > 2 * len(slots) * bytes_per_slot:
        return NO_REGIONS
    at = np.concatenate([[0], np.cumsum(-(-lens // 8) * 8)[:-1]])  # 8-byte aligned copies (same() reads words)
    return np.stack([lo, lens, at], axis=1).astype(np.int64)


@njit(inline="always", **JIT)
def _region(regions, r, snap):  # type: ignore[no-untyped-def]
    """Region ``r``'s address, length and its copy's address in the snapshot."""
    row = regions + 24 * r
    return ld_i64(row + 8 * R_ADDR), ld_i64(row + 8 * R_LEN), snap + HEADER + ld_i64(row + 8 * R_AT)


@njit(inline="always", **JIT)
def same(regions, n, snap):  # type: ignore[no-untyped-def]
    """Whether the ``n`` regions (at address ``regions``) hold the snapshot's bytes (at ``snap``): each
    byte against zero where the snapshot is all zeros (its :data:`HEADER` word says so), else
    against its copy; the bytes two pages ahead hinted into the caches as it goes."""
    zero = ld_i64(snap) == 1
    for r in range(n):
        a, length, b = _region(regions, r, snap)
        if r + 1 < n:  # the next region's first pages, while this one is compared
            a1, length1, b1 = _region(regions, r + 1, snap)
            for o in range(0, min(length1, _AHEAD_BYTES), 8 * _CHUNK):
                prefetch(a1 + o)
                if not zero:
                    prefetch(b1 + o)
        words = length // 8
        # a chunk's differences OR-ed together, one test a chunk, over arrays: a loop the compiler
        # vectorises (an exit per word, or loads through raw addresses, it runs word by word)
        if a % 8 or b % 8:  # unaligned words: one at a time, through loads that take any address
            for j in range(words):
                if ld_i64(a + 8 * j) != (0 if zero else ld_i64(b + 8 * j)):
                    return False
            words = 0
        x, y = carray(i64_pointer(a), words), carray(i64_pointer(b), words)
        for c in range(0, words - words % _CHUNK, _CHUNK):
            prefetch(a + 8 * c + _AHEAD_BYTES)
            if not zero:
                prefetch(b + 8 * c + _AHEAD_BYTES)
            diff = np.int64(0)
            if zero:
                for j in range(c, c + _CHUNK):
                    diff |= x[j]
            else:
                for j in range(c, c + _CHUNK):
                    diff |= x[j] ^ y[j]
            if diff != 0:
                return False
        for j in range(words - words % _CHUNK, words):
            if x[j] != (0 if zero else y[j]):
                return False
        for j in range(8 * (length // 8), length):
            if ld_u8(a + j) != (0 if zero else ld_u8(b + j)):
                return False
    return True


@njit(inline="always", **JIT)
def take(regions, n, snap):  # type: ignore[no-untyped-def]
    """Copy the ``n`` regions' bytes into the snapshot, and say in its :data:`HEADER` word whether
    they are all zero."""
    any_set = np.int64(0)
    for r in range(n):
        a, length, b = _region(regions, r, snap)
        for j in range(length // 8):
            w = ld_i64(a + 8 * j)
            st_i64(b + 8 * j, w)
            any_set |= w
        for j in range(8 * (length // 8), length):
            u = ld_u8(a + j)
            st_u8(b + j, u)
            any_set |= u
    st_i64(snap, 1 if any_set == 0 else 0)


def taken(regions_: np.ndarray) -> np.ndarray:
    """A new snapshot of the regions' bytes (host side, when the guard's fingerprints are first taken):
    its :data:`HEADER` word, then the bytes (region ``r``'s from ``HEADER + regions_[r, R_AT]``)."""
    import ctypes

    size = int((regions_[:, R_AT] + regions_[:, R_LEN]).max(initial=0))
    snap = np.zeros(HEADER + max(size, 1), dtype=np.uint8)
    for addr, length, at in regions_.tolist():
        ctypes.memmove(snap.ctypes.data + HEADER + at, addr, length)
    snap[:HEADER].view(np.int64)[0] = 1 if not snap[HEADER:].any() else 0
    return snap
