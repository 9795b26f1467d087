"""Scrub (Triton): re-fingerprint a list of stamped slots and compare with their stamps.

Same results as :func:`kvcanary.checks.scrub`: unstamped, released and unknown slots (position
< 0) and slots outside the pool are passed over and not counted; a content mismatch is one ring
row at the caller's site (``scrub`` or ``transfer``). No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.kernels._common import SourceTable, fold_sources, i64
from kvcanary.kernels.content import content_block
from kvcanary.kernels.verify import bump, record
from kvcanary.violations import Counter, Site

assert (int(Counter.SLOTS_SCRUBBED), int(Counter.CONTENT_BYTES_SCRUBBED)) == (9, 10)


@triton.jit
def _scrub_kernel(stamps, num_slots, slots, n, src, nsrc, ntiles, bytes_per_slot, counters, ring, cap, site,
                  BLOCK: tl.constexpr, CHUNK: tl.constexpr, SAME_PS: tl.constexpr, EVEN: tl.constexpr,
                  NARROW: tl.constexpr, HAS_CONTENT: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(slots + i, mask=m, other=-1).to(tl.int64)
    ok = m & (s >= 0) & (s < num_slots)
    sa = tl.where(ok, s, 0)
    pos = tl.load(stamps + sa * 4 + 1, mask=ok, other=-1)
    live = ok & (pos >= 0)
    tok = tl.load(stamps + sa * 4 + 0, mask=live, other=0)
    link = tl.load(stamps + sa * 4 + 2, mask=live, other=0)
    cont = tl.load(stamps + sa * 4 + 3, mask=live, other=0)
    exp = s * 0
    bad = live & False
    if HAS_CONTENT:
        exp = tl.where(live, i64(fold_sources(sa, live, src, nsrc, ntiles, CHUNK, SAME_PS, EVEN, NARROW)), 0)
        bad = live & (cont != exp)
    nlive = tl.sum(live.to(tl.int64), axis=0)
    bump(counters + 9, nlive)
    bump(counters + 10, nlive * bytes_per_slot)
    step_id = tl.load(counters + 0)
    z = s * 0
    record(ring, counters, cap, bad, 14,
           (z + site, z + 8, z + step_id, z - 1, s, pos, z - 1, tok, pos, z, link, exp, cont, z - 1))


def scrub(stamps: torch.Tensor, src: SourceTable, slots: torch.Tensor, counters: torch.Tensor, ring: torch.Tensor,
          site: Site = Site.SCRUB) -> None:
    """Scrub ``slots`` (int ``[n]``). Mutates ``counters`` and ``ring`` only."""
    n = slots.shape[0]
    if n == 0:
        return
    block = content_block(src.chunk) if src.count else 256
    _scrub_kernel[(triton.cdiv(n, block),)](stamps, stamps.shape[0], slots, n, src.table, src.count, src.tiles,
                                            src.bytes_per_slot, counters, ring, ring.shape[0], int(site),
                                            BLOCK=block, CHUNK=src.chunk, SAME_PS=src.same_page_size,
                                            EVEN=src.even, NARROW=src.narrow, HAS_CONTENT=src.count > 0)
