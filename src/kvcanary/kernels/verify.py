"""Verify-before-read (Triton): reads the step's own table, no per-entry plan in memory.

Same results as :func:`kvcanary.checks.verify` (stamps untouched, same counters, same set of
violation rows). Grid: one program per (row, block of positions); programs past a row's read
range exit at once. Graph-safe: no host sync, static grid from tensor shapes only. One launch,
plus a one-program prologue that places the rotating content window when a budget is set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.kernels._common import SourceTable, fold_sources, g_term, i64, u64
from kvcanary.kernels.content import content_block
from kvcanary.step import Step
from kvcanary.violations import NUM_FIELDS, Check, Counter

# the kernels spell these as literals
assert [int(c) for c in (Check.POSITION, Check.LINK, Check.TOKEN, Check.CONTENT, Check.EMPTY, Check.BAD_SLOT)] == [
    1, 2, 4, 8, 16, 32]
assert [int(c) for c in (Counter.STEPS, Counter.SLOTS_VERIFIED, Counter.LINKS_CHECKED, Counter.LINKS_UNCHECKED,
                         Counter.CONTENT_SLOTS_VERIFIED, Counter.CONTENT_SLOTS_SKIPPED,
                         Counter.CONTENT_BYTES_VERIFIED, Counter.VIOLATIONS, Counter.SLOTS_UNVERIFIABLE)] == [
    0, 1, 2, 3, 4, 5, 6, 11, 12]
assert NUM_FIELDS == 14
# positions and warps per program without content: 2 positions per lane, and few enough registers
# (72 on sm_90) for 3 programs per SM to keep ~1,500 stamp reads in flight there
META_BLOCK, META_WARPS = 512, 8
ROWS_PER_PASS = 1024  # rows the window prologue sums at once
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


@triton.jit
def lookup(table, trow, p, width, span, bs, BLOCK_TABLE: tl.constexpr):
    """Slot of positions ``p`` in table row ``trow`` (-1 outside the table)."""
    inside = (p >= 0) & (p < span)
    q = tl.where(inside, p, 0)
    if BLOCK_TABLE:
        e = tl.load(table + trow * width + q // bs, mask=inside, other=0).to(tl.int64)
        if table.dtype.element_ty == tl.int64:  # only a 64-bit entry past 2**62 / block_size can wrap
            lim = tl.full([], 4611686018427387904, tl.int64) // bs
            inside = inside & (e >= -lim) & (e <= lim)
        s = e * bs + q % bs
    else:
        s = tl.load(table + trow * width + q, mask=inside, other=0).to(tl.int64)
    return tl.where(inside, s, -1)


@triton.jit
def bump(counter, v):
    """Add ``v`` to one device counter (no atomic when it is 0)."""
    if v != 0:
        tl.atomic_add(counter, v)


@triton.jit
def record(ring, counters, cap, hit, fields: tl.constexpr, cols):
    """Append one ring row per ``hit`` lane: reserve with one atomic, place by prefix sum."""
    h = hit.to(tl.int64)
    cnt = tl.sum(h, axis=0)
    if cnt > 0:
        base = tl.atomic_add(counters + 11, cnt)
        at = (base + tl.cumsum(h, axis=0) - h) % cap
        for f in tl.static_range(fields):
            tl.store(ring + at * fields + f, cols[f], mask=hit)


@triton.jit
def read_range(r, cached, starts, valid, HAS_STARTS: tl.constexpr, HAS_VALID: tl.constexpr):
    """First position and count of the slots row ``r`` reads (= :func:`kvcanary.checks.read_counts`)."""
    c = tl.load(cached + r).to(tl.int64)
    st0 = c * 0
    if HAS_STARTS:
        st0 = tl.load(starts + r).to(tl.int64)
    cnt = tl.maximum(c - st0, 0)
    if HAS_VALID:
        cnt = tl.where(tl.load(valid + r) != 0, cnt, 0)
    return st0, cnt


@triton.jit
def _window_kernel(cached, starts, valid, rows, first, meta, cursor, counters, content_slots,
                   RB: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_VALID: tl.constexpr):
    """One program: each row's first entry index, and the window ``[cur, cur + k)`` of ``n`` entries
    that get content checks (``meta = (n, cur, k)``); advances the cursor by ``k``."""
    total = tl.load(cursor) * 0
    for r0 in range(0, rows, RB):
        r = r0 + tl.arange(0, RB)
        m = r < rows
        _, cnt = read_range(tl.where(m, r, 0), cached, starts, valid, HAS_STARTS, HAS_VALID)
        cnt = tl.where(m, cnt, 0)
        tl.store(first + r, total + tl.cumsum(cnt, axis=0) - cnt, mask=m)
        total += tl.sum(cnt, axis=0)
    k = tl.minimum(total, content_slots)
    tl.store(meta + 0, total)
    tl.store(meta + 1, tl.load(cursor) % tl.maximum(total, 1))
    tl.store(meta + 2, k)
    tl.store(cursor, tl.load(cursor) + k)
    tl.store(counters + 5, tl.load(counters + 5) + total - k)


@triton.jit
def _verify_kernel(
    stamps, num_slots, table, width, span, bs, table_rows, cached, starts, valid, exp_tok, exp_w, exp_rows,
    first, meta, cursor, src, nsrc, ntiles, bytes_per_slot, counters, ring, cap,
    BLOCK: tl.constexpr, BLOCK_TABLE: tl.constexpr, HAS_TROWS: tl.constexpr, HAS_STARTS: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_EXP: tl.constexpr, HAS_EROWS: tl.constexpr, HAS_CONTENT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, CHUNK: tl.constexpr, SAME_PS: tl.constexpr, EVEN: tl.constexpr, NARROW: tl.constexpr,
):
    """Per read entry (row r, position p): POSITION, LINK (stored link == B*pred.link + g(token, pos)),
    TOKEN, CONTENT (every entry, or those in the window), EMPTY, BAD_SLOT; an unknown slot (position
    -2) is counted and not checked, and its successor's link is not checked."""
    r = tl.program_id(0)
    st0, cnt = read_range(r, cached, starts, valid, HAS_STARTS, HAS_VALID)
    trow = r.to(tl.int64)
    if HAS_TROWS:
        trow = tl.load(table_rows + r).to(tl.int64)
    erow = r.to(tl.int64)
    if HAS_EROWS:
        erow = tl.load(exp_rows + r).to(tl.int64)
    step_id = tl.load(counters + 0)
    # programs stride over the row's blocks: a row longer than one grid pass still gets every block
    for blk in range(tl.program_id(1), tl.cdiv(cnt, BLOCK).to(tl.int32), tl.num_programs(1)):
        idx = blk * BLOCK + tl.arange(0, BLOCK)
        m = idx < cnt
        p = st0 + idx
        slot = lookup(table, trow, p, width, span, bs, BLOCK_TABLE)
        has_pred = idx > 0
        pred = tl.where(has_pred, lookup(table, trow, p - 1, width, span, bs, BLOCK_TABLE), -1)
        bad = (slot < 0) | (slot >= num_slots)
        pred_ok = has_pred & (pred >= 0) & (pred < num_slots)
        sl = tl.where(bad | ~m, 0, slot)
        s_tok = tl.load(stamps + sl * 4 + 0, mask=m, other=0)
        s_pos = tl.load(stamps + sl * 4 + 1, mask=m, other=0)
        s_link = tl.load(stamps + sl * 4 + 2, mask=m, other=0)
        s_cont = tl.load(stamps + sl * 4 + 3, mask=m, other=0)
        empty = (s_pos == -1) & ~bad
        unknown = (s_pos == -2) & ~bad
        readable = ~bad & ~empty & ~unknown
        pred_pos = tl.load(stamps + tl.where(pred_ok, pred, 0) * 4 + 1, mask=m & pred_ok, other=0)
        pred_ok &= pred_pos != -2  # an unknown predecessor's link says nothing about this slot's
        linked = readable & ((p == 0) | pred_ok)
        prev = tl.load(stamps + tl.where(pred_ok, pred, 0) * 4 + 2, mask=m & pred_ok, other=0)
        prev = tl.where(p == 0, 0x5EEDC0DE7A110001, u64(prev))
        exp_link = prev * 0x9E3779B97F4A7C15 + g_term(u64(s_tok), u64(s_pos))
        exp_link = tl.where(linked, i64(exp_link), 0)
        checks = tl.where(bad, 32, 0) | tl.where(empty, 16, 0)
        checks |= tl.where(readable & (s_pos != p), 1, 0)
        checks |= tl.where(linked & (s_link != exp_link), 2, 0)
        etok = p * 0 - 1
        if HAS_EXP:
            inside = p < exp_w
            etok = tl.load(exp_tok + erow * exp_w + tl.where(inside, p, 0), mask=m & inside, other=-1).to(tl.int64)
            checks |= tl.where(readable & (etok != -1) & (s_tok != etok), 4, 0)
        exp_cont = p * 0
        if HAS_CONTENT:
            sel = m & readable
            if HAS_WINDOW:
                n = tl.maximum(tl.load(meta + 0), 1)
                e = tl.load(first + r) + idx
                sel &= ((e - tl.load(meta + 1)) % n + n) % n < tl.load(meta + 2)
            else:
                bump(cursor, tl.sum(m.to(tl.int64), axis=0))  # every entry is in the window
            nsel = tl.sum(sel.to(tl.int64), axis=0)
            if nsel > 0:  # a block wholly outside the window skips the tile loop
                exp_cont = tl.where(sel, i64(fold_sources(sl, sel, src, nsrc, ntiles, CHUNK, SAME_PS, EVEN,
                                                          NARROW)), 0)
            checks |= tl.where(sel & (s_cont != exp_cont), 8, 0)
            bump(counters + 4, nsel)
            bump(counters + 6, nsel * bytes_per_slot)
        bump(counters + 1, tl.sum(m.to(tl.int64), axis=0))
        bump(counters + 2, tl.sum((m & linked).to(tl.int64), axis=0))
        bump(counters + 3, tl.sum((m & readable & ~linked).to(tl.int64), axis=0))
        bump(counters + 12, tl.sum((m & unknown).to(tl.int64), axis=0))
        checks = tl.where(m, checks, 0)
        rr = r.to(tl.int64) + p * 0
        record(ring, counters, cap, checks != 0, 14,
               (p * 0, checks, step_id + p * 0, rr, slot, p, etok, s_tok, s_pos, exp_link, s_link, exp_cont, s_cont,
                pred))


def verify(stamps: torch.Tensor, src: SourceTable, step: Step, counters: torch.Tensor, cursor: torch.Tensor,
           content_slots: int | None, ring: torch.Tensor, block: int | None = None,
           max_programs_per_row: int = MAX_GRID_Y) -> None:
    """Launch verify for ``step``. Mutates ``counters``, ``cursor`` and ``ring`` only.

    Parameters
    ----------
    stamps : int64 ``[num_slots, 4]``
    src : the layout's :func:`kvcanary.kernels._common.source_table`
    counters : int64 ``[NUM_COUNTERS]``; cursor : int64 ``[1]``; ring : int64 ``[capacity, NUM_FIELDS]``
    content_slots : content checks per step (``None``: every read entry)
    block : positions per program (default: by content tile, or ``META_BLOCK`` without content)
    max_programs_per_row : the grid's second dimension at most (a CUDA limit); programs stride
        over the blocks of longer rows
    """
    r = step.num_rows
    if r == 0:
        return
    has_content = src.count > 0
    window = has_content and content_slots is not None
    if block is None:
        block = content_block(src.chunk) if has_content else META_BLOCK
    dummy = step.cached_lens
    starts = step.read_starts if step.read_starts is not None else dummy
    valid = step.row_valid if step.row_valid is not None else dummy
    flags = dict(HAS_STARTS=step.read_starts is not None, HAS_VALID=step.row_valid is not None)
    first = meta = dummy
    if window:
        first = torch.empty(r, dtype=torch.int64, device=stamps.device)
        meta = torch.empty(3, dtype=torch.int64, device=stamps.device)
        _window_kernel[(1,)](step.cached_lens, starts, valid, r, first, meta, cursor, counters, content_slots,
                             RB=min(ROWS_PER_PASS, triton.next_power_of_2(r)), **flags)
    table = step.table
    exp = step.expected_tokens
    grid = (r, max(1, min(triton.cdiv(step.table_span, block), max_programs_per_row)))
    _verify_kernel[grid](
        stamps, stamps.shape[0], table, table.shape[1], step.table_span, step.block_size,
        step.table_rows if step.table_rows is not None else dummy, step.cached_lens, starts, valid,
        exp if exp is not None else dummy, exp.shape[1] if exp is not None else 0,
        step.expected_rows if step.expected_rows is not None else dummy, first, meta, cursor, src.table, src.count, src.tiles, src.bytes_per_slot, counters, ring, ring.shape[0],
        BLOCK=block, BLOCK_TABLE=step.block_table is not None, HAS_TROWS=step.table_rows is not None,
        HAS_EXP=exp is not None, HAS_EROWS=step.expected_rows is not None, HAS_CONTENT=has_content, HAS_WINDOW=window, CHUNK=src.chunk,
        SAME_PS=src.same_page_size, EVEN=src.even, NARROW=src.narrow, num_warps=4 if has_content else META_WARPS,
        **flags,
    )
