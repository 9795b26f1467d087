"""Stamp-after-write (Triton), parallel over tokens.

Same results as :func:`kvcanary.checks.stamp`. The links of all new tokens come from a scan of the
affine maps ``x -> a*x + b`` (``a = B``, ``b = g(token, position)``; ``a = 0`` at a row's first
token, whose ``b`` folds in the row's seed): block-local ``tl.associative_scan``, then, when the
new tokens span several blocks, a one-program scan of the block aggregates whose carries the write
pass applies. Each token finds its row by binary search in ``new_offsets``. Graph-safe.

Two tokens writing one slot are found exactly with a per-slot writer count kept beside the stamps
(int64 ``[num_slots]``, zero between steps): each writer adds ``2**32`` (before the write pass: in
the first launch, or behind a barrier in the single-block case), then in the write pass takes a
ticket by adding 1, reading the number of writers in the high half; the last ticket resets the
slot's count to 0, so nothing is cleared per step.

Launches: one for a step that fits one block (decode), three otherwise, plus one content kernel
when the layout has sources.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.checks import EMPTY_STAMP
from kvcanary.kernels._common import SourceTable, g_term, i64, u64
from kvcanary.kernels.content import content as content_op
from kvcanary.kernels.verify import bump, lookup, record
from kvcanary.step import Step
from kvcanary.violations import Check, Counter

CARRY_PASS = 1024  # block aggregates scanned at once

# the kernels spell these as literals
assert [int(c) for c in (Check.BAD_SLOT, Check.WRITE_POSITION, Check.WRITE_TABLE, Check.WRITE_INPUT_TOKEN,
                         Check.WRITE_INPUT_POSITION, Check.WRITE_DUPLICATE)] == [32, 64, 128, 256, 512, 1024]
assert EMPTY_STAMP == (-1, -1, 0, 0)
assert (int(Counter.SLOTS_STAMPED), int(Counter.CONTENT_BYTES_STAMPED)) == (7, 8)


@triton.jit
def _combine(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@triton.jit
def row_of(offsets, t, rows, steps):
    """Row of each token ``t``: the last ``r < rows`` with ``offsets[r] <= t`` (binary search)."""
    lo = t.to(tl.int64) * 0
    hi = lo + rows - 1
    for _ in range(steps):
        act = lo < hi
        mid = (lo + hi + 1) // 2
        go = tl.load(offsets + mid, mask=act, other=0).to(tl.int64) <= t
        lo = tl.where(act & go, mid, lo)
        hi = tl.where(act & ~go, mid - 1, hi)
    return lo


@triton.jit
def _tokens(tokens, positions, offsets, rows, steps, cached, table, width, span, bs, table_rows, stamps, num_slots,
            seeds, over, t, m, SEEDED: tl.constexpr, BLOCK_TABLE: tl.constexpr, HAS_TROWS: tl.constexpr,
            HAS_OVER: tl.constexpr):
    """Per token: row, index in its row, token, position, and the affine map (``a = 0`` at a head).

    A head's ``b`` folds in its row's seed (= :func:`kvcanary.checks.canonical_seeds`): read from
    ``seeds`` when ``SEEDED``, else from the stamps (before this step's writes), unless ``over``
    (int64 ``[2, rows]``: :func:`kvcanary.checks.canonical_seeds`) gives it."""
    row = row_of(offsets, t, rows, steps)
    j = t - tl.load(offsets + row, mask=m, other=0).to(tl.int64)
    tok = tl.load(tokens + t, mask=m, other=0).to(tl.int64)
    pos = tl.load(positions + t, mask=m, other=0).to(tl.int64)
    head = m & (j == 0)
    c = tl.load(cached + row, mask=m, other=0).to(tl.int64)
    trow = row
    if HAS_TROWS:
        trow = tl.load(table_rows + row, mask=m, other=0).to(tl.int64)
    if SEEDED:
        seed = u64(tl.load(seeds + row, mask=head, other=0))
    else:
        ps = lookup(table, trow, tl.where(head, c - 1, -1), width, span, bs, BLOCK_TABLE)
        ok = head & (c > 0) & (ps >= 0) & (ps < num_slots)
        link = tl.load(stamps + tl.where(ok, ps, 0) * 4 + 2, mask=ok, other=0)
        seed = u64(tl.where(c > 0, link, 0x5EEDC0DE7A110001))
        if HAS_OVER:
            given = tl.load(over + row, mask=head, other=0)
            seed = tl.where(tl.load(over + rows + row, mask=head, other=0) == 1, u64(given), seed)
    a = tl.where(head, 0, 0x9E3779B97F4A7C15).to(tl.uint64)
    b = g_term(u64(tok), u64(pos)) + tl.where(head, seed * 0x9E3779B97F4A7C15, 0)
    a = tl.where(m, a, 1)  # identity beyond the last token
    b = tl.where(m, b, 0)
    return row, trow, j, c, tok, pos, seed, a, b


@triton.jit
def _writes(slots, valid, row, t, m, num_slots, HAS_VALID: tl.constexpr):
    """Per token: its slot, whether it writes (a real slot of a valid row), whether it is stamped
    (written inside the pool)."""
    slot = tl.load(slots + t, mask=m, other=-1).to(tl.int64)
    writes = m & (slot >= 0)
    if HAS_VALID:
        writes = writes & (tl.load(valid + row, mask=m, other=0) != 0)
    return slot, writes, writes & (slot < num_slots)


@triton.jit
def _block_aggregates(tokens, positions, offsets, rows, steps, cached, table, width, span, bs, table_rows, stamps,
                      num_slots, seeds, over, agg, n, slots, valid, writers,
                      BLOCK: tl.constexpr, BLOCK_TABLE: tl.constexpr, HAS_TROWS: tl.constexpr,
                      HAS_VALID: tl.constexpr, HAS_OVER: tl.constexpr):
    """Each block's composed map, and each row's seed (stored by the block holding its head); counts
    each stamped slot's writers."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < n
    row, _, j, _, _, _, seed, a, b = _tokens(tokens, positions, offsets, rows, steps, cached, table, width, span, bs,
                                             table_rows, stamps, num_slots, seeds, over, t, m, False, BLOCK_TABLE,
                                             HAS_TROWS, HAS_OVER)
    tl.store(seeds + row, i64(seed), mask=m & (j == 0))
    slot, _, stamped = _writes(slots, valid, row, t, m, num_slots, HAS_VALID)
    tl.atomic_add(writers + tl.where(stamped, slot, 0), 1 << 32, mask=stamped, sem="relaxed")
    A, B = tl.associative_scan((a, b), 0, _combine)  # ordered; its last element is the block's map
    last = tl.arange(0, BLOCK) == BLOCK - 1
    tl.store(agg + tl.program_id(0) * 2, tl.sum(tl.where(last, i64(A), 0), axis=0))
    tl.store(agg + tl.program_id(0) * 2 + 1, tl.sum(tl.where(last, i64(B), 0), axis=0))


@triton.jit
def _carry(agg, carry, nblocks, NB: tl.constexpr):
    """carry[k] = value of the chain at the end of block k - 1 (0 for block 0), in passes of ``NB``
    blocks that start from the previous pass's last value."""
    y0 = tl.load(agg) * 0  # the chain's value before block 0
    for k0 in range(0, nblocks, NB):
        k = k0 + tl.arange(0, NB)
        m = k < nblocks
        a = tl.where(m, u64(tl.load(agg + k * 2, mask=m, other=1)), 1)
        b = tl.where(m, u64(tl.load(agg + k * 2 + 1, mask=m, other=0)), 0)
        A, B = tl.associative_scan((a, b), 0, _combine)
        y = A * u64(y0) + B  # the value at the end of block k
        tl.store(carry + k, i64(y0 + tl.zeros_like(k).to(tl.int64)), mask=k == k0)
        tl.store(carry + k + 1, i64(y), mask=(k + 1) < nblocks)
        y0 = tl.sum(tl.where(k == k0 + NB - 1, i64(y), 0), axis=0)


@triton.jit
def _write_kernel(
    stamps, num_slots, tokens, positions, slots, offsets, rows, steps, seeds, over, carry, contents, cached, valid,
    table, width, span, bs, table_rows, exp_tok, exp_pos, counters, ring, cap, n, bytes_per_slot, writers,
    BLOCK: tl.constexpr, SEEDED: tl.constexpr, BLOCK_TABLE: tl.constexpr, HAS_TROWS: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_EXP_TOK: tl.constexpr, HAS_EXP_POS: tl.constexpr, HAS_CONTENT: tl.constexpr,
    HAS_OVER: tl.constexpr,
):
    """Link = local scan applied to the block's carry; stamp written slots; write checks.

    Without ``SEEDED`` (one block) the seeds are read from the stamps here: every warp's reads
    feed the scan, which synchronizes the block before any stamp is written; the writers are
    counted here too. A slot with several writers gets ``EMPTY_STAMP`` from each of them."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < n
    row, trow, j, c, tok, pos, _, a, b = _tokens(tokens, positions, offsets, rows, steps, cached, table, width,
                                                 span, bs, table_rows, stamps, num_slots, seeds, over, t, m, SEEDED,
                                                 BLOCK_TABLE, HAS_TROWS, HAS_OVER)
    A, B = tl.associative_scan((a, b), 0, _combine)
    if SEEDED:
        B += A * u64(tl.load(carry + tl.program_id(0)))
    link = i64(B)
    slot, writes, stamped = _writes(slots, valid, row, t, m, num_slots, HAS_VALID)
    s = tl.where(stamped, slot, 0)
    if not SEEDED:
        tl.atomic_add(writers + s, 1 << 32, mask=stamped, sem="relaxed")
        tl.debug_barrier()  # every writer of the block counted before any ticket is taken
    ticket = tl.atomic_add(writers + s, 1, mask=stamped, sem="relaxed")  # one slot's counts: no ordering needed
    nwriters = ticket >> 32
    dup = stamped & (nwriters > 1)
    last = (ticket + 1).to(tl.int32) == nwriters.to(tl.int32)  # the low half counts earlier tickets
    tl.store(writers + s, 0, mask=stamped & last)
    exp = c + j
    tslot = lookup(table, trow, exp, width, span, bs, BLOCK_TABLE)
    checks = tl.where(writes & (pos != exp), 64, 0) | tl.where(writes & (tslot != slot), 128, 0)
    checks |= tl.where(writes & ~stamped, 32, 0) | tl.where(dup, 1024, 0)
    etok = t.to(tl.int64) * 0 - 1
    if HAS_EXP_TOK:
        etok = tl.load(exp_tok + t, mask=m, other=-1).to(tl.int64)
        checks |= tl.where(writes & (etok != -1) & (tok != etok), 256, 0)
    if HAS_EXP_POS:
        epos = tl.load(exp_pos + t, mask=m, other=0).to(tl.int64)
        checks |= tl.where(writes & (pos != epos), 512, 0)
    cont = t.to(tl.int64) * 0
    if HAS_CONTENT:
        cont = tl.where(stamped, tl.load(contents + t, mask=stamped, other=0), 0)
    gone = m & (t < 0)  # a row whose prefix is unknown: its slots become unknown too
    if HAS_OVER:
        gone = stamped & ~dup & (tl.load(over + rows + row, mask=m, other=0) == 2)
    tl.store(stamps + s * 4 + 0, tl.where(dup | gone, -1, tok), mask=stamped)
    tl.store(stamps + s * 4 + 1, tl.where(dup, -1, tl.where(gone, -2, pos)), mask=stamped)
    tl.store(stamps + s * 4 + 2, tl.where(dup | gone, 0, link), mask=stamped)
    tl.store(stamps + s * 4 + 3, tl.where(dup | gone, 0, cont), mask=stamped)
    nw = tl.sum((stamped & ~dup & ~gone).to(tl.int64), axis=0)
    bump(counters + 7, nw)
    bump(counters + 8, nw * bytes_per_slot)
    step_id = tl.load(counters + 0)
    z = t.to(tl.int64) * 0
    record(ring, counters, cap, checks != 0, 14,
           (z + 1, checks, z + step_id, row, slot, exp, etok, tok, pos, z, link, z, cont, tslot))


def writer_counts(stamps: torch.Tensor) -> torch.Tensor:
    """The per-slot writer counts of ``stamps`` (int64 ``[num_slots]``, zero between steps): made on
    the pool's first stamp and kept on the stamps tensor, so that one pool's steps share one."""
    buf: torch.Tensor | None = getattr(stamps, "_kvcanary_writers", None)
    if buf is None:
        buf = torch.zeros(stamps.shape[0], dtype=torch.int64, device=stamps.device)
        setattr(stamps, "_kvcanary_writers", buf)
    return buf


def stamp(stamps: torch.Tensor, src: SourceTable, step: Step, counters: torch.Tensor, ring: torch.Tensor,
          block: int = 256, carry_pass: int = CARRY_PASS,
          seeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Launch stamping for ``step``. Mutates ``stamps``, ``counters`` and ``ring`` only (and the
    pool's :func:`writer_counts`, which it leaves at zero; the first call on a pool allocates them:
    make it outside graph capture).

    ``block`` tokens per program; ``carry_pass`` block aggregates per pass of the carry scan;
    ``seeds``: :func:`kvcanary.checks.canonical_seeds` of the step, for rows that follow an
    unknown slot (``None``: every row seeds from its stored predecessor)."""
    dev = stamps.device
    n = step.num_new
    if n == 0:
        return
    r = step.num_rows
    num_slots = stamps.shape[0]
    writers = writer_counts(stamps)
    dummy = step.cached_lens
    contents = dummy
    if src.count:
        contents = torch.empty(n, dtype=torch.int64, device=dev)
        content_op(step.new_slots, src, num_slots, contents)
    table = step.table
    trows = step.table_rows if step.table_rows is not None else dummy
    steps = max(1, r - 1).bit_length()
    lookup_args = (step.cached_lens, table, table.shape[1], step.table_span, step.block_size, trows, stamps,
                   num_slots)
    valid = step.row_valid if step.row_valid is not None else dummy
    flags = dict(BLOCK_TABLE=step.block_table is not None, HAS_TROWS=step.table_rows is not None,
                 HAS_VALID=step.row_valid is not None)
    nblocks = triton.cdiv(n, block)
    over = dummy if seeds is None else torch.stack([seeds[0].long(), seeds[1].long()])
    flags["HAS_OVER"] = seeds is not None
    seeds_buf = carry = dummy
    try:
        if nblocks > 1:
            seeds_buf = torch.empty(r, dtype=torch.int64, device=dev)
            agg = torch.empty(nblocks, 2, dtype=torch.int64, device=dev)
            carry = torch.empty(nblocks, dtype=torch.int64, device=dev)
            _block_aggregates[(nblocks,)](step.new_tokens, step.new_positions, step.new_offsets, r, steps, *lookup_args,
                                          seeds_buf, over, agg, n, step.new_slots, valid, writers, BLOCK=block,
                                          **flags)
            _carry[(1,)](agg, carry, nblocks, NB=min(carry_pass, triton.next_power_of_2(nblocks)))
        _write_kernel[(nblocks,)](
            stamps, num_slots, step.new_tokens, step.new_positions, step.new_slots, step.new_offsets, r, steps,
            seeds_buf, over, carry, contents, step.cached_lens, valid, table,
            table.shape[1], step.table_span, step.block_size, trows,
            step.expected_new_tokens if step.expected_new_tokens is not None else dummy,
            step.expected_new_positions if step.expected_new_positions is not None else dummy,
            counters, ring, ring.shape[0], n, src.bytes_per_slot, writers,
            BLOCK=block, SEEDED=nblocks > 1,
            HAS_EXP_TOK=step.expected_new_tokens is not None, HAS_EXP_POS=step.expected_new_positions is not None,
            HAS_CONTENT=src.count > 0, **flags,
        )
    except BaseException:
        writers.zero_()  # a failed launch may leave counts that would later read as duplicates
        raise
