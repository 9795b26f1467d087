"""Stamp-after-write (Triton), parallel over tokens.

Same results as :func:`kvcanary.checks.stamp`. The links of all new tokens come from a scan of the
affine maps ``x -> a*x + b`` (``a = B``, ``b = g(token, position)``; ``a = 0`` at a row's first
token, whose ``b`` folds in the row's seed): block-local ``tl.associative_scan``, a one-program
scan of the block aggregates, then the write pass that applies each block's carry. Graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.checks import row_seeds
from kvcanary.kernels._common import g_term, i64, u64
from kvcanary.kernels.content import content as content_op
from kvcanary.kernels.verify import lookup, record
from kvcanary.step import Step
from kvcanary.violations import Check, Counter

# the kernels spell these as literals
assert [int(c) for c in (Check.WRITE_POSITION, Check.WRITE_TABLE, Check.WRITE_INPUT_TOKEN,
                         Check.WRITE_INPUT_POSITION)] == [64, 128, 256, 512]
assert (int(Counter.SLOTS_STAMPED), int(Counter.CONTENT_BYTES_STAMPED)) == (7, 8)


@triton.jit
def _combine(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _maps(tokens, positions, row_of, j_of, seeds, t, m):
    """The affine map of each token: ``a = 0`` at a row's first token, else ``B``."""
    tok = u64(tl.load(tokens + t, mask=m, other=0))
    pos = u64(tl.load(positions + t, mask=m, other=0))
    head = tl.load(j_of + t, mask=m, other=1) == 0
    seed = u64(tl.load(seeds + tl.load(row_of + t, mask=m, other=0), mask=m, other=0))
    g = g_term(tok, pos)
    a = tl.where(head, 0, 0x9E3779B97F4A7C15).to(tl.uint64)
    b = g + tl.where(head, seed * 0x9E3779B97F4A7C15, 0)
    a = tl.where(m, a, 1)  # identity beyond the last token
    b = tl.where(m, b, 0)
    return a, b


@triton.jit
def _block_aggregates(tokens, positions, row_of, j_of, seeds, agg, n, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a, b = _maps(tokens, positions, row_of, j_of, seeds, t, t < n)
    A, B = tl.associative_scan((a, b), 0, _combine)  # ordered; its last element is the block's map
    last = tl.arange(0, BLOCK) == BLOCK - 1
    tl.store(agg + tl.program_id(0) * 2, tl.sum(tl.where(last, i64(A), 0), axis=0))
    tl.store(agg + tl.program_id(0) * 2 + 1, tl.sum(tl.where(last, i64(B), 0), axis=0))


@triton.jit
def _carry(agg, carry, nblocks, NB: tl.constexpr):
    """carry[k] = value of the chain at the end of block k - 1 (0 for block 0)."""
    k = tl.arange(0, NB)
    m = k < nblocks
    a = tl.where(m, u64(tl.load(agg + k * 2, mask=m, other=1)), 1)
    b = tl.where(m, u64(tl.load(agg + k * 2 + 1, mask=m, other=0)), 0)
    _, y = tl.associative_scan((a, b), 0, _combine)
    tl.store(carry + k + 1, i64(y), mask=(k + 1) < nblocks)
    tl.store(carry + k, i64(y) * 0, mask=k == 0)


@triton.jit
def _write_kernel(
    stamps, tokens, positions, slots, row_of, j_of, seeds, carry, contents, cached, valid, table, width, span, bs,
    table_rows, exp_tok, exp_pos, counters, ring, cap, n, bytes_per_slot,
    BLOCK: tl.constexpr, BLOCK_TABLE: tl.constexpr, HAS_TROWS: tl.constexpr, HAS_VALID: tl.constexpr,
    HAS_EXP_TOK: tl.constexpr, HAS_EXP_POS: tl.constexpr,
):
    """Link = local scan applied to the block's carry; stamp written slots; write checks."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < n
    a, b = _maps(tokens, positions, row_of, j_of, seeds, t, m)
    A, B = tl.associative_scan((a, b), 0, _combine)
    link = i64(A * u64(tl.load(carry + tl.program_id(0))) + B)
    tok = tl.load(tokens + t, mask=m, other=0).to(tl.int64)
    pos = tl.load(positions + t, mask=m, other=0).to(tl.int64)
    slot = tl.load(slots + t, mask=m, other=-1).to(tl.int64)
    row = tl.load(row_of + t, mask=m, other=0)
    j = tl.load(j_of + t, mask=m, other=0)
    writes = m & (slot >= 0)
    if HAS_VALID:
        writes = writes & (tl.load(valid + row, mask=m, other=0) != 0)
    exp = tl.load(cached + row, mask=m, other=0).to(tl.int64) + j
    trow = row.to(tl.int64)
    if HAS_TROWS:
        trow = tl.load(table_rows + row, mask=m, other=0).to(tl.int64)
    tslot = lookup(table, trow, exp, width, span, bs, BLOCK_TABLE)
    checks = tl.where(writes & (pos != exp), 64, 0) | tl.where(writes & (tslot != slot), 128, 0)
    etok = t.to(tl.int64) * 0 - 1
    if HAS_EXP_TOK:
        etok = tl.load(exp_tok + t, mask=m, other=-1).to(tl.int64)
        checks |= tl.where(writes & (etok != -1) & (tok != etok), 256, 0)
    if HAS_EXP_POS:
        epos = tl.load(exp_pos + t, mask=m, other=0).to(tl.int64)
        checks |= tl.where(writes & (pos != epos), 512, 0)
    cont = tl.load(contents + t, mask=m, other=0)
    s = tl.where(writes, slot, 0)
    tl.store(stamps + s * 4 + 0, tok, mask=writes)
    tl.store(stamps + s * 4 + 1, pos, mask=writes)
    tl.store(stamps + s * 4 + 2, link, mask=writes)
    tl.store(stamps + s * 4 + 3, cont, mask=writes)
    nw = tl.sum(writes.to(tl.int64), axis=0)
    tl.atomic_add(counters + 7, nw)
    tl.atomic_add(counters + 8, nw * bytes_per_slot)
    step_id = tl.load(counters + 0)
    z = t.to(tl.int64) * 0
    record(ring, counters, cap, checks != 0, 14,
           (z + 1, checks, z + step_id, row.to(tl.int64), slot, exp, etok, tok, pos, z, link, z,
            tl.where(writes, cont, 0), tslot))


def stamp(stamps: torch.Tensor, layout_table: torch.Tensor, nsrc: int, bytes_per_slot: int, step: Step,
          counters: torch.Tensor, ring: torch.Tensor, block: int = 256) -> None:
    """Launch stamping for ``step``. Mutates ``stamps``, ``counters`` and ``ring`` only."""
    dev = stamps.device
    n = step.num_new
    if n == 0:
        return
    r = step.num_rows
    offs = step.new_offsets.long()
    counts = offs[1:] - offs[:-1]
    row_of = torch.repeat_interleave(torch.arange(r, device=dev), counts, output_size=n)
    j_of = torch.arange(n, device=dev) - offs[:-1][row_of]
    seeds = row_seeds(stamps, step)
    valid = step.valid_rows()
    contents = torch.zeros(n, dtype=torch.int64, device=dev)
    if nsrc:
        wslots = torch.where((step.new_slots >= 0) & valid[row_of], step.new_slots.long(), -1)
        content_op(wslots, layout_table, nsrc, contents)
    nblocks = triton.cdiv(n, block)
    agg = torch.empty(nblocks, 2, dtype=torch.int64, device=dev)
    carry = torch.empty(nblocks, dtype=torch.int64, device=dev)
    args = (step.new_tokens, step.new_positions, row_of, j_of, seeds)
    _block_aggregates[(nblocks,)](*args, agg, n, BLOCK=block)
    _carry[(1,)](agg, carry, nblocks, NB=triton.next_power_of_2(nblocks))
    table = step.table
    dummy = counts
    _write_kernel[(nblocks,)](
        stamps, step.new_tokens, step.new_positions, step.new_slots, row_of, j_of, seeds, carry, contents,
        step.cached_lens, step.row_valid if step.row_valid is not None else dummy, table, table.shape[1],
        step.table_span, step.block_size, step.table_rows if step.table_rows is not None else dummy,
        step.expected_new_tokens if step.expected_new_tokens is not None else dummy,
        step.expected_new_positions if step.expected_new_positions is not None else dummy,
        counters, ring, ring.shape[0], n, bytes_per_slot,
        BLOCK=block, BLOCK_TABLE=step.block_table is not None, HAS_TROWS=step.table_rows is not None,
        HAS_VALID=step.row_valid is not None, HAS_EXP_TOK=step.expected_new_tokens is not None,
        HAS_EXP_POS=step.expected_new_positions is not None,
    )
