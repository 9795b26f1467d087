"""Content fingerprint of a list of slots over every source of a layout (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.kernels._common import SourceTable, fold_sources, i64

TILE = 2048  # words of one content tile ([slots, chunk]): 16 per lane at 4 warps


@triton.jit
def _content_kernel(slots, out, n, num_slots, src, nsrc, ntiles, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                    SAME_PS: tl.constexpr, EVEN: tl.constexpr, NARROW: tl.constexpr):
    """out[i] = fingerprint(slots[i]) for 0 <= slots[i] < num_slots, else 0."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(slots + i, mask=m, other=-1).to(tl.int64)
    ok = m & (s >= 0) & (s < num_slots)
    fp = fold_sources(tl.where(ok, s, 0), ok, src, nsrc, ntiles, CHUNK, SAME_PS, EVEN, NARROW)
    tl.store(out + i, tl.where(ok, i64(fp), 0), mask=m)


def content_block(chunk: int) -> int:
    """Slots per program of a content tile ``chunk`` words wide (at most 256: the per-slot state
    stays in registers)."""
    return min(256, max(16, TILE // chunk))


def content(slots: torch.Tensor, src: SourceTable, num_slots: int, out: torch.Tensor) -> None:
    """Fingerprint ``slots`` (int ``[n]``) into ``out`` (int64 ``[n]``); a slot outside
    ``[0, num_slots)`` gives 0. Mutates ``out`` only."""
    n = slots.shape[0]
    if n == 0:
        return
    if src.count == 0:
        out.zero_()
        return
    block = content_block(src.chunk)
    _content_kernel[(triton.cdiv(n, block),)](slots, out, n, num_slots, src.table, src.count, src.tiles,
                                              BLOCK=block, CHUNK=src.chunk, SAME_PS=src.same_page_size,
                                              EVEN=src.even, NARROW=src.narrow)
