"""Verify-before-read (Triton): reads the step's own table, no per-entry plan in memory.

Same results as :func:`kvcanary.checks.verify` (stamps untouched, same counters, same set of
violation rows). Grid: one program per (row, block of positions); programs past a row's read
range exit at once. Graph-safe: no host sync, static grid from tensor shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.checks import read_counts
from kvcanary.kernels._common import fold_sources, g_term, i64, u64
from kvcanary.step import Step
from kvcanary.violations import NUM_FIELDS, Check, Counter

# the kernels spell these as literals
assert [int(c) for c in (Check.POSITION, Check.LINK, Check.TOKEN, Check.CONTENT, Check.EMPTY, Check.BAD_SLOT)] == [
    1, 2, 4, 8, 16, 32]
assert [int(c) for c in (Counter.STEPS, Counter.LINKS_CHECKED, Counter.LINKS_UNCHECKED, Counter.CONTENT_SLOTS_VERIFIED,
                         Counter.CONTENT_BYTES_VERIFIED, Counter.VIOLATIONS)] == [0, 2, 3, 4, 6, 11]
assert NUM_FIELDS == 14


@triton.jit
def lookup(table, trow, p, width, span, bs, BLOCK_TABLE: tl.constexpr):
    """Slot of positions ``p`` in table row ``trow`` (-1 outside the table)."""
    inside = (p >= 0) & (p < span)
    q = tl.where(inside, p, 0)
    if BLOCK_TABLE:
        s = tl.load(table + trow * width + q // bs, mask=inside, other=0).to(tl.int64) * bs + q % bs
    else:
        s = tl.load(table + trow * width + q, mask=inside, other=0).to(tl.int64)
    return tl.where(inside, s, -1)


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
def _verify_kernel(
    stamps, num_slots, table, width, span, bs, table_rows, cached, starts, valid, exp_tok, exp_w,
    first, meta, src, nsrc, bytes_per_slot, counters, ring, cap,
    BLOCK: tl.constexpr, BLOCK_TABLE: tl.constexpr, HAS_TROWS: tl.constexpr, HAS_STARTS: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_EXP: tl.constexpr, HAS_CONTENT: tl.constexpr, WCHUNK: tl.constexpr,
):
    """Per read entry (row r, position p): POSITION, LINK (stored link == B*pred.link + g(token, pos)),
    TOKEN, CONTENT (within the rotating budget window), EMPTY, BAD_SLOT."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    c = tl.load(cached + r).to(tl.int64)
    st0 = c * 0
    if HAS_STARTS:
        st0 = tl.load(starts + r).to(tl.int64)
    cnt = tl.maximum(c - st0, 0)
    if HAS_VALID:
        cnt = tl.where(tl.load(valid + r) != 0, cnt, 0)
    if blk * BLOCK >= cnt:
        return
    idx = blk * BLOCK + tl.arange(0, BLOCK)
    m = idx < cnt
    p = st0 + idx
    trow = r.to(tl.int64)
    if HAS_TROWS:
        trow = tl.load(table_rows + r).to(tl.int64)
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
    readable = ~bad & ~empty
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
        etok = tl.load(exp_tok + r * exp_w + tl.where(inside, p, 0), mask=m & inside, other=-1).to(tl.int64)
        checks |= tl.where(readable & (etok != -1) & (s_tok != etok), 4, 0)
    exp_cont = p * 0
    nsel = 0
    if HAS_CONTENT:
        n = tl.load(meta + 0)
        cur = tl.load(meta + 1)
        k = tl.load(meta + 2)
        e = tl.load(first + r) + idx
        sel = m & readable & (((e - cur) % tl.maximum(n, 1) + n) % tl.maximum(n, 1) < k)
        fp = i64(fold_sources(sl, sel, src, nsrc, WCHUNK))
        exp_cont = tl.where(sel, fp, 0)
        checks |= tl.where(sel & (s_cont != exp_cont), 8, 0)
        nsel = tl.sum(sel.to(tl.int64), axis=0)
        tl.atomic_add(counters + 4, nsel)
        tl.atomic_add(counters + 6, nsel * bytes_per_slot)
    tl.atomic_add(counters + 2, tl.sum((m & linked).to(tl.int64), axis=0))
    tl.atomic_add(counters + 3, tl.sum((m & readable & ~linked).to(tl.int64), axis=0))
    checks = tl.where(m, checks, 0)
    step_id = tl.load(counters + 0)
    rr = r.to(tl.int64) + p * 0
    record(ring, counters, cap, checks != 0, 14,
           (p * 0, checks, step_id + p * 0, rr, slot, p, etok, s_tok, s_pos, exp_link, s_link, exp_cont, s_cont,
            pred))


def verify(stamps: torch.Tensor, layout_table: torch.Tensor, nsrc: int, bytes_per_slot: int, step: Step,
           counters: torch.Tensor, cursor: torch.Tensor, content_slots: int | None, ring: torch.Tensor,
           block: int = 64) -> None:
    """Launch verify for ``step``. Mutates ``counters``, ``cursor`` and ``ring`` only.

    Parameters
    ----------
    stamps : int64 ``[num_slots, 4]``
    layout_table : int64 ``[nsrc, 8]`` from :func:`kvcanary.kernels._common.source_table`
    counters : int64 ``[NUM_COUNTERS]``; cursor : int64 ``[1]``; ring : int64 ``[capacity, NUM_FIELDS]``
    """
    r = step.num_rows
    dev = stamps.device
    counts = read_counts(step)
    n = counts.sum()
    counters[Counter.SLOTS_VERIFIED] += n
    has_content = nsrc > 0
    first = torch.cumsum(counts, 0) - counts
    meta = torch.zeros(3, dtype=torch.int64, device=dev)
    if has_content:
        k = n if content_slots is None else torch.clamp(n, max=content_slots)
        meta[0] = n
        meta[1] = cursor[0] % torch.clamp(n, min=1)
        meta[2] = k
        counters[Counter.CONTENT_SLOTS_SKIPPED] += n - k
        cursor += k
    table = step.table
    grid = (r, triton.cdiv(step.table_span, block))
    dummy = counts
    _verify_kernel[grid](
        stamps, stamps.shape[0], table, table.shape[1], step.table_span, step.block_size,
        step.table_rows if step.table_rows is not None else dummy, step.cached_lens,
        step.read_starts if step.read_starts is not None else dummy,
        step.row_valid if step.row_valid is not None else dummy,
        step.expected_tokens if step.expected_tokens is not None else dummy,
        step.expected_tokens.shape[1] if step.expected_tokens is not None else 0,
        first, meta, layout_table, nsrc, bytes_per_slot, counters, ring, ring.shape[0],
        BLOCK=block, BLOCK_TABLE=step.block_table is not None, HAS_TROWS=step.table_rows is not None,
        HAS_STARTS=step.read_starts is not None, HAS_VALID=step.row_valid is not None,
        HAS_EXP=step.expected_tokens is not None, HAS_CONTENT=has_content, WCHUNK=64,
    )
