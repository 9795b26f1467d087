"""The compiled fold of many slots at once (:func:`kvcanary.fused.fold.fold_slots`, the verify window's
and the patrol's) gives every slot the fingerprint the slot-by-slot fold gives it, where runs of
neighbouring slots are folded element by element across them (:func:`kvcanary.fused.fold.fold_run`):
vLLM's CPU layouts, whose K is narrow and column-major (``vec``) or packed in 16-token groups (``amx``),
and a token-major one (wide words), over slot lists with runs that cross pages and packs, short runs,
gaps and absent entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcanary import layouts
from kvcanary.fused import available

pytestmark = pytest.mark.skipif(available() is not None, reason="numba is not installed")

BLOCKS, HEADS, BLOCK, DIM = 12, 2, 32, 64


def _folds():  # type: ignore[no-untyped-def]
    from numba import njit

    from kvcanary.fused.fold import fold_slot, fold_slots

    @njit
    def together(src, runs, keys, slots):  # type: ignore[no-untyped-def]
        return fold_slots(src, runs, keys, slots, slots.shape[0])

    @njit
    def one_by_one(src, runs, keys, slots):  # type: ignore[no-untyped-def]
        out = np.zeros(slots.shape[0], dtype=np.int64)
        for j in range(slots.shape[0]):
            if slots[j] >= 0:
                out[j] = fold_slot(src, runs, keys, slots[j])
        return out

    return together, one_by_one


def _layout(kind: str, layers: int, seed: int):  # type: ignore[no-untyped-def]
    """A pool of ``layers`` random layers in vLLM's CPU layout ``kind`` (``vec``, ``amx``) or a
    token-major one."""
    g = torch.Generator().manual_seed(seed)
    if kind == "token-major":
        return layouts.paged_kv_split([torch.randn(2, BLOCKS, BLOCK, HEADS, DIM, generator=g).to(torch.bfloat16)
                                       for _ in range(layers)])
    tensors = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g).to(torch.bfloat16) for _ in range(layers)]
    make = layouts.vllm_cpu_vec if kind == "vec" else layouts.vllm_cpu_amx
    return make(tensors, BLOCK, HEADS, DIM)


def _slots(rng: np.random.Generator, n: int) -> np.ndarray:
    """Runs of neighbouring slots of random lengths (1 to 70: across 16-token packs and 32-slot pages)
    from random starts, with absent entries (-1) among them."""
    out: list[int] = []
    while len(out) < 400:
        start, length = int(rng.integers(0, n)), int(rng.integers(1, 71))
        out += [s for s in range(start, min(start + length, n))]
        if rng.random() < 0.3:
            out.append(-1)
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("kind", ["vec", "amx", "token-major"])
def test_slots_folded_together_match_slot_by_slot(kind: str) -> None:
    from kvcanary.fused.fold import A_CHUNKS, A_TKS, A_WIDTH, SourceTable

    table = SourceTable(_layout(kind, layers=3, seed=1))
    side = (table.src[:, A_WIDTH] != 0) & (table.src[:, A_TKS] == table.src[:, A_WIDTH])
    if kind == "vec":
        assert side.any()  # the run fold is taken there
    # amx V (two tokens' elements in 4 bytes) is folded by lane chunks, the others element by element
    assert (table.src[:, A_CHUNKS] > 0).any() == (kind == "amx")
    together, one_by_one = _folds()
    slots = _slots(np.random.default_rng(7), BLOCKS * BLOCK)
    got = together(table.src, table.runs, table.keys, slots)
    want = one_by_one(table.src, table.runs, table.keys, slots)
    assert (got == want).all()
    assert (got[slots < 0] == 0).all() and (got[slots >= 0] != 0).all()


def test_lane_chunks_are_runs_of_words_a_pack_apart() -> None:
    """A packed narrow source's words, as (first word, count) pairs of runs each ``pack * width``
    bytes after the last; none where a pack's elements of a word do not fill 4 or 8 bytes, or the
    runs are short."""
    from kvcanary.fused.fold import pack_chunks

    # amx V of one head of 32 dimensions: two 16-element strips 1 KiB apart, a word every 4 bytes
    offs = [k * 4 for k in range(16)] + [1024 + k * 4 for k in range(16)]
    assert pack_chunks(offs, 2, 2, 2) == [0, 16, 16, 16]
    assert pack_chunks(offs, 1, 4, 1) == [0, 16, 16, 16]  # four 1-byte lanes in 4 bytes
    assert pack_chunks(offs, 2, 2, 4) == []  # the pack's elements are not side by side
    assert pack_chunks(offs, 2, 1, 2) == []  # no pack
    assert pack_chunks(offs, 4, 4, 4) == []  # 16 bytes a word: wider than a load
    assert pack_chunks([k * 64 for k in range(32)], 2, 2, 2) == []  # runs of one word


def test_byte_spans_cover_every_run_and_merge_runs_within_a_line() -> None:
    """The spans whose lines the fold hints ahead (:func:`kvcanary.fused.fold.byte_spans`): every byte
    of every run inside one, runs less than a cache line apart in one span, spans further apart
    kept apart."""
    from kvcanary.fused.fold import byte_spans

    # amx K of one head: a word every 32 bytes (16 tokens' 2-byte elements side by side), two strips
    offs = [k * 32 for k in range(8)] + [4096 + k * 32 for k in range(8)]
    assert byte_spans(offs, 2) == [0, 226, 4096, 4322]
    assert byte_spans([0, 64, 128], 8) == [0, 136]  # gaps inside lines the span needs anyway
    assert byte_spans([0, 128, 256], 8) == [0, 8, 128, 136, 256, 264]  # a whole line between: apart
    assert byte_spans([256, 0], 256) == [0, 512]  # out of order, touching
    assert byte_spans([], 2) == []


@pytest.mark.parametrize("kind", ["vec", "amx", "token-major"])
def test_the_table_spans_hold_every_run_of_every_source(kind: str) -> None:
    from kvcanary.fused.fold import A_RUN0, A_RUNW, A_SPAN0, A_SPANS, A_WIDTH, A_WORDS, SourceTable

    t = SourceTable(_layout(kind, layers=2, seed=2))
    for row in t.src:
        width = int(row[A_WIDTH])
        n = int(row[A_WORDS]) if width else -(-int(row[A_WORDS]) // int(row[A_RUNW]))
        size = width or 8 * int(row[A_RUNW])
        spans = t.runs[row[A_SPAN0]:row[A_SPAN0] + 2 * row[A_SPANS]].reshape(-1, 2)
        assert len(spans) >= 1 and (spans[:, 0] < spans[:, 1]).all()
        for a in t.runs[row[A_RUN0]:row[A_RUN0] + n]:
            assert ((spans[:, 0] <= a) & (a + size <= spans[:, 1])).sum() == 1, (kind, int(a))
