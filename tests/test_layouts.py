"""The layout builders describe real KV caches exactly: every slot's fingerprint is the one of the
bytes the engine's own indexing puts there, a flipped byte anywhere changes its slot's fingerprint
and no other's, the Triton content op agrees, and the sources cover every byte of the cache once.

The loop references below index the cache as each engine does (vLLM CPU ``vec``/``amx``: the
kernels' ``[2 * block_size, head_dim]`` view of each block and head; FlashAttention-style pages),
on a tensor of element indices laid out like the cache, and read each run's bytes from those.
"""

import random
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from kvcanary import LayoutError, layouts
from kvcanary import hashing as h
from kvcanary.kernels._common import source_table
from kvcanary.kernels.content import content

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
Runs = Callable[[int], list[list[int]]]  # slot -> the runs of one source, each a list of element indices


@dataclass
class Case:
    layout: object
    buf: torch.Tensor  # uint8, the whole cache (every layer tensor is a view of it)
    es: int
    refs: list[Runs]  # per source, in layout order
    num_slots: int


def _buf(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _index(t: torch.Tensor) -> torch.Tensor:
    """Element index (in the storage) of every entry of ``t``, laid out like ``t``."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.arange(n).as_strided(t.shape, t.stride(), t.storage_offset())


def vllm_cpu(isa: str, dtype, layers: int, nb: int, heads: int, bs: int, dim: int, seed: int = 0,
             device="cpu") -> Case:
    es = torch.empty(0, dtype=dtype).element_size()
    buf = _buf(layers * nb * heads * bs * 2 * dim * es, seed).to(device)
    cache = buf.view(dtype).view(layers, nb, heads, bs, 2 * dim)  # one allocation for all layers
    tensors = [cache[i] for i in range(layers)]
    build = layouts.vllm_cpu_vec if isa == "vec" else layouts.vllm_cpu_amx
    refs: list[Runs] = []
    for t in tensors:
        kv = _index(t).view(nb, heads, 2 * bs, dim)  # the kernels' view: K rows, then V rows
        k = kv[:, :, :bs].reshape(nb, heads, bs * dim)  # each block and head's K region, flat
        v = kv[:, :, bs:].reshape(nb, heads, bs * dim)
        refs += [_cpu_k(isa, k, bs, heads, dim), _cpu_v(isa, v, bs, heads, dim, es)]
    return Case(build(tensors, bs, heads, dim), buf, es, refs, nb * bs)


def _cpu_k(isa: str, k: torch.Tensor, bs: int, heads: int, dim: int) -> Runs:
    def runs(slot: int) -> list[list[int]]:
        b, t = divmod(slot, bs)
        if isa == "vec":  # column-major [head_dim, block_size]: k_cache[block, head, d, t]
            return [[int(k[b, hh, d * bs + t])] for hh in range(heads) for d in range(dim)]
        # 4-byte pairs (2j, 2j + 1) of 16 tokens interleaved: pair j of token t in its 16-token group
        pair = [(t // 16) * 16 * (dim // 2) + j * 16 + t % 16 for j in range(dim // 2)]
        return [[int(k[b, hh, 2 * p]), int(k[b, hh, 2 * p + 1])] for hh in range(heads) for p in pair]
    return runs


def _cpu_v(isa: str, v: torch.Tensor, bs: int, heads: int, dim: int, es: int) -> Runs:
    def runs(slot: int) -> list[list[int]]:
        b, t = divmod(slot, bs)
        if isa == "vec":  # row-major [block_size, head_dim]; a head's row is one run where it is wide
            rows = [[int(v[b, hh, t * dim + d]) for d in range(dim)] for hh in range(heads)]
            return rows if dim * es % 16 == 0 else [[e] for r in rows for e in r]
        # token pairs in 16-element strips of the head: element d = 16 i + k
        at = [(d // 16) * 16 * bs + (t // 2) * 32 + (d % 16) * 2 + t % 2 for d in range(dim)]
        return [[int(v[b, hh, q])] for hh in range(heads) for q in at]
    return runs


def paged(kind: str, dtype, layers: int, nb: int, bs: int, heads: int, dim: int, seed: int = 0,
          hnd: bool = False, device="cpu") -> Case:
    es = torch.empty(0, dtype=dtype).element_size()
    buf = _buf(layers * 2 * nb * bs * heads * dim * es, seed).to(device)
    if kind == "split":
        shape = (layers, 2, nb, heads, bs, dim) if hnd else (layers, 2, nb, bs, heads, dim)
        cache = buf.view(dtype).view(shape)
        tensors = [cache[i].transpose(2, 3) if hnd else cache[i] for i in range(layers)]  # [2, nb, bs, H, D]
        halves = [(_index(t)[0], _index(t)[1]) for t in tensors]
        lay = layouts.paged_kv_split(tensors)
    else:
        cache = buf.view(dtype).view(layers, nb, 2, bs, heads, dim)
        tensors = [cache[i] for i in range(layers)]
        halves = [(_index(t)[:, 0], _index(t)[:, 1]) for t in tensors]
        lay = layouts.paged_kv_packed(tensors)
    refs = [_page_runs(x, bs, heads, dim, es, hnd) for pair in halves for x in pair]
    return Case(lay, buf, es, refs, nb * bs)


def _page_runs(x: torch.Tensor, bs: int, heads: int, dim: int, es: int, hnd: bool) -> Runs:
    def runs(slot: int) -> list[list[int]]:
        b, t = divmod(slot, bs)
        heads_ = [[int(x[b, t, hh, d]) for d in range(dim)] for hh in range(heads)]  # kv[0][block, t, head, d]
        wide = dim * es % 16 == 0 if hnd else heads * dim * es % 16 == 0
        if not wide:
            return [[e] for r in heads_ for e in r]
        return heads_ if hnd else [[e for r in heads_ for e in r]]
    return runs


CASES = {  # name: (factory, args, keywords); shapes [layers, num_blocks, heads, block_size, head_dim] or as paged()
    "vec_fp32": (vllm_cpu, ("vec", torch.float32, 2, 3, 2, 16, 8), {}),
    "vec_fp16": (vllm_cpu, ("vec", torch.float16, 2, 2, 2, 32, 8), dict(seed=1)),
    "vec_bf16_narrow_v": (vllm_cpu, ("vec", torch.bfloat16, 1, 3, 2, 16, 4), dict(seed=2)),  # V rows of 8 bytes
    "amx": (vllm_cpu, ("amx", torch.bfloat16, 2, 2, 2, 32, 32), dict(seed=3)),
    "amx_one_head": (vllm_cpu, ("amx", torch.bfloat16, 1, 3, 1, 16, 16), dict(seed=4)),
    "split_fp16": (paged, ("split", torch.float16, 2, 3, 16, 2, 8), dict(seed=5)),
    "split_hnd_fp32": (paged, ("split", torch.float32, 1, 3, 16, 2, 8), dict(seed=6, hnd=True)),
    "split_bf16_odd": (paged, ("split", torch.bfloat16, 2, 3, 16, 2, 6), dict(seed=7)),  # 24-byte rows
    "packed_fp32": (paged, ("packed", torch.float32, 2, 3, 16, 2, 4), dict(seed=8)),
}


def make(name: str, device="cpu") -> Case:
    fn, args, kw = CASES[name]
    return fn(*args, **kw, device=device)


def ref_words(case: Case, raw: bytes, slot: int) -> list[list[int]]:
    es = case.es
    return [h.py_words([b"".join(raw[e * es : e * es + es] for e in run) for run in ref(slot)]) for ref in case.refs]


def ref_owner(case: Case) -> torch.Tensor:
    """The slot each byte of the cache belongs to, by the engines' formulas (-1: none, -2: several)."""
    owner = torch.full((case.buf.shape[0],), -1, dtype=torch.int64)
    for slot in range(case.num_slots):
        for ref in case.refs:
            for e in (e for run in ref(slot) for e in run):
                at = slice(e * case.es, e * case.es + case.es)
                owner[at] = torch.where(owner[at] == -1, slot, -2)
    return owner


@pytest.mark.parametrize("name", list(CASES))
def test_fingerprint_is_the_engine_bytes(name):
    case = make(name)
    raw = bytes(case.buf.tolist())
    got = case.layout.fingerprint(torch.arange(case.num_slots), chunk_words=97).tolist()
    want = [h.signed(h.py_content_words(ref_words(case, raw, s))) for s in range(case.num_slots)]
    assert got == want


@pytest.mark.parametrize("name", list(CASES))
def test_every_byte_belongs_to_exactly_one_slot(name):
    case = make(name)
    owner = ref_owner(case)
    assert bool((owner >= 0).all()), f"bytes of no slot or of several: {(owner < 0).nonzero()[:5].tolist()}"
    cover = torch.zeros(case.buf.shape[0], dtype=torch.int64)  # and so says the layout itself
    base = case.buf.untyped_storage().data_ptr()
    for src in case.layout.sources:
        assert src.tensor.untyped_storage().data_ptr() == base
        for slot in range(case.num_slots):
            v = src.slot_bytes(slot)
            at = torch.arange(cover.shape[0]).as_strided(v.shape, v.stride(), v.storage_offset()).reshape(-1)
            assert bool((owner[at] == slot).all()), (src.name, slot)
            cover.index_add_(0, at, torch.ones_like(at))
    assert bool((cover == 1).all()), (cover != 1).nonzero()[:5].tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_a_flipped_byte_changes_its_slot_only(name):
    case = make(name)
    owner = ref_owner(case)
    slots = torch.arange(case.num_slots)
    base = case.layout.fingerprint(slots)
    rng = random.Random(name)
    n = case.buf.shape[0]
    for at in [0, n - 1] + rng.sample(range(n), 24):  # any layer, K or V
        bit = 1 << rng.randrange(8)
        case.buf[at] ^= bit
        changed = (case.layout.fingerprint(slots) != base).nonzero().reshape(-1).tolist()
        case.buf[at] ^= bit
        assert changed == [int(owner[at])], (at, changed)
    assert torch.equal(case.layout.fingerprint(slots), base)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_content_equals_torch(name):
    case = make(name, DEV)
    ns = case.num_slots
    slots = torch.randperm(ns, device=DEV)[: min(ns, 37)]
    slots[3], slots[4] = -1, ns  # outside the pool: 0
    table = source_table(case.layout, DEV)
    assert table.narrow == any(s.narrow or s.packed for s in case.layout.sources)
    out = torch.empty(slots.shape[0], dtype=torch.int64, device=DEV)
    content(slots, table, ns, out)
    want = case.layout.fingerprint(slots.clamp(0, ns - 1))
    want[3] = want[4] = 0
    assert torch.equal(out, want), (out != want).nonzero()[:5].tolist()


def test_wide_pages_keep_the_fast_path_and_narrow_ones_do_not():
    cpu = torch.device("cpu")
    assert not source_table(make("split_fp16").layout, cpu).narrow
    assert not source_table(make("packed_fp32").layout, cpu).narrow
    assert source_table(make("vec_fp16").layout, cpu).narrow
    assert source_table(make("amx").layout, cpu).narrow


def test_split_pages_fingerprint_as_before():
    """A builder's source over wide pages is :meth:`ByteSource.from_tensor`'s: the same fingerprint."""
    from kvcanary import ByteSource, KvLayout

    t = torch.randint(-999, 999, (2, 5, 16, 2, 8)).to(torch.float16)
    old = KvLayout(tuple(ByteSource.from_tensor(n, t[i], page_size=16) for i, n in enumerate(("layer0.k", "layer0.v"))))
    slots = torch.arange(80)
    assert torch.equal(layouts.paged_kv_split([t]).fingerprint(slots), old.fingerprint(slots))


def test_names_and_order():
    lay = make("amx").layout
    assert [s.name for s in lay.sources] == ["layer0.k", "layer0.v", "layer1.k", "layer1.v"]
    k, v = lay.sources[:2]
    assert (k.row_bytes, k.rows, k.row_stride, k.token_pack, k.pack_stride, k.token_stride) == (4, 16, 64, 16, 1024, 4)
    assert (v.row_bytes, v.groups, v.rows, v.row_stride, v.token_pack) == (2, ((2, 4096), (2, 1024)), 16, 4, 2)


@pytest.mark.parametrize("call,msg", [
    (lambda: layouts.vllm_cpu_vec([torch.zeros(3, 2, 16, 8)], 16, 2, 8),
     r"layer 0: expected \[num_blocks, 2, 16, 16\] .*got shape \(3, 2, 16, 8\)"),
    (lambda: layouts.vllm_cpu_vec([torch.zeros(3, 2, 16, 32)[..., :16]], 16, 2, 8),
     r"layer 0: expected each block and head contiguous .*got strides \(1024, 512, 32, 1\)"),
    (lambda: layouts.vllm_cpu_amx([torch.zeros(3, 2, 16, 64)], 16, 2, 32),
     r"layer 0: amx layout: expected 2-byte elements \(bf16\), got torch.float32"),
    (lambda: layouts.vllm_cpu_amx([torch.zeros(3, 2, 8, 64, dtype=torch.bfloat16)], 8, 2, 32),
     r"expected block_size and head_dim multiples of 16, got block_size 8, head_dim 32"),
    (lambda: layouts.paged_kv_split([torch.zeros(3, 5, 16, 2, 8)]),
     r"layer 0: expected \[2, num_blocks, block_size, num_kv_heads, head_dim\], got shape \(3, 5, 16, 2, 8\)"),
    (lambda: layouts.paged_kv_packed([torch.zeros(5, 3, 16, 2, 8)]), r"layer 0: expected \[num_blocks, 2, "),
    (lambda: layouts.paged_kv_split([]), "expected at least one layer tensor, got none"),
])
def test_builder_errors(call, msg):
    with pytest.raises(LayoutError, match=msg):
        call()
