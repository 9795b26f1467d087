"""The compiled write check and read audit (:func:`kvcanary.fused.audit.check_forward`) read every
vLLM CPU layout as its geometry's torch rows do: ``vec`` at plain strides (bf16, fp32) and ``amx``
(bf16: K in 16-token tiles of dimension pairs, V in 16-dimension strips of token pairs), and
transformers' token rows (a token's heads one after another, compared a whole token at once), through the
same descriptors (:meth:`kvcanary.geometry.base.KvGeometry.descriptors`). Each query's error equals
the torch reference's on random cache contents, where one misplaced element would show; a changed
element of a computed K or V row, each element of each head in turn, is reported in its half and head,
and nothing else is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcanary.fused import available

pytestmark = pytest.mark.skipif(available() is not None, reason="numba is not installed")

BLOCKS, HEADS, BLOCK, DIM, REP = 6, 2, 32, 64, 3  # REP query heads per KV head


@pytest.mark.parametrize("isa,dtype", [("vec", torch.bfloat16), ("vec", torch.float32), ("amx", torch.bfloat16),
                                       ("tokens", torch.bfloat16), ("tokens", torch.float32)])
def test_the_compiled_audit_reads_each_vllm_cpu_layout_as_the_reference(isa: str, dtype: torch.dtype) -> None:
    from kvcanary.audit.reference import DTYPES, attend, error
    from kvcanary.audit.tables import (F_SCALE, F_TOL_BASE, FLOATS_PER_LAYER, Q_CACHED, Q_HEAD, Q_KV_HEAD, Q_LAYER,
                                       Q_PICKED, Q_POSITION, Q_ROW, Q_SINK, Q_START, Q_TOKEN, QUERY_COLUMNS,
                                       layer_row, strides)
    from kvcanary.fused._step import describe
    from kvcanary.fused.audit import check_forward
    from kvcanary.geometry.vllm_cpu import vllm_cpu
    from kvcanary.step import Step

    g = torch.Generator().manual_seed(11)
    if isa == "tokens":  # transformers continuous batching: one layer's K and V pages in each block
        from kvcanary.geometry.token_pages import TokenPages

        rows = torch.randn(BLOCKS * BLOCK, 2, HEADS, DIM, generator=g).to(dtype)
        geo = TokenPages(rows, BLOCK, 2 * BLOCK, [0]).layer(0)
    else:
        geo = vllm_cpu(torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g).to(dtype), isa, BLOCK, HEADS, DIM)
    # two requests, one new token each: 21 positions in block 3, and 42 over blocks 1 and 4 (an even slot
    # and an odd one: amx V holds a pair of tokens' elements in each 4-byte word, one in each lane)
    table = torch.tensor([[3, -1], [1, 4]])
    positions = torch.tensor([20, 41])
    new_slots = table[torch.arange(2), positions // BLOCK] * BLOCK + positions % BLOCK
    step = Step(cached_lens=positions, new_offsets=torch.tensor([0, 1, 2]), new_tokens=torch.tensor([7, 9]),
                new_positions=positions, new_slots=new_slots, block_table=table, block_size=BLOCK)
    descs = geo.descriptors()
    assert descs is not None
    layers = np.array([layer_row(descs[0], descs[1], 0, DTYPES[dtype], geo.element_size, HEADS, DIM,
                                 geo.num_slots - 1, DTYPES[dtype])], dtype=np.int64)
    scale = DIM ** -0.5
    fl = np.zeros(FLOATS_PER_LAYER)
    fl[F_SCALE], fl[F_TOL_BASE] = scale, 1e-2

    # every query head of both requests, each against its reference over the positions it reads
    qt = np.array([[0] * QUERY_COLUMNS for _ in range(2 * HEADS * REP)], dtype=np.int64)
    for i, (r, h) in enumerate((r, h) for r in range(2) for h in range(HEADS * REP)):
        qt[i, [Q_PICKED, Q_LAYER, Q_ROW, Q_TOKEN, Q_HEAD, Q_KV_HEAD, Q_POSITION, Q_START, Q_CACHED, Q_SINK]] = \
            [i, 0, r, r, h, h // REP, int(positions[r]), 0, int(positions[r]), -1]
    query = torch.randn(2, HEADS * REP, DIM, generator=g).to(dtype)
    width = int(positions.max()) + 1
    pos = torch.arange(width)
    read = table[:, None].expand(2, width, 2).gather(2, (pos // BLOCK).clamp(max=1)[None, :, None].expand(2, -1, 1))
    read_slots = read[..., 0] * BLOCK + pos % BLOCK  # [2, width]: each request's slot of each position
    valid = pos[None] <= positions[:, None]
    rows, heads = qt[:, Q_ROW], qt[:, Q_KV_HEAD]
    k = geo.k_rows(read_slots[rows], torch.from_numpy(heads)[:, None].expand(-1, width))
    v = geo.v_rows(read_slots[rows], torch.from_numpy(heads)[:, None].expand(-1, width))
    q = query[rows, qt[:, Q_HEAD]]
    ref, vmax, _ = attend(q, k, v, valid[rows], scale)
    noise = torch.randn(ref.shape, generator=g) * torch.linspace(0, 0.2, len(qt))[:, None]  # errors of every size
    out = torch.zeros(2, HEADS * REP, DIM, dtype=dtype)
    out[rows, qt[:, Q_HEAD]] = (ref + noise * vmax[:, None]).to(dtype)
    want = error(out[rows, qt[:, Q_HEAD]], ref, vmax).numpy()

    ck = geo.k_rows(new_slots).contiguous()  # what the layer computed, as the cache holds it
    cv = geo.v_rows(new_slots).contiguous()
    st = np.array(strides(ck, 0, 1, 2) + strides(cv, 0, 1, 2) + strides(query, 0, 1, 2) + strides(out, 0, 1, 2),
                  dtype=np.int64)
    ptrs = np.array([[ck.data_ptr(), cv.data_ptr(), query.data_ptr(), out.data_ptr()]], dtype=np.int64)

    def run() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        half, head = np.full((1, 2), 7, dtype=np.int64), np.full((1, 2), 7, dtype=np.int64)  # zeroed by the call
        err, shift, tol = np.full(len(qt), -1.0), np.zeros(len(qt), dtype=np.int64), np.zeros(len(qt))
        differ = check_forward(layers, ptrs, st, describe(step)[None], np.arange(2), qt, fl, half, head, err, shift,
                               tol, False)
        assert differ == np.count_nonzero(half)
        return err, half[0], head[0]

    err, half, head = run()
    assert np.allclose(err, want, rtol=1e-3, atol=1e-4), (err, want)
    assert err[0] < 1e-2 < err[-1]
    assert half.tolist() == [0, 0]
    ck[1, 1, DIM - 1] = ck[1, 1, DIM - 1] + 1  # request 1's K, last head, last dim: the last strip of a tile
    cv[0, 1, 17] = cv[0, 1, 17] + 1  # request 0's V, last head, second strip
    _, half, head = run()
    assert half.tolist() == [2, 1] and head.tolist() == [1, 1]
    ck.copy_(geo.k_rows(new_slots))
    cv.copy_(geo.v_rows(new_slots))
    # every element of every head, K and V, of both tokens: its lowest and highest bit flipped is found in
    # its half and head, whatever word the compare reads it in (a strip of a pair, a row of 8-byte words,
    # one element, an element in its lane of a word)
    bits = torch.int16 if geo.element_size == 2 else torch.int32
    top = -(1 << (8 * geo.element_size - 1))  # the sign bit, as the signed view holds it
    for r in range(2):
        for which, rows_ in ((1, ck), (2, cv)):
            for h in range(HEADS):
                for d in range(DIM):
                    for bit in (1, top):
                        rows_.view(bits)[r, h, d] ^= bit
                        _, half, head = run()
                        rows_.view(bits)[r, h, d] ^= bit
                        want_half, want_head = [0, 0], [0, 0]
                        want_half[r], want_head[r] = which, h
                        assert half.tolist() == want_half and head.tolist() == want_head, (r, which, h, d, bit)
    assert run()[1].tolist() == [0, 0]
