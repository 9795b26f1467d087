"""Byte sources over every layout kind fingerprint the right bytes; bad layouts fail clearly."""

import pytest
import torch

from kvcanary import ByteSource, Canary, KvLayout, LayoutError
from kvcanary import hashing as h
from kvcanary.layout import MAX_SOURCES

from loopref import slot_bytes


def _rand(shape, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2000, 2000, shape, generator=g).to(dtype)


def layouts():
    nb, bs, hh, d = 5, 4, 2, 8
    paged = _rand((nb, bs, hh, d))
    packed = _rand((nb, 2, bs, hh, d), seed=1)
    head_major = _rand((nb, hh, bs, d), seed=2)
    wide = _rand((nb, bs + 3, hh, d), seed=3)[:, 1 : bs + 1]  # padded pages: page stride != bs * row
    q = torch.randint(-128, 127, (nb * bs, 64), dtype=torch.int8)
    scales = torch.rand(nb * bs, 4)
    return {
        "flat": KvLayout.from_tensors([("k", _rand((nb * bs, hh, d), seed=4)), ("v", _rand((nb * bs, hh, d), seed=5))]),
        "paged": KvLayout((ByteSource.from_tensor("k", paged, page_size=bs),)),
        "packed": KvLayout(tuple(ByteSource.from_tensor(n, packed[:, i], page_size=bs) for i, n in enumerate("kv"))),
        "head_major": KvLayout((ByteSource.from_tensor("k", head_major.permute(0, 2, 1, 3), page_size=bs),)),
        "strided_pages": KvLayout((ByteSource.from_tensor("k", wide, page_size=bs),)),
        "mla": KvLayout((ByteSource.from_tensor("latent", _rand((nb * bs, 48), seed=6)),)),
        "quantized": KvLayout((ByteSource.from_tensor("q", q), ByteSource.from_tensor("scale", scales))),
        "partial": KvLayout((ByteSource.from_tensor("k", paged, page_size=bs, read_bytes=16),)),
    }


@pytest.mark.parametrize("kind", list(layouts()))
def test_fingerprint_matches_loop(kind):
    lay = layouts()[kind]
    slots = torch.arange(lay.sources[0].num_slots)
    got = lay.fingerprint(slots, chunk_words=7).tolist()
    want = [h.signed(h.py_content(slot_bytes(lay, s))) for s in range(len(slots))]
    assert got == want


def test_head_major_rows_are_described():
    t = torch.zeros(3, 2, 4, 8, dtype=torch.float16)
    src = ByteSource.from_tensor("k", t.permute(0, 2, 1, 3), page_size=4)
    assert (src.rows, src.row_bytes, src.row_stride, src.token_stride) == (2, 16, 64, 16)


def test_every_byte_of_last_row_is_covered():
    lay = layouts()["head_major"]
    src = lay.sources[0]
    base = lay.fingerprint(torch.tensor([7]))
    raw = src.tensor  # permuted view [nb, bs, h, d]
    raw.view(torch.int16)[1, 3, 1, 7] ^= 1  # slot 7 = page 1, offset 3, last head, last element
    assert not torch.equal(lay.fingerprint(torch.tensor([7])), base)


def test_read_size_too_large():
    with pytest.raises(LayoutError, match="read size 96 exceeds the bytes per token \\(64\\)"):
        ByteSource.from_tensor("k", torch.zeros(4, 32, dtype=torch.float16), read_bytes=96)


def test_read_size_not_multiple_of_16():
    with pytest.raises(LayoutError, match="positive multiple of 16 bytes, got 24"):
        ByteSource.from_tensor("k", torch.zeros(4, 32, dtype=torch.float16), read_bytes=24)
    with pytest.raises(LayoutError, match="got 8 \\(pass read_bytes explicitly\\)"):
        ByteSource.from_tensor("s", torch.zeros(4, 2, dtype=torch.float32))


def test_source_must_cover_every_slot():
    lay = KvLayout.from_tensors([("k", torch.zeros(10, 16, dtype=torch.uint8))])
    with pytest.raises(LayoutError, match="source 'k' covers 10 slots .* fewer than the pool's 12"):
        Canary(12, lay)


def test_inner_dim_not_contiguous():
    t = torch.zeros(4, 8, 4, 16, dtype=torch.float16).permute(0, 2, 3, 1)  # [4, 4, 16, 8], dim stride mess
    with pytest.raises(LayoutError, match="inner dimension .* is not contiguous"):
        ByteSource.from_tensor("k", t, page_size=4)


def test_too_many_sources():
    t = torch.zeros(4, 16, dtype=torch.uint8)
    src = ByteSource.from_tensor("k", t)
    with pytest.raises(LayoutError, match=f"{MAX_SOURCES + 1} sources, more than the kernel source table holds \\({MAX_SOURCES}\\)"):
        KvLayout((src,) * (MAX_SOURCES + 1))


def test_unaligned_stride():
    t = torch.zeros(4, 24, dtype=torch.uint8)[:, :16]
    with pytest.raises(LayoutError, match="page_stride = 24 bytes is not a multiple of the 16-byte load width"):
        ByteSource.from_tensor("k", t)


def test_geometry_beyond_storage():
    t = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="beyond the tensor's storage of 64 bytes"):
        ByteSource("k", t, page_size=1, num_pages=5, page_stride=16, token_stride=0, rows=1,
                   row_stride=16, row_bytes=16, offset=0)


def test_paged_dim_must_match_page_size():
    with pytest.raises(LayoutError, match="dim 1 is 4, expected page_size 8"):
        ByteSource.from_tensor("k", torch.zeros(3, 4, 16, dtype=torch.uint8), page_size=8)


def test_evenly_spaced_sources_of_one_storage_fuse_into_one_gather():
    base = torch.randint(0, 255, (6, 4, 64), dtype=torch.uint8)  # [pages, 4 sources x 16 B, ...] interleaved
    srcs = tuple(ByteSource("s%d" % i, base, page_size=1, num_pages=6, page_stride=256, token_stride=0, rows=1,
                            row_stride=16, row_bytes=16, offset=64 * i) for i in range(4))
    lay = KvLayout(srcs + (ByteSource.from_tensor("other", torch.ones(6, 16, dtype=torch.uint8)),))
    assert [r.keys.shape[0] for r in lay._runs] == [8, 2]
    want = [h.signed(h.py_content(slot_bytes(lay, s))) for s in range(6)]
    assert lay.fingerprint(torch.arange(6)).tolist() == want
