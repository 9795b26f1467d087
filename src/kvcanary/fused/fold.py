"""A cache layout as a table the compiled loops read, and the content fingerprint's folds over it.

:class:`SourceTable` flattens a :class:`~kvcanary.layout.KvLayout` into int64 arrays (per source: its
storage's address, page and pack geometry, the byte offsets of its runs, its words' keys, its lane
chunks); the folds add up a slot's words, each mixed with its key (:mod:`kvcanary.hashing`'s
formulas on uint64): one slot and source (:func:`fold_source`), many neighbouring slots at once
(:func:`fold_run`, :func:`fold_slots`), a computed row (:func:`fold_row`), a pack's lanes
(:func:`fold_lanes`, :func:`fold_pair`). The folds over every source hint the next source's lines
into the caches while they fold one (:func:`prefetch_slot`): a cold pool's lines then come in side
by side, not one wait on memory after another.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray

from kvcanary import hashing
from kvcanary.fused._core import (JIT, finish_content, ld_w64, ld_word, prefetch_bytes, u8_pointer, u16_pointer,
                                  u32_pointer, u64_pointer, wmix)
from kvcanary.fused.cache import njit
from kvcanary.layout import KvLayout

# per source: address of its storage + offset, page_size, page_stride, pack (slots), pack_stride,
# token_stride (bytes), width (0: wide 8-byte words, else the narrow element's bytes), words read,
# words per run (wide), first run offset's index in ``runs``, first key's index in ``keys``, and
# its lane chunks (see pack_chunks): the first one's index in ``runs`` and their count (0: none), and
# its byte spans (see byte_spans): the first one's index in ``runs`` and their count
(A_ADDR, A_PS, A_PGS, A_PACK, A_PKS, A_TKS, A_WIDTH, A_WORDS, A_RUNW, A_RUN0, A_KEY0, A_CHUNK0, A_CHUNKS,
 A_SPAN0, A_SPANS) = range(15)
NUM_SRC_FIELDS = 15


class SourceTable:
    """A layout as flat int64 arrays for the compiled loops (built once per canary).

    ``src`` is ``[num_sources, NUM_SRC_FIELDS]``; ``runs`` the byte offsets of each source's runs
    from its slot's first byte, in word order, then (from ``A_CHUNK0``) its lane chunks as pairs of
    first word and word count (:func:`pack_chunks`), then (from ``A_SPAN0``) the spans of bytes its
    runs lie in, as pairs of first and end byte from the slot's first (:func:`byte_spans`); ``keys``
    every source's word keys in layout order. The table holds references to the engine's tensors, so
    their storage outlives it.
    """

    def __init__(self, layout: KvLayout, device: torch.device | str = "cpu") -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"the fused path runs on CPU pools, got device {device}")
        rows: list[list[int]] = []
        runs: list[int] = []
        keys: list[int] = []  # each source's words: their keys made in one pass
        nkeys = 0
        chunks: list[list[int]] = []
        spans: list[list[int]] = []
        for i, s in enumerate(layout.sources):
            offs = s.run_offsets().tolist()
            width = s.row_bytes if s.narrow else 0
            nruns = s.read_runs if s.narrow else -(-s.read_words // (s.row_bytes // 8))
            base = s.tensor.untyped_storage().data_ptr() + s.offset
            rows.append([base, s.page_size, s.page_stride, s.pack, s.pack_stride, s.token_stride, width,
                         s.read_words, 1 if s.narrow else s.row_bytes // 8, len(runs), nkeys, 0, 0, 0, 0])
            runs += offs[:nruns]
            keys.append(s.read_words)
            nkeys += s.read_words
            chunks.append(pack_chunks(offs[:nruns], width, s.pack, s.token_stride) if s.narrow else [])
            spans.append(byte_spans(offs[:nruns], width or s.row_bytes))
        for row, cs, sp in zip(rows, chunks, spans):  # after every source's runs (source i's start at A_RUN0)
            row[A_CHUNK0], row[A_CHUNKS] = len(runs), len(cs) // 2
            runs += cs
            row[A_SPAN0], row[A_SPANS] = len(runs), len(sp) // 2
            runs += sp
        self.src = np.array(rows, dtype=np.int64).reshape(-1, NUM_SRC_FIELDS)
        self.runs = np.array(runs + [0], dtype=np.int64)
        self.keys = np.append(hashing.all_word_keys(keys).numpy(), np.int64(0)).view(np.uint64)
        self.count = len(layout.sources)
        self.bytes_per_slot = layout.content_bytes_per_slot
        self._tensors = [s.tensor for s in layout.sources]  # keeps the storages alive


CHUNK_MIN = 4  # words a lane chunk averages at least (fewer: a source is folded element by element)


def pack_chunks(offsets: list[int], width: int, pack: int, token_stride: int) -> list[int]:
    """A narrow source's words as lane chunks, flat pairs of (first word, word count): where a pack's
    slots' elements of a word lie side by side and fill 4 or 8 bytes (``token_stride == width``,
    ``pack * width`` 4 or 8: vLLM's ``amx`` V, two tokens' bf16 elements in 4 bytes), a chunk is a run
    of words each ``pack * width`` bytes after the one before: one word of 4 or 8 bytes holds an
    element of every slot of the pack (slot ``k`` of the pack in lane ``k``), and a chunk is a loop
    over contiguous words the compiler vectorises (:func:`fold_lanes`). Empty where the layout is not
    such, or its chunks average fewer than :data:`CHUNK_MIN` words."""
    step = pack * width
    if pack < 2 or token_stride != width or step not in (4, 8) or not offsets:
        return []
    out, j0 = [], 0
    for j in range(1, len(offsets) + 1):
        if j == len(offsets) or offsets[j] - offsets[j - 1] != step:
            out += [j0, j - j0]
            j0 = j
    return out if len(offsets) >= CHUNK_MIN * (len(out) // 2) else []


def byte_spans(offsets: list[int], run_bytes: int) -> list[int]:
    """The bytes a slot's runs (``run_bytes`` each from ``offsets``) lie in, from its first byte, as flat
    pairs of first and end byte, runs less than a cache line apart in one span: the lines
    :func:`prefetch_slot` hints, without a look at each run."""
    out: list[int] = []
    for a in sorted(offsets):
        if out and a - out[-1] < _LINE:
            out[-1] = max(out[-1], a + run_bytes)
        else:
            out += [a, a + run_bytes]
    return out


_LINE = 64  # bytes of a cache line


@njit(inline="always", **JIT)
def _pack_base(src, i, slot):  # type: ignore[no-untyped-def]
    """The first byte of ``slot``'s pack in source ``i``, and the slot's place in it."""
    ps, pack = src[i, A_PS], src[i, A_PACK]
    page = slot // ps
    inpage = slot - page * ps
    return src[i, A_ADDR] + page * src[i, A_PGS] + (inpage // pack) * src[i, A_PKS], inpage % pack


@njit(inline="always", **JIT)
def prefetch_slot(src, runs, i, slot):  # type: ignore[no-untyped-def]
    """Hint into the caches the lines source ``i``'s part of ``slot``'s fingerprint reads
    (:func:`prefetch_lines`). Called a source ahead of the fold, they come in while another source
    is folded, not one wait on memory after another (every source is its own tensor, and a slot's
    words lie in many lines: an ``amx`` K row of a token in 32). Its tables (keys, run offsets) are
    left to the hardware, which fetches ahead on reads in order (hinting them measured no faster)."""
    group, lane = _pack_base(src, i, slot)
    prefetch_lines(src, runs, i, group + lane * src[i, A_TKS])


@njit(inline="always", **JIT)
def prefetch_slots(src, runs, i, slots, m):  # type: ignore[no-untyped-def]
    """:func:`prefetch_slot` for the first ``m`` of ``slots`` (-1: none), a pack's lines once where its
    slots' elements lie side by side (they share them)."""
    tks = src[i, A_TKS]
    side = src[i, A_WIDTH] != 0 and tks == src[i, A_WIDTH]
    last = np.int64(-1)
    for j in range(m):
        if slots[j] < 0:
            continue
        group, lane = _pack_base(src, i, slots[j])
        if not side:
            prefetch_lines(src, runs, i, group + lane * tks)
        elif group != last:
            prefetch_lines(src, runs, i, group)
        last = group


@njit(inline="always", **JIT)
def prefetch_lines(src, runs, i, base):  # type: ignore[no-untyped-def]
    """Hint into the caches the lines of source ``i``'s part of the slot whose first byte is ``base``
    (its byte spans, :func:`byte_spans`)."""
    p = src[i, A_SPAN0]
    for k in range(src[i, A_SPANS]):
        prefetch_bytes(base + runs[p + 2 * k], runs[p + 2 * k + 1] - runs[p + 2 * k])


@njit(inline="always", **JIT)
def fold_lanes(src, runs, keys, i, base, lane):  # type: ignore[no-untyped-def]
    """Source ``i``'s part of one slot's fingerprint by its lane chunks (:func:`pack_chunks`):
    ``base`` is the slot's pack's first byte, ``lane`` the slot's place in the pack. The same sum as
    element by element."""
    acc = np.uint64(0)
    width, pack = src[i, A_WIDTH], src[i, A_PACK]
    shift = np.uint64(8 * width * lane)
    mask = np.uint64((1 << (8 * width)) - 1)
    r, k0, c0 = src[i, A_RUN0], src[i, A_KEY0], src[i, A_CHUNK0]
    for c in range(src[i, A_CHUNKS]):
        j0, n = runs[c0 + 2 * c], runs[c0 + 2 * c + 1]
        a = base + runs[r + j0]
        ks = carray(u64_pointer(keys.ctypes.data + 8 * (k0 + j0)), n)
        if pack * width == 4:
            w4 = carray(u32_pointer(a), n)
            for p in range(n):
                acc += wmix(((np.uint64(w4[p]) >> shift) & mask) ^ ks[p])
        else:
            w8 = carray(u64_pointer(a), n)
            for p in range(n):
                acc += wmix(((w8[p] >> shift) & mask) ^ ks[p])
    return acc


@njit(inline="always", **JIT)
def fold_pair(src, runs, keys, i, base):  # type: ignore[no-untyped-def]
    """:func:`fold_lanes` of both slots of a pack of two 2-byte elements (``pack * width == 4``,
    ``width == 2``: vLLM's ``amx`` V) in one pass over its words: the two sums."""
    lo, hi = np.uint64(0), np.uint64(0)
    mask, half = np.uint64(0xFFFF), np.uint64(16)
    r, k0, c0 = src[i, A_RUN0], src[i, A_KEY0], src[i, A_CHUNK0]
    for c in range(src[i, A_CHUNKS]):
        j0, n = runs[c0 + 2 * c], runs[c0 + 2 * c + 1]
        w4 = carray(u32_pointer(base + runs[r + j0]), n)
        ks = carray(u64_pointer(keys.ctypes.data + 8 * (k0 + j0)), n)
        for p in range(n):
            x = np.uint64(w4[p])
            lo += wmix((x & mask) ^ ks[p])
            hi += wmix((x >> half) ^ ks[p])
    return lo, hi


def slot_base(src_row: np.ndarray, slots: np.ndarray | int) -> np.ndarray | int:
    """The address of the first byte of each of ``slots`` in the source of table row ``src_row`` (host
    side; :func:`fold_source` computes the same)."""
    page, inpage = slots // src_row[A_PS], slots % src_row[A_PS]
    return (src_row[A_ADDR] + page * src_row[A_PGS] + (inpage // src_row[A_PACK]) * src_row[A_PKS]
            + (inpage % src_row[A_PACK]) * src_row[A_TKS])


@njit(inline="always", **JIT)
def fold_row(addr, width, keys, k0, n):  # type: ignore[no-untyped-def]
    """The fingerprint sum of ``n`` contiguous words of ``width`` bytes (8: a wide word, else a narrow
    element) at ``addr``, word ``p`` keyed by ``keys[k0 + p]``: a run of a slot's wide words
    (:func:`fold_source`), or a copy of a source's words in another order whose keys were put in that
    order (:func:`kvcanary.engines.vllm.fold.row_keys`). Arrays over the words and their keys: the
    loop vectorises (loads through raw addresses do not), about four times as fast."""
    acc = np.uint64(0)
    ks = carray(u64_pointer(keys.ctypes.data + 8 * k0), n)
    if width == 8:
        c8 = carray(u64_pointer(addr), n)
        for p in range(n):
            acc += wmix(c8[p] ^ ks[p])
    elif width == 2:
        c2 = carray(u16_pointer(addr), n)
        for p in range(n):
            acc += wmix(np.uint64(c2[p]) ^ ks[p])
    elif width == 4:
        c4 = carray(u32_pointer(addr), n)
        for p in range(n):
            acc += wmix(np.uint64(c4[p]) ^ ks[p])
    else:
        c1 = carray(u8_pointer(addr), n)
        for p in range(n):
            acc += wmix(np.uint64(c1[p]) ^ ks[p])
    return acc


@njit(inline="always", **JIT)
def fold_source(src, runs, keys, i, slot):  # type: ignore[no-untyped-def]
    """Source ``i``'s part of one slot's fingerprint (``0 <= slot < num_slots``): its words' sum,
    unfinished. The parts of a slot's sources add up (mod 2**64) in any order, so they may be folded
    at different times (:func:`kvcanary.fused.keep.keep_layer` folds each layer's as it writes)."""
    acc = np.uint64(0)
    group, lane = _pack_base(src, i, slot)
    if src[i, A_CHUNKS]:
        return fold_lanes(src, runs, keys, i, group, lane)
    base = group + lane * src[i, A_TKS]
    width = src[i, A_WIDTH]
    left = src[i, A_WORDS]
    r = src[i, A_RUN0]
    k0 = src[i, A_KEY0]
    if width == 0:
        rw = src[i, A_RUNW]
        while left > 0:
            nw = min(rw, left)
            acc += fold_row(base + runs[r], 8, keys, k0, nw)  # a run's words are contiguous
            k0 += nw
            left -= nw
            r += 1
    else:
        # the keys through a raw address: an array index the compiler cannot prove non-negative
        # keeps the loop scalar (half the speed)
        kp = keys.ctypes.data + 8 * k0
        for j in range(left):
            acc += wmix(ld_word(base + runs[r + j], width) ^ ld_w64(kp + 8 * j))
    return acc


@njit(inline="always", **JIT)
def fold_run(src, runs, keys, i, slot, count, acc):  # type: ignore[no-untyped-def]
    """Source ``i``'s parts of ``count`` neighbouring slots from ``slot`` on, added into ``acc[:count]``:
    a narrow source whose slots' elements lie side by side (a column-major K: token stride = the
    element's width) and slots in one pack of one page. Element by element across the slots, a loop
    the compiler vectorises, where slot by slot each element is its own load; the same sums as
    :func:`fold_source`."""
    width = src[i, A_WIDTH]
    group, lane = _pack_base(src, i, slot)
    base = group + lane * src[i, A_TKS]
    left, r = src[i, A_WORDS], src[i, A_RUN0]
    ks = carray(u64_pointer(keys.ctypes.data + 8 * src[i, A_KEY0]), left)
    for j in range(left):
        a, k = base + runs[r + j], ks[j]
        if width == 2:
            c2 = carray(u16_pointer(a), count)
            for t in range(count):
                acc[t] += wmix(np.uint64(c2[t]) ^ k)
        elif width == 4:
            c4 = carray(u32_pointer(a), count)
            for t in range(count):
                acc[t] += wmix(np.uint64(c4[t]) ^ k)
        else:
            c1 = carray(u8_pointer(a), count)
            for t in range(count):
                acc[t] += wmix(np.uint64(c1[t]) ^ k)


RUN_MIN = 4  # neighbouring slots folded together by fold_run (fewer: slot by slot)
AHEAD = 1  # sources ahead whose lines the folds over every source hint (more measured no faster)


@njit(inline="always", **JIT)
def fold_slots(src, runs, keys, slots, m, hint=True):  # type: ignore[no-untyped-def]
    """The fingerprints of the first ``m`` of ``slots`` (each ``0 <= slot < num_slots``, or -1:
    none, 0 out), folded source by source over all of them: neighbouring slots share a column-major
    K's cache lines, which slot by slot would be fetched again for each (every layer lies between),
    and runs of them in one page are folded together (:func:`fold_run`), as are both slots of a
    pack of two whose words hold one element of each (:func:`fold_pair`). The next source's lines are
    hinted while one is folded (:func:`prefetch_slots`; ``hint`` False: not, for
    ``bench/fold_layouts.py``'s comparison)."""
    acc = np.zeros(m, dtype=np.uint64)
    for i in range(src.shape[0]):
        if hint and i + AHEAD < src.shape[0]:
            prefetch_slots(src, runs, i + AHEAD, slots, m)
        ps, pack, width = src[i, A_PS], src[i, A_PACK], src[i, A_WIDTH]
        side = width != 0 and src[i, A_TKS] == width  # the slots' elements side by side
        j = 0
        while j < m:
            s = slots[j]
            e = j + 1
            if s >= 0 and side:
                page, group = s // ps, (s % ps) // pack
                while e < m and slots[e] == s + (e - j) and slots[e] // ps == page and (slots[e] % ps) // pack == group:
                    e += 1
            if e - j >= RUN_MIN:
                fold_run(src, runs, keys, i, s, e - j, acc[j:e])
            elif e - j == 2 and pack == 2 and width == 2 and src[i, A_CHUNKS]:  # both slots of a pack: one pass
                lo, hi = fold_pair(src, runs, keys, i, src[i, A_ADDR] + page * src[i, A_PGS] + group * src[i, A_PKS])
                acc[j] += lo
                acc[j + 1] += hi
            else:
                for jj in range(j, e):
                    if slots[jj] >= 0:
                        acc[jj] += fold_source(src, runs, keys, i, slots[jj])
            j = e
    out = np.zeros(m, dtype=np.int64)
    for j in range(m):
        if slots[j] >= 0:
            out[j] = finish_content(acc[j])
    return out


@njit(inline="always", **JIT)
def fold_slot(src, runs, keys, slot, hint=True):  # type: ignore[no-untyped-def]
    """The fingerprint of one slot (``0 <= slot < num_slots``) over every source, as int64, the next
    source's lines hinted while one is folded (``hint``, as :func:`fold_slots`)."""
    acc = np.uint64(0)
    for i in range(src.shape[0]):
        if hint and i + AHEAD < src.shape[0]:
            prefetch_slot(src, runs, i + AHEAD, slot)
        acc += fold_source(src, runs, keys, i, slot)
    return finish_content(acc)


