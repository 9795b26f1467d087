"""Byte sources over every layout kind fingerprint the right bytes; bad layouts fail clearly."""

import pytest
import torch

from kvcanary.source import storage_bytes
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


@pytest.mark.parametrize("field", ["reserved", "guards"])
@pytest.mark.parametrize("value, shown", [(5, "int 5"), (None, "NoneType None"), ("12", "str '12'"),
                                          ((0, 1.5), r"tuple \(0, 1.5\)"), ([True], r"list \[True\]")])
def test_guard_slots_that_are_not_slot_ids(field, value, shown):
    with pytest.raises(LayoutError, match=rf"^{field}: expected slot ids \(a sequence of integers\), got {shown}$"):
        KvLayout(**{field: value})
    assert KvLayout(**{field: range(3)}).__dict__[field] == (0, 1, 2)  # any iterable of integers


HINT = (r" \(describe each tensor with ByteSource.from_tensor\(name, tensor, page_size=...\), or build the layout "
        r"with KvLayout.from_tensors\(\[\(name, tensor\), ...\], page_size=...\)\)$")


def test_bare_tensors_as_sources():
    t = torch.zeros(4, 4, 16, dtype=torch.uint8)
    with pytest.raises(LayoutError, match=r"^sources\[0\]: expected a ByteSource, got Tensor" + HINT):
        KvLayout((t,))
    with pytest.raises(LayoutError, match=r"^sources\[1\]: expected a ByteSource, got Tensor" + HINT):
        KvLayout([ByteSource.from_tensor("k", t, page_size=4), t])
    with pytest.raises(LayoutError, match=r"^sources: expected a tuple of ByteSource, got Tensor" + HINT):
        KvLayout(t)  # type: ignore[arg-type]


def test_a_source_that_is_not_a_tensor():
    import numpy as np

    with pytest.raises(LayoutError, match=r"^source 'k': expected a torch.Tensor \(the engine's KV memory\), got "
                                          r"ndarray \(torch.from_numpy wraps a numpy array without a copy\)$"):
        ByteSource.from_tensor("k", np.zeros((4, 16), dtype=np.uint8), page_size=None)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"^source 'k': expected a torch.Tensor \(the engine's KV memory\), got list$"):
        ByteSource.from_tensor("k", [[0] * 16] * 4)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"^source 'k': expected a torch.Tensor .*got NoneType$"):
        ByteSource("k", None, page_size=1, num_pages=4, page_stride=16, token_stride=0, rows=1,  # type: ignore[arg-type]
                   row_stride=16, row_bytes=16, offset=0)


def test_evenly_spaced_sources_of_one_storage_fuse_into_one_gather():
    base = torch.randint(0, 255, (6, 4, 64), dtype=torch.uint8)  # [pages, 4 sources x 16 B, ...] interleaved
    srcs = tuple(ByteSource("s%d" % i, base, page_size=1, num_pages=6, page_stride=256, token_stride=0, rows=1,
                            row_stride=16, row_bytes=16, offset=64 * i) for i in range(4))
    lay = KvLayout(srcs + (ByteSource.from_tensor("other", torch.ones(6, 16, dtype=torch.uint8)),))
    assert [r.keys.shape[0] for r in lay.gathers()] == [8, 2]
    want = [h.signed(h.py_content(slot_bytes(lay, s))) for s in range(6)]
    assert lay.fingerprint(torch.arange(6)).tolist() == want


# ---- narrow runs, groups of rows, packed slots --------------------------------------------------

def _described_words(src, slot):
    """A source's words of one slot straight from the address formula of :mod:`kvcanary.layout`."""
    raw = storage_bytes(src.tensor)
    base = src.slot_offset(slot)
    runs = []
    for off in src.run_offsets().tolist():
        runs.append(bytes(raw[base + off : base + off + src.row_bytes].tolist()))
    return h.py_words(runs)[: src.read_words]


def geometries():
    nb, bs, hh, d = 3, 8, 2, 4
    col = _rand((nb, hh, d, bs), seed=7)  # column-major per block and head: a token's elements bs apart
    pairs = torch.randint(0, 255, (nb, bs // 4, 3, 4, 16), dtype=torch.uint8)  # 4 tokens interleave, 3 rows each
    byte = torch.randint(0, 255, (nb, 5, bs), dtype=torch.uint8)
    grp = _rand((nb, 2, bs, 3, 8), seed=8)  # per token 2 groups of 3 rows of 16 bytes (2 back to back)
    es = 2
    return {
        "narrow_groups": ByteSource("k", col, page_size=bs, num_pages=nb, page_stride=hh * d * bs * es,
                                    token_stride=es, rows=d, row_stride=bs * es, row_bytes=es, offset=0,
                                    groups=((hh, d * bs * es),)),
        "narrow_partial": ByteSource("k", col, page_size=bs, num_pages=nb, page_stride=hh * d * bs * es,
                                     token_stride=es, rows=d, row_stride=bs * es, row_bytes=es, offset=0,
                                     groups=((hh, d * bs * es),), read_bytes=6),
        "bytes": ByteSource("q", byte, page_size=bs, num_pages=nb, page_stride=5 * bs, token_stride=1, rows=5,
                            row_stride=bs, row_bytes=1, offset=0),
        "wide_packed": ByteSource("v", pairs, page_size=bs, num_pages=nb, page_stride=bs * 3 * 16, token_stride=16,
                                  rows=3, row_stride=64, row_bytes=16, offset=0, token_pack=4, pack_stride=3 * 64),
        "wide_groups": ByteSource("g", grp, page_size=bs, num_pages=nb, page_stride=2 * bs * 48, token_stride=48,
                                  rows=3, row_stride=16, row_bytes=16, offset=0, groups=((2, bs * 48),)),
        "wide_groups_partial": ByteSource("g", grp, page_size=bs, num_pages=nb, page_stride=2 * bs * 48,
                                          token_stride=48, rows=3, row_stride=16, row_bytes=16, offset=0,
                                          groups=((2, bs * 48),), read_bytes=64),
    }


@pytest.mark.parametrize("kind", list(geometries()))
def test_narrow_grouped_and_packed_sources_match_the_address_formula(kind):
    src = geometries()[kind]
    flat = ByteSource.from_tensor("flat", _rand((src.num_slots, 16), seed=9))
    lay = KvLayout((flat, src))  # the second source: keys of source 1
    slots = torch.arange(src.num_slots)
    got = lay.fingerprint(slots, chunk_words=5).tolist()
    want = [h.signed(h.py_content_words([h.py_words(slot_bytes(KvLayout((flat,)), s)), _described_words(src, s)]))
            for s in range(src.num_slots)]
    assert got == want


def test_narrow_words_are_zero_extended_runs():
    t = torch.tensor([[0x0201, 0x0403]], dtype=torch.int16)  # one slot, two 2-byte runs of 0x..01 0x..02 bytes
    src = ByteSource("k", t, page_size=1, num_pages=1, page_stride=4, token_stride=0, rows=2, row_stride=2,
                     row_bytes=2, offset=0)
    lay = KvLayout((src,))
    assert _described_words(src, 0) == [0x0201, 0x0403]
    assert lay.fingerprint(torch.tensor([0])).tolist() == [h.signed(h.py_content_words([[0x0201, 0x0403]]))]
    t[0, 0] = -1  # 0xFFFF: its word is 0xFFFF, not a sign-extended -1
    assert lay.fingerprint(torch.tensor([0])).tolist() == [h.signed(h.py_content_words([[0xFFFF, 0x0403]]))]


def test_grouped_slot_bytes_view():
    src = geometries()["narrow_groups"]
    v = src.slot_bytes(9)  # page 1, token 1
    assert v.shape == (2, 4, 2)  # [heads, elements, bytes]
    raw = src.tensor.view(torch.uint8).view(3, 2, 4, 8, 2)  # [page, head, element, token, byte]
    before = int(raw[1, 1, 3, 1, 1])
    v[1, 3, 1] ^= 0xFF  # the last byte of the last element of the last head: a view, so it lands there
    assert int(raw[1, 1, 3, 1, 1]) == before ^ 0xFF
    assert src.slot_offset(9) == 2 * 4 * 8 * 2 + 2


@pytest.mark.parametrize("kind", list(geometries()))
def test_triton_content_equals_torch_on_the_same_geometries(kind):
    if torch.cuda.is_available():
        pytest.skip("these sources are CPU tensors; the Triton interpreter is off where CUDA is present")
    from kvcanary.kernels._common import source_table
    from kvcanary.kernels.content import content

    src = geometries()[kind]
    lay = KvLayout((ByteSource.from_tensor("flat", _rand((src.num_slots, 16), seed=9)), src))
    slots = torch.tensor([5, -1, 0, src.num_slots, src.num_slots - 1, 11, 7])
    out = torch.empty(7, dtype=torch.int64)
    table = source_table(lay, torch.device("cpu"))
    assert table.narrow == (src.narrow or src.packed)
    content(slots, table, src.num_slots, out)
    want = lay.fingerprint(slots.clamp(0, src.num_slots - 1))
    want[1] = want[3] = 0
    assert torch.equal(out, want)


def _geo(**kw):
    t = kw.pop("tensor", torch.zeros(4, 2, 4, 8, dtype=torch.float16))
    g = dict(name="k", tensor=t, page_size=8, num_pages=4, page_stride=128, token_stride=2, rows=4, row_stride=16,
             row_bytes=2, offset=0, groups=((2, 64),))
    g.update(kw)
    return ByteSource(**g)


@pytest.mark.parametrize("kw,msg", [
    (dict(row_bytes=12, rows=4, row_stride=12, groups=(), read_bytes=48),
     "row_bytes = 12 bytes is not a multiple of the 16-byte load width; a run is 1, 2 or 4 bytes, or a multiple of 16"),
    (dict(row_bytes=8, rows=1, row_stride=8, groups=()),
     r"positive multiple of 16 bytes, got 8 \(pass read_bytes explicitly\); a run is 1, 2 or 4 bytes"),
    (dict(row_bytes=4, token_stride=4, row_stride=6),
     "source 'k': row_stride = 6 bytes is not a multiple of the 4-byte run width"),
    (dict(token_stride=3), "source 'k': token_stride = 3 bytes is not a multiple of the 2-byte run width"),
    (dict(offset=1), "source 'k': offset = 1 bytes is not a multiple of the 2-byte run width"),
    (dict(read_bytes=5), "content read size must be a positive multiple of the 2-byte run width, got 5"),
    (dict(read_bytes=32), r"content read size 32 exceeds the bytes per token \(16\)"),
    (dict(token_pack=3), "source 'k': token_pack 3 must divide page_size 8"),
    (dict(token_pack=4, pack_stride=0), "source 'k': pack_stride: expected > 0 bytes with 2 packs per page"),
    (dict(groups=((0, 64),)), r"source 'k': group count must be >= 1, got 0 in groups \(\(0, 64\),\)"),
    (dict(groups=((2, -64),)), r"source 'k': groups\[0\] stride: expected >= 0 bytes, got -64"),
    (dict(page_stride=48, row_bytes=16, rows=1, groups=((2, 24),), token_stride=16),
     r"source 'k': groups\[0\] stride = 24 bytes is not a multiple of the 16-byte load width"),
    (dict(num_pages=5), "described bytes end at 640, beyond the tensor's storage of 512 bytes"),
])
def test_bad_narrow_or_grouped_geometry(kw, msg):
    with pytest.raises(LayoutError, match=msg):
        _geo(**kw)


def test_groups_that_overlap_rows_are_rejected():
    with pytest.raises(LayoutError, match=r"source 'k': two of its slots or rows both cover byte 16 .*groups "
                                          r"\(\(2, 16\),\)"):
        KvLayout((_geo(groups=((2, 16),)),))
    KvLayout((_geo(),))  # heads 64 bytes apart: disjoint
