"""Triton helpers shared by the kernels: the hashing formulas of :mod:`kvcanary.hashing` in uint64,
and the layout as a table the kernels read.

Only imported when a Triton op is used; ``import kvcanary`` never needs Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from kvcanary import hashing
from kvcanary.errors import LayoutError
from kvcanary.layout import KvLayout
from kvcanary.source import LOAD_WIDTH, ByteSource

# per source, in 16-byte units where a length: address (from the table's own), page_size (slots),
# page_stride, token_stride; per tile: source, word offset in the slot, key index of its first word,
# words used
NUM_SRC_FIELDS = NUM_TILE_FIELDS = 4
# the narrow section, after the tiles: its tile count, then per narrow tile: its source row (table
# index), key base (source << 32 | first word), element width, offsets (table index), words used;
# per narrow source, in bytes: address (from the table's own), page_size (slots), page_stride,
# token_pack (slots), pack_stride, token_stride; then each tile's word offsets in the slot (bytes)
NUM_NARROW_TILE_FIELDS, NUM_NARROW_SRC_FIELDS = 5, 6
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
def _mix(v, key_base, col):
    """``wmix(word ^ key)`` of a tile's words ``v`` ``[BLOCK, CHUNK]`` (uint64)."""
    key = fmix64((key_base + col.to(tl.uint64)) ^ 0x9FB21C651E98DF25)
    x = (v.to(tl.uint64, bitcast=True) ^ key[None, :]) * 0xD6E8FEB86659FD93
    return x ^ (x >> 29)


@triton.jit
def _wide_tiles(acc, src, nsrc, ntiles, page, inpage, slots, mask, col, SAME_PS: tl.constexpr, EVEN: tl.constexpr):
    """Add the mixed words of the ``ntiles`` (>= 1) wide tiles to ``acc``; the loads of tile ``t + 1``
    are issued before the words of tile ``t`` are mixed."""
    v, key_base, cm = _tile(src, nsrc, 0, page, inpage, slots, mask, col, SAME_PS, EVEN)
    for t in range(ntiles):
        more = tl.full(mask.shape, t + 1, tl.int32) < ntiles  # the last pass prefetches nothing
        nv, nkey_base, ncm = _tile(src, nsrc, tl.minimum(t + 1, ntiles - 1), page, inpage, slots, mask & more, col,
                                   SAME_PS, EVEN)
        x = _mix(v, key_base, col)
        if EVEN:
            acc += x
        else:
            acc += tl.where(cm[None, :], x, 0)
        v, key_base, cm = nv, nkey_base, ncm
    return acc


@triton.jit
def _narrow_tiles(acc, src, head, page, inpage, slots, mask, col, SAME_PS: tl.constexpr):
    """Add the mixed words of the narrow section's tiles (from table index ``head``) to ``acc``:
    one element per word, of the tile's width (1, 2, 4 or 8 bytes), at the tile's byte offsets
    from the slot's base; zero-extended to a word."""
    p8 = src.to(tl.pointer_type(tl.uint8), bitcast=True)
    for t in range(tl.load(src + head)):
        tile = src + head + 1 + t * 5
        row = src + tl.load(tile + 0)
        if not SAME_PS:
            ps = tl.load(row + 1)
            page = slots // ps
            inpage = slots % ps
        tp = tl.load(row + 3)
        base = tl.load(row + 0) + page * tl.load(row + 2)
        base += (inpage // tp) * tl.load(row + 4) + (inpage % tp) * tl.load(row + 5)
        cm = col < tl.load(tile + 4)
        off = tl.load(src + tl.load(tile + 3) + col, mask=cm, other=0)
        at = p8 + (base[:, None] + off[None, :])
        m = mask[:, None] & cm[None, :]
        w = tl.load(tile + 2)
        if w == 8:
            v = tl.load(at.to(tl.pointer_type(tl.uint64), bitcast=True), mask=m, other=0)
        elif w == 4:
            v = tl.load(at.to(tl.pointer_type(tl.uint32), bitcast=True), mask=m, other=0).to(tl.uint64)
        elif w == 2:
            v = tl.load(at.to(tl.pointer_type(tl.uint16), bitcast=True), mask=m, other=0).to(tl.uint64)
        else:
            v = tl.load(at, mask=m, other=0).to(tl.uint64)
        acc += tl.where(cm[None, :], _mix(v, tl.load(tile + 1).to(tl.uint64, bitcast=True), col), 0)
    return acc


@triton.jit
def fold_sources(slots, mask, src, nsrc, ntiles, CHUNK: tl.constexpr, SAME_PS: tl.constexpr, EVEN: tl.constexpr,
                 NARROW: tl.constexpr):
    """Content fingerprints of ``slots`` ``[BLOCK]`` over every source of the table ``src``:
    ``fmix64(SALT ^ sum_{s,j} wmix(word[s,j] ^ key(s,j)))``; lanes off ``mask`` give junk.

    The words come in ``ntiles`` tiles of ``[BLOCK, CHUNK]``, one run of ``CHUNK`` words of one
    row of one source per slot (the table's tile list). Addresses are 16-byte aligned and
    contiguous along a run, so every lane loads 16 bytes at once, and the loads of tile ``t + 1``
    are issued before the words of tile ``t`` are mixed, so each lane keeps a whole tile in
    flight. With ``NARROW`` the table's narrow section follows (element loads at listed offsets:
    runs of 1, 2 or 4 bytes, or packed slots); without it the kernel has no code for it. The sum
    is kept per tile position and reduced once at the end (addition mod 2^64 is order-free).
    """
    acc = tl.zeros([slots.shape[0], CHUNK], dtype=tl.uint64)
    slots = slots.to(tl.int64)
    col = tl.arange(0, CHUNK)
    ps = tl.load(src + 1)
    page = slots // ps
    inpage = slots % ps
    if NARROW:
        if ntiles > 0:  # a layout of narrow sources only has no wide tile to prefetch
            acc = _wide_tiles(acc, src, nsrc, ntiles, page, inpage, slots, mask, col, SAME_PS, EVEN)
        acc = _narrow_tiles(acc, src, nsrc * 4 + ntiles * 4, page, inpage, slots, mask, col, SAME_PS)
    else:
        acc = _wide_tiles(acc, src, nsrc, ntiles, page, inpage, slots, mask, col, SAME_PS, EVEN)
    return fmix64(tl.sum(acc, axis=1) ^ 0xA0761D6478BD642F)


@dataclass(frozen=True, eq=False)
class SourceTable:
    """A layout as the content kernels read it.

    ``table`` is int64: ``count`` source rows (each source's address relative to the table's own,
    and its geometry in 16-byte units), then ``tiles`` tile rows (source, word offset in the slot,
    index of its first word in the source's fingerprint, words used), then, when ``narrow``, the
    narrow section (``NUM_NARROW_*``) for the sources the 16-byte loads cannot read. ``chunk`` is
    the tile width in words; ``even``: every wide tile is full (no column masks);
    ``same_page_size``: every source has the first one's page size.
    """

    table: torch.Tensor
    count: int
    tiles: int
    bytes_per_slot: int
    chunk: int
    even: bool
    same_page_size: bool
    narrow: bool = False


def _fast(s: ByteSource) -> bool:
    """Read by the 16-byte tiles: wide runs in unpacked pages (their slot base is the fast path's)."""
    return not s.narrow and not s.packed


def _segments(s: ByteSource) -> list[list[int]]:
    """(byte offset in the slot, key index of its first word, words) of each contiguous stretch of
    words a fast source reads: runs back to back become one."""
    rw = min(s.read_bytes or 0, s.row_bytes) // 8
    segs: list[list[int]] = []
    for k, off in enumerate(s.run_offsets()[: s.read_runs].tolist()):
        if segs and rw * 8 == s.row_bytes and segs[-1][0] + 8 * segs[-1][2] == off:
            segs[-1][2] += rw
        else:
            segs.append([off, k * rw, rw])
    return segs


def _word_offsets(s: ByteSource) -> tuple[int, list[int]]:
    """Element width and the byte offset in the slot of each word a narrow-path source reads."""
    offs = s.run_offsets()[: s.read_runs]
    if s.narrow:
        return s.row_bytes, offs.tolist()
    rw = min(s.read_bytes or 0, s.row_bytes) // 8
    return 8, (offs[:, None] + torch.arange(rw) * 8).reshape(-1).tolist()


def source_table(layout: KvLayout, device: torch.device) -> SourceTable:
    """Build the kernels' table for ``layout`` (whose tensors must stay where they are)."""
    srcs = layout.sources
    segs = {i: _segments(s) for i, s in enumerate(srcs) if _fast(s)}
    words = {i: _word_offsets(s) for i, s in enumerate(srcs) if not _fast(s)}
    widths = [w for sg in segs.values() for _, _, w in sg] + [len(o) for _, o in words.values()]
    chunk = min(MAX_CHUNK, triton.next_power_of_2(max(widths, default=2)))
    tiles = [[i, off // 8 + c0, k0 + c0, min(chunk, n - c0)]
             for i, sg in segs.items() for off, k0, n in sg for c0 in range(0, n, chunk)]
    head = max(1, len(srcs)) * NUM_SRC_FIELDS + NUM_TILE_FIELDS * len(tiles)
    ntiles = sum(triton.cdiv(len(o), chunk) for _, o in words.values())
    size = head + (1 + NUM_NARROW_TILE_FIELDS * ntiles + NUM_NARROW_SRC_FIELDS * len(words)
                   + sum(len(o) for _, o in words.values()) if words else 0)
    table = torch.zeros(size, dtype=torch.int64, device=device)
    here = table.data_ptr()
    assert here % LOAD_WIDTH == 0
    rows: list[int] = []
    for i, s in enumerate(srcs):
        addr = s.tensor.untyped_storage().data_ptr() + s.offset
        if i in segs and addr % LOAD_WIDTH:
            raise LayoutError(f"source {s.name!r}: address {addr:#x} is not {LOAD_WIDTH}-byte aligned")
        if i in segs:
            rows += [(addr - here) // LOAD_WIDTH, s.page_size, s.page_stride // LOAD_WIDTH,
                     s.token_stride // LOAD_WIDTH]
        else:  # the page size still counts (source 0's is the kernels' default)
            rows += [0, s.page_size, 0, 0]
    rows += [x for t in tiles for x in t]
    if words:
        rows += _narrow_section(srcs, words, chunk, head, ntiles, here)
    if rows:
        table.copy_(torch.tensor(rows, dtype=torch.int64))
    return SourceTable(table, len(srcs), len(tiles), layout.content_bytes_per_slot, chunk,
                       all(t[3] == chunk for t in tiles), len({s.page_size for s in srcs}) <= 1, bool(words))


def _narrow_section(srcs: Sequence[ByteSource], words: dict[int, tuple[int, list[int]]], chunk: int, head: int,
                    ntiles: int, here: int) -> list[int]:
    """The table's narrow section (``NUM_NARROW_*``), which starts at table index ``head``."""
    src_at = head + 1 + NUM_NARROW_TILE_FIELDS * ntiles
    off_at = src_at + NUM_NARROW_SRC_FIELDS * len(words)
    tiles: list[int] = []
    rows: list[int] = []
    offs: list[int] = []
    for i, (width, o) in words.items():
        s = srcs[i]
        addr = s.tensor.untyped_storage().data_ptr() + s.offset
        if addr % width:
            raise LayoutError(f"source {s.name!r}: address {addr:#x} is not {width}-byte aligned (its runs are "
                              f"read as {width}-byte elements)")
        row = src_at + len(rows)
        for c0 in range(0, len(o), chunk):
            tiles += [row, (i << 32) | c0, width, off_at + len(offs) + c0, min(chunk, len(o) - c0)]
        rows += [addr - here, s.page_size, s.page_stride, s.pack, s.pack_stride, s.token_stride]
        offs += o
    return [ntiles] + tiles + rows + offs


assert hashing.LINK_B == 0x9E3779B97F4A7C15 and hashing.POS_SALT == 0x2545F4914F6CDD1D
assert hashing.KEY_SALT == 0x9FB21C651E98DF25 and hashing.WORD_MUL == 0xD6E8FEB86659FD93
assert hashing.CONTENT_SALT == 0xA0761D6478BD642F and hashing.FMIX_C1 == 0xFF51AFD7ED558CCD
