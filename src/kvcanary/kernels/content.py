"""Content fingerprint of a list of slots over every source of a layout (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.kernels._common import fold_sources, i64


@triton.jit
def _content_kernel(slots, out, n, src, nsrc, BLOCK: tl.constexpr, WCHUNK: tl.constexpr):
    """out[i] = fingerprint(slots[i]) for slots[i] >= 0, else 0."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(slots + i, mask=m, other=-1).to(tl.int64)
    ok = m & (s >= 0)
    fp = fold_sources(tl.where(ok, s, 0), ok, src, nsrc, WCHUNK)
    tl.store(out + i, tl.where(ok, i64(fp), 0), mask=m)


def content(slots: torch.Tensor, src_table: torch.Tensor, nsrc: int, out: torch.Tensor) -> None:
    """Fingerprint ``slots`` (int ``[n]``; negative = skip, gives 0) into ``out`` (int64 ``[n]``).

    Mutates ``out`` only. ``src_table`` is :func:`kvcanary.kernels._common.source_table`.
    """
    n = slots.shape[0]
    if n == 0:
        return
    if nsrc == 0:
        out.zero_()
        return
    block = 32
    _content_kernel[(triton.cdiv(n, block),)](slots, out, n, src_table, nsrc, BLOCK=block, WCHUNK=64)
