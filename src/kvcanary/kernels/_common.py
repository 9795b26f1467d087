"""Triton helpers shared by the kernels: the hashing formulas of :mod:`kvcanary.hashing` in uint64.

Only imported when a Triton op is used; ``import kvcanary`` never needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary import hashing
from kvcanary.layout import KvLayout

NUM_SRC_FIELDS = 8  # addr, page_size, page_stride, token_stride, row_stride, row_words, read_words, key_index


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
def fold_sources(slots, mask, src, nsrc, WCHUNK: tl.constexpr):
    """Content fingerprints of ``slots`` ``[BLOCK]`` over every source of the table ``src``:
    ``fmix64(SALT ^ sum_{s,j} wmix(word[s,j] ^ key(s,j)))``; masked lanes give junk."""
    acc = tl.zeros(slots.shape, dtype=tl.uint64)
    slots = slots.to(tl.int64)
    for s in range(nsrc):
        row = src + s * 8
        addr = tl.load(row + 0)
        ps = tl.load(row + 1)
        base = addr // 8 + (slots // ps) * tl.load(row + 2) + (slots % ps) * tl.load(row + 3)
        rstride = tl.load(row + 4)
        rw = tl.load(row + 5)
        nw = tl.load(row + 6)
        kidx = tl.load(row + 7)
        for w0 in range(0, nw, WCHUNK):
            j = w0 + tl.arange(0, WCHUNK)
            jm = j < nw
            woff = (j // rw) * rstride + j % rw
            ptr = ((base[:, None] + woff[None, :]) * 8).to(tl.pointer_type(tl.int64))
            v = tl.load(ptr, mask=mask[:, None] & jm[None, :], other=0).to(tl.uint64, bitcast=True)
            key = fmix64(((kidx << 32) | j).to(tl.uint64, bitcast=True) ^ 0x9FB21C651E98DF25)
            x = (v ^ key[None, :]) * 0xD6E8FEB86659FD93
            x ^= x >> 29
            acc += tl.sum(tl.where(jm[None, :], x, 0), axis=1)
    return fmix64(acc ^ 0xA0761D6478BD642F)


def source_table(layout: KvLayout, device: torch.device) -> torch.Tensor:
    """The layout as an int64 ``[num_sources, 8]`` table of byte addresses and word strides."""
    rows = []
    for i, s in enumerate(layout.sources):
        addr = s.tensor.untyped_storage().data_ptr() + s.offset
        rw = min(s.read_bytes or 0, s.row_bytes) // 8
        rows.append([addr, s.page_size, s.page_stride // 8, s.token_stride // 8, s.row_stride // 8, rw,
                     s.read_words, i])
    if not rows:
        return torch.zeros(1, NUM_SRC_FIELDS, dtype=torch.int64, device=device)
    return torch.tensor(rows, dtype=torch.int64, device=device)


assert hashing.LINK_B == 0x9E3779B97F4A7C15 and hashing.POS_SALT == 0x2545F4914F6CDD1D
assert hashing.KEY_SALT == 0x9FB21C651E98DF25 and hashing.WORD_MUL == 0xD6E8FEB86659FD93
assert hashing.CONTENT_SALT == 0xA0761D6478BD642F and hashing.FMIX_C1 == 0xFF51AFD7ED558CCD
