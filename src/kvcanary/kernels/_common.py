"""Triton helpers shared by the kernels: the hashing formulas of :mod:`kvcanary.hashing` in uint64,
and the layout as a table the kernels read.

Only imported when a Triton op is used; ``import kvcanary`` never needs Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcanary import hashing
from kvcanary.errors import LayoutError
from kvcanary.layout import LOAD_WIDTH, KvLayout

# per source, in 16-byte units where a length: address (from the table's own), page_size (slots),
# page_stride, token_stride; per tile: source, word offset in the slot, key index of its first word,
# words used
NUM_SRC_FIELDS = NUM_TILE_FIELDS = 4
MAX_CHUNK = 64  # words per row of a content tile


@triton.jit
def fmix64(x):
    """Murmur3 finaliser on uint64 (= :func:`kvcanary.hashing.fmix64`)."""
    x ^= x >> 33
    x *= 0xFF51AFD7ED558CCD
    x ^= x >> 33
    x *= 0xC4CEB9FE1A85EC53
    return x ^ (x >> 33)


@triton.jit
def g_term(tok, pos):
    """``g(token, position)`` on uint64 (= :func:`kvcanary.hashing.g_term`)."""
    return fmix64(tok ^ fmix64(pos + 0x2545F4914F6CDD1D))


@triton.jit
def u64(x):
    return x.to(tl.int64).to(tl.uint64, bitcast=True)


@triton.jit
def i64(x):
    return x.to(tl.int64, bitcast=True)


@triton.jit
def _tile(src, nsrc, t, page, inpage, slots, mask, col, SAME_PS: tl.constexpr, EVEN: tl.constexpr):
    """Issue the loads of content tile ``t`` (``[BLOCK, CHUNK]`` words); also return its key base
    and its column mask. Lanes off ``mask`` load nothing (their words read as 0)."""
    tile = src + nsrc * 4 + t * 4
    s = tl.load(tile + 0)
    row = src + s * 4
    if not SAME_PS:
        ps = tl.load(row + 1)
        page = slots // ps
        inpage = slots % ps
    start = (tl.load(row + 0) + page * tl.load(row + 2) + inpage * tl.load(row + 3)) * 2  # even: 16-byte aligned
    off = tl.multiple_of(tl.load(tile + 1), 2)
    cm = col < tl.multiple_of(tl.load(tile + 3), 2)  # words used: even
    m = mask[:, None]
    if not EVEN:
        m = m & cm[None, :]
    v = tl.load(src + (start[:, None] + (off + col)[None, :]), mask=m, other=0)
    key_base = ((s.to(tl.uint64, bitcast=True) << 32) | tl.load(tile + 2).to(tl.uint64, bitcast=True))
    return v, key_base, cm


@triton.jit
def fold_sources(slots, mask, src, nsrc, ntiles, CHUNK: tl.constexpr, SAME_PS: tl.constexpr, EVEN: tl.constexpr):
    """Content fingerprints of ``slots`` ``[BLOCK]`` over every source of the table ``src``:
    ``fmix64(SALT ^ sum_{s,j} wmix(word[s,j] ^ key(s,j)))``; lanes off ``mask`` give junk.

    The words come in ``ntiles`` tiles of ``[BLOCK, CHUNK]``, one run of ``CHUNK`` words of one
    row of one source per slot (the table's tile list). Addresses are 16-byte aligned and
    contiguous along a run, so every lane loads 16 bytes at once, and the loads of tile ``t + 1``
    are issued before the words of tile ``t`` are mixed, so each lane keeps a whole tile in
    flight. The sum is kept per tile position and reduced once at the end (addition mod 2^64 is
    order-free).
    """
    acc = tl.zeros([slots.shape[0], CHUNK], dtype=tl.uint64)
    slots = slots.to(tl.int64)
    col = tl.arange(0, CHUNK)
    ps = tl.load(src + 1)
    page = slots // ps
    inpage = slots % ps
    v, key_base, cm = _tile(src, nsrc, 0, page, inpage, slots, mask, col, SAME_PS, EVEN)
    for t in range(ntiles):
        more = tl.full(mask.shape, t + 1, tl.int32) < ntiles  # the last pass prefetches nothing
        nv, nkey_base, ncm = _tile(src, nsrc, tl.minimum(t + 1, ntiles - 1), page, inpage, slots, mask & more, col,
                                   SAME_PS, EVEN)
        key = fmix64((key_base + col.to(tl.uint64)) ^ 0x9FB21C651E98DF25)
        x = (v.to(tl.uint64, bitcast=True) ^ key[None, :]) * 0xD6E8FEB86659FD93
        x ^= x >> 29
        if EVEN:
            acc += x
        else:
            acc += tl.where(cm[None, :], x, 0)
        v, key_base, cm = nv, nkey_base, ncm
    return fmix64(tl.sum(acc, axis=1) ^ 0xA0761D6478BD642F)


@dataclass(frozen=True, eq=False)
class SourceTable:
    """A layout as the content kernels read it.

    ``table`` is int64: ``count`` source rows (each source's address relative to the table's own,
    and its geometry in 16-byte units), then ``tiles`` tile rows (source, word offset in the slot,
    index of its first word in the source's fingerprint, words used). ``chunk`` is the tile width
    in words; ``even``: every tile is full (no column masks); ``same_page_size``: every source has
    the first one's page size.
    """

    table: torch.Tensor
    count: int
    tiles: int
    bytes_per_slot: int
    chunk: int
    even: bool
    same_page_size: bool


def source_table(layout: KvLayout, device: torch.device) -> SourceTable:
    """Build the kernels' table for ``layout`` (whose tensors must stay where they are)."""
    geo, widths = [], []
    for s in layout.sources:
        row_words, nrows = min(s.read_bytes or 0, s.row_bytes) // 8, s.read_rows
        if nrows > 1 and s.row_stride == s.row_bytes:  # rows back to back: one run
            row_words, nrows = row_words * nrows, 1
        geo.append((s, row_words, nrows))
        widths.append(row_words)
    chunk = min(MAX_CHUNK, triton.next_power_of_2(max(widths, default=2)))
    tiles = [[i, r * (s.row_stride // 8) + c0, r * rw + c0, min(chunk, rw - c0)]
             for i, (s, rw, nrows) in enumerate(geo) for r in range(nrows) for c0 in range(0, rw, chunk)]
    table = torch.zeros(max(1, len(geo)) * NUM_SRC_FIELDS + NUM_TILE_FIELDS * len(tiles), dtype=torch.int64,
                        device=device)
    here = table.data_ptr()
    assert here % LOAD_WIDTH == 0
    rows = []
    for i, (s, rw, nrows) in enumerate(geo):
        addr = s.tensor.untyped_storage().data_ptr() + s.offset
        if addr % LOAD_WIDTH:
            raise LayoutError(f"source {s.name!r}: address {addr:#x} is not {LOAD_WIDTH}-byte aligned")
        rows += [(addr - here) // LOAD_WIDTH, s.page_size, s.page_stride // LOAD_WIDTH, s.token_stride // LOAD_WIDTH]
    if rows:
        table.copy_(torch.tensor(rows + [x for t in tiles for x in t], dtype=torch.int64))
    return SourceTable(table, len(geo), len(tiles), layout.content_bytes_per_slot, chunk,
                       all(t[3] == chunk for t in tiles), len({s.page_size for s, _, _ in geo}) <= 1)


assert hashing.LINK_B == 0x9E3779B97F4A7C15 and hashing.POS_SALT == 0x2545F4914F6CDD1D
assert hashing.KEY_SALT == 0x9FB21C651E98DF25 and hashing.WORD_MUL == 0xD6E8FEB86659FD93
assert hashing.CONTENT_SALT == 0xA0761D6478BD642F and hashing.FMIX_C1 == 0xFF51AFD7ED558CCD
