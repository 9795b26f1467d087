"""Each cache geometry (kvcanary.geometry) against an independent writer in that geometry.

Per geometry, the test writes a distinct value into every K and V element of every slot at the
address the engine's own layout gives (the formulas below, written from each engine's indexing, not
from kvcanary's), then checks that the geometry's every view agrees with it:

- typed rows (the torch reference) read back what was written, with and without a head per slot;
- the compiled loops' descriptors address the same elements (strided geometries);
- the byte sources cover exactly the slot's K (V) bytes, each once (what the fingerprint reads);
- the fault injectors' element offsets and row writes hit exactly those elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from kvcanary.geometry.base import KvGeometry
from kvcanary.geometry.pages import page_major
from kvcanary.geometry.token_pages import TokenPages
from kvcanary.geometry.vllm_cpu import AmxKv, vllm_cpu
from kvcanary.geometry.vllm_gpu import vllm_gpu

from vllm_layouts import allocate, element
from kvcanary.source import storage_bytes

Address = Callable[[str, int, int, int], int]  # (half, slot, head, dim) -> element index in the storage


@dataclass
class Case:
    geometry: KvGeometry
    address: Address  # the engine's own indexing, in elements of the storage
    heads: int
    dim: int


def vllm_vec(dtype: torch.dtype = torch.float32, nb: int = 5, heads: int = 2, bs: int = 16, dim: int = 8) -> Case:
    """vLLM CPU ``vec``: ``[nb, heads, bs, 2 * dim]``, per block and head K as ``[dim, bs]`` then V as ``[bs, dim]``."""
    t = torch.zeros(nb, heads, bs, 2 * dim, dtype=dtype)

    def address(half: str, slot: int, h: int, d: int) -> int:
        b, i = divmod(slot, bs)
        base = (b * heads + h) * bs * 2 * dim
        return base + (d * bs + i if half == "k" else bs * dim + i * dim + d)

    return Case(vllm_cpu(t, "vec", bs, heads, dim), address, heads, dim)


def vllm_amx(nb: int = 3, heads: int = 2, bs: int = 32, dim: int = 32) -> Case:
    """vLLM CPU ``amx`` (bf16): K in 16-token tiles of dimension pairs, V in 16-dimension strips of token pairs."""
    t = torch.zeros(nb, heads, bs, 2 * dim, dtype=torch.bfloat16)

    def address(half: str, slot: int, h: int, d: int) -> int:
        b, i = divmod(slot, bs)
        base = (b * heads + h) * bs * 2 * dim * 2  # bytes
        if half == "k":
            byte = (i // 16) * 32 * dim + (d // 2) * 64 + (i % 16) * 4 + (d % 2) * 2
        else:
            byte = bs * dim * 2 + (d // 16) * 32 * bs + (i // 2) * 64 + (d % 16) * 4 + (i % 2) * 2
        return (base + byte) // 2

    return Case(AmxKv(t, bs, heads, dim), address, heads, dim)


def token_pages(layer_index: int = 1, layers: tuple[int, ...] = (0, 3, 5), tpp: int = 8, blocks: int = 4,
                heads: int = 2, dim: int = 16, dtype: torch.dtype = torch.float16) -> Case:
    """transformers CB: token rows ``[Hkv, D]``, each block a K and a V page per layer; compact slots."""
    stride = 2 * len(layers) * tpp
    total = blocks * stride // 2 + tpp  # a little more than the blocks hold, as the engine's trash sectors
    cache = torch.zeros(total, 2, heads, dim, dtype=dtype)
    i = layers.index(layers[layer_index])

    def address(half: str, slot: int, h: int, d: int) -> int:
        physical = (slot // tpp) * stride + slot % tpp
        row = (2 * i + (half == "v")) * tpp + physical
        return (row * heads + h) * dim + d

    pages = TokenPages(cache, tpp, stride, layers)
    return Case(pages.layer(layers[layer_index]), address, heads, dim)


def pages_nhd(packed: bool = False, nb: int = 4, bs: int = 16, heads: int = 2, dim: int = 8) -> Case:
    """FlashAttention-style pages: ``[2, nb, bs, heads, dim]`` (split) or ``[nb, 2, bs, heads, dim]`` (packed)."""
    if packed:
        t = torch.zeros(nb, 2, bs, heads, dim)
        k, v = t[:, 0], t[:, 1]
    else:
        t = torch.zeros(2, nb, bs, heads, dim)
        k, v = t[0], t[1]

    def address(half: str, slot: int, h: int, d: int) -> int:
        b, i = divmod(slot, bs)
        j = int(half == "v")
        at = (b, j, i, h, d) if packed else (j, b, i, h, d)
        return sum(x * s for x, s in zip(at, t.stride()))

    return Case(page_major(k, v), address, heads, dim)


def pages_hnd(nb: int = 4, bs: int = 16, heads: int = 3, dim: int = 8) -> Case:
    """A head-major cache ``[nb, 2, heads, bs, dim]`` (FlashInfer's HND), passed as its permuted view."""
    t = torch.zeros(nb, 2, heads, bs, dim)

    def address(half: str, slot: int, h: int, d: int) -> int:
        b, i = divmod(slot, bs)
        return sum(x * s for x, s in zip((b, int(half == "v"), h, i, d), t.stride()))

    return Case(page_major(t[:, 0].permute(0, 2, 1, 3), t[:, 1].permute(0, 2, 1, 3)), address, heads, dim)


def vllm_gpu_case(backend: str, layout: str, layer: int = 1, nb: int = 4, heads: int = 2, bs: int = 16,
                 dim: int = 8, dtype: torch.dtype = torch.float16) -> Case:
    """vLLM 0.32's GPU backends: per layer a ``[nb, heads, bs, 2 * dim]`` view (K then V on the last
    axis) of one allocation of 3 layers, the axes in memory in the layout's order."""
    views, strides = allocate(layout, 3, nb, heads, bs, dim, dtype)

    def address(half: str, slot: int, h: int, d: int) -> int:
        return element(strides, bs, dim, layer, half, slot, h, d)

    return Case(vllm_gpu(views[layer], backend, layout, bs, heads, dim), address, heads, dim)


CASES = {
    "vllm_flash_attn_nhd": lambda: vllm_gpu_case("FLASH_ATTN", "LBNHC"),
    "vllm_flashinfer_hnd": lambda: vllm_gpu_case("FLASHINFER", "LBHNC"),
    "vllm_flashinfer_cross_layer_hnd": lambda: vllm_gpu_case("FLASHINFER", "BLHNC", layer=2),
    "vllm_triton_attn_cross_layer_nhd": lambda: vllm_gpu_case("TRITON_ATTN", "BLNHC", layer=0, dtype=torch.float32),
    "vllm_flex_attention_one_head": lambda: vllm_gpu_case("FLEX_ATTENTION", "LBNHC", heads=1, bs=8),
    "vllm_vec_fp32": lambda: vllm_vec(),
    "vllm_vec16_bf16": lambda: vllm_vec(torch.bfloat16, bs=32, dim=32),
    "vllm_vec_one_head": lambda: vllm_vec(heads=1, bs=8, dim=4),
    "vllm_amx": vllm_amx,
    "transformers_token_pages": token_pages,
    "transformers_token_pages_first_layer": lambda: token_pages(layer_index=0, layers=(2,)),
    "pages_split_nhd": pages_nhd,
    "pages_packed_nhd": lambda: pages_nhd(packed=True),
    "pages_hnd": pages_hnd,
}


BITS = {2: torch.int16, 4: torch.int32}


def _elements(g: KvGeometry) -> torch.Tensor:
    """The storage as integers of the elements' width (values compared bit for bit)."""
    st = g.tensor.untyped_storage()
    flat = torch.empty(0, dtype=BITS[g.element_size])
    return flat.set_(st, 0, (st.nbytes() // g.element_size,), (1,))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.element_size()])


def _written(case: Case, seed: int = 0) -> dict[tuple[str, int, int, int], float]:
    """Write a distinct bit pattern into every element through the engine's own addresses; return them."""
    g = case.geometry
    flat = _elements(g)
    flat.zero_()
    gen = torch.Generator().manual_seed(seed)
    keys = [(half, s, h, d) for half in "kv" for s in range(g.num_slots) for h in range(case.heads)
            for d in range(case.dim)]
    assert len(keys) < 2 ** (8 * g.element_size - 1)
    values = (torch.randperm(len(keys), generator=gen) + 1).to(flat.dtype)  # distinct bit patterns: 1 .. n
    addrs = [case.address(*k) for k in keys]
    assert len(set(addrs)) == len(addrs), "the independent writer writes some element twice"
    flat[torch.tensor(addrs)] = values
    return dict(zip(keys, values.tolist()))


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]()


def test_typed_rows_read_what_the_engine_wrote(case: Case):
    g = case.geometry
    want = _written(case)
    slots = torch.arange(g.num_slots)
    for half in "kv":
        rows = _bits(g.rows(half, slots))
        assert rows.shape == (g.num_slots, case.heads, case.dim)
        expect = torch.tensor([[[want[(half, s, h, d)] for d in range(case.dim)] for h in range(case.heads)]
                               for s in range(g.num_slots)], dtype=rows.dtype)
        assert torch.equal(rows, expect), f"{half}: first mismatch at {(rows != expect).nonzero()[0].tolist()}"
        heads = slots % case.heads
        assert torch.equal(_bits(g.rows(half, slots[:, None].expand(-1, 2), heads[:, None].expand(-1, 2))),
                           expect[slots, heads][:, None].expand(-1, 2, -1))


def test_descriptors_address_the_same_elements(case: Case):
    g = case.geometry
    descs = g.descriptors()
    assert descs is not None
    base = g.tensor.untyped_storage().data_ptr()
    es = g.element_size
    for half, desc in zip("kv", descs):
        addr, block, bstride, tstride, hstride, dstride, tile, tile_stride, strip, strip_stride = desc
        assert block == g.block_size and block % tile == 0 and case.dim % strip == 0
        assert (tile, strip) != (block, case.dim) or not isinstance(g, AmxKv)  # amx: tiles and strips
        for s in range(0, g.num_slots, 3):
            t = s % block
            for h in range(case.heads):
                for d in range(case.dim):
                    at = (addr + (s // block) * bstride + (t // tile) * tile_stride + (t % tile) * tstride
                          + h * hstride + (d // strip) * strip_stride + (d % strip) * dstride)
                    assert (at - base) == case.address(half, s, h, d) * es


def test_byte_sources_cover_exactly_each_slots_bytes(case: Case):
    g = case.geometry
    es = g.element_size
    for src, half in zip(g.sources("layer"), "kv"):
        assert src.name == f"layer.{half}" and src.num_slots >= g.num_slots
        offs = src.run_offsets()
        for s in range(g.num_slots):
            covered = (src.slot_offset(s) + offs[:, None] + torch.arange(src.row_bytes)).reshape(-1).tolist()
            want = [case.address(half, s, h, d) * es + b for h in range(case.heads) for d in range(case.dim)
                    for b in range(es)]
            assert len(covered) == len(set(covered)) == src.bytes_per_token
            assert sorted(covered) == sorted(want), f"{half} of slot {s}"


def test_element_offsets_and_row_writes_hit_exactly_those_elements(case: Case):
    g = case.geometry
    es = g.element_size
    for half in "kv":
        for s, h, d in [(0, 0, 0), (g.num_slots - 1, case.heads - 1, case.dim - 1), (g.block_size + 1, 0, 1)]:
            assert g.element(half, s, h, d) == case.address(half, s, h, d) * es
    want = _written(case)
    before = _elements(g).clone()
    slot = g.block_size + 1
    g.set_rows("v", torch.tensor([slot]), 0)
    after = _elements(g)
    changed = (after != before).nonzero().reshape(-1).tolist()
    assert sorted(changed) == sorted(case.address("v", slot, h, d) for h in range(case.heads) for d in range(case.dim))
    assert all(want[("v", slot, h, d)] != 0 for h in range(case.heads) for d in range(case.dim))
    flat = storage_bytes(g.tensor)
    off = g.element("k", 0, 0, 0)
    flat[off] ^= 1
    assert int(_bits(g.k_rows(torch.tensor([0])))[0, 0, 0]) != want[("k", 0, 0, 0)]
