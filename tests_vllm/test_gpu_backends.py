"""vLLM's GPU attention backends, as the installed vLLM allocates their caches, under kvcanary's
geometry (:mod:`kvcanary.geometry.vllm_gpu`) and the connector's choice of it
(:mod:`kvcanary.engines.vllm.backends`). No GPU is needed: the caches are CPU tensors.

The backend classes are vLLM's own where they import on this CPU build (FlashAttention, Triton
attention, FlexAttention and the MLA backends); FlashInfer's module needs the ``flashinfer``
package, which has no CPU build, so it is named by a stand-in that answers as it does
(``get_name()`` ``"FLASHINFER"``, any layout). Each cache is vLLM's allocation of the resolved layout
(``compute_layout_strides`` and ``create_kv_cache_views``) of a two-layer full-attention group,
then:

- the views' strides are those of ``tests/vllm_layouts.py`` (where ``tests/test_vllm_gpu.py``
  proves stamps, verify and fault detection on every canary backend, Triton included);
- K and V written through plain indexing of the backends' documented ``[num_blocks, num_kv_heads,
  block_size, 2 * head_size]`` view (K on ``[..., :head_size]``) read back through the geometry;
- a canary over them stamps, verifies clean and finds one flipped byte.
"""

from __future__ import annotations

import os
import random
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from vllm_layouts import allocate  # noqa: E402

NB, BS, H, D = 6, 16, 2, 8
DTYPE = torch.bfloat16


def _classes() -> dict[str, type]:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    class FlashInferStandIn:  # vllm.v1.attention.backends.flashinfer needs the flashinfer package
        @staticmethod
        def get_name() -> str:
            return "FLASHINFER"

        @classmethod
        def supported_kv_cache_layouts(cls) -> None:
            return None

    return {c.get_name(): c for c in (FlashAttentionBackend, FlashInferStandIn, TritonAttentionBackend,
                                      FlexAttentionBackend)}


def _layouts(cls: type) -> list[str]:
    got = cls.supported_kv_cache_layouts()
    return [x.name for x in got] if got else ["LBNHC", "LBHNC", "BLNHC", "BLHNC"]


CASES = [("FLASH_ATTN", "LBNHC"), ("FLASH_ATTN", "LBHNC"), ("FLASHINFER", "LBNHC"), ("FLASHINFER", "LBHNC"),
         ("FLASHINFER", "BLHNC"), ("TRITON_ATTN", "BLNHC"), ("FLEX_ATTENTION", "LBNHC")]


def spec():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=DTYPE)


def vllm_views(layout: str, layers: int = 2) -> list[torch.Tensor]:
    """vLLM's own allocation of ``layers`` same-shaped layers in ``layout``, each layer's view."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    lay, sp = KVCacheLayout[layout], spec()
    layer_stride, block_stride, *_ = compute_layout_strides(sp, NB, layers, lay)
    raw = torch.zeros(NB * layers * sp.page_size_bytes, dtype=torch.int8)
    t = KVCacheTensor(size=raw.numel(), layers=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                      layer_stride=layer_stride, block_stride=block_stride)
    return create_kv_cache_views(raw, sp, NB, lay, t)


def forward_context(names: list[str], cls: type) -> SimpleNamespace:
    """A stand-in ``vllm_config`` whose forward context gives each layer the backend ``cls``."""
    layer = SimpleNamespace(get_attn_backend=lambda: cls)
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={n: layer for n in names}),
                           cache_config=SimpleNamespace(kv_cache_layout=None))


@pytest.mark.parametrize("backend,layout", CASES)
def test_vllm_allocation_matches_the_tested_layout_and_the_geometry_reads_it(backend, layout):
    from kvcanary import Canary, CanaryConfig, Check
    from kvcanary.engines.vllm import backends
    from kvcanary.layout import KvLayout
    from kvcanary.step import Step

    cls = _classes()[backend]
    assert layout in _layouts(cls)
    views = vllm_views(layout)
    ours, _ = allocate(layout, 2, NB, H, BS, D, DTYPE)
    for v, o in zip(views, ours):  # vLLM's views are tests/vllm_layouts.py's, stride for stride
        assert v.dtype == DTYPE and v.shape == o.shape and v.stride() == o.stride()
        assert v.storage_offset() == o.storage_offset()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    cfg = forward_context(names, cls)
    kv_config = SimpleNamespace(kv_cache_layout=layout)
    assert backends.backend_of(cfg, names[0]) == backend
    geoms = [backends.geometry(backends.backend_of(cfg, n), t, BS, spec(), backends.resolved_layout(cfg, kv_config), i)
             for i, (n, t) in enumerate(zip(names, views))]
    g = torch.Generator().manual_seed(1)
    kv = [[torch.randn(NB * BS, H, D, generator=g).to(DTYPE) for _ in range(2)] for _ in views]
    for t, (k, v) in zip(views, kv):  # the backends' documented view: K on [..., :head_size], V after it
        for s in range(NB * BS):
            t[s // BS, :, s % BS, :D], t[s // BS, :, s % BS, D:] = k[s], v[s]
    slots = torch.arange(NB * BS)
    for geom, (k, v) in zip(geoms, kv):
        assert torch.equal(geom.k_rows(slots), k) and torch.equal(geom.v_rows(slots), v)
    layout_ = KvLayout(tuple(s for i, x in enumerate(geoms) for s in x.sources(f"layer{i}")), reserved=tuple(range(BS)))
    c = Canary(NB * BS, layout_, CanaryConfig(mode="log", backend="torch", content_budget_bytes=None,
                                              patrol_budget_bytes=0))
    table = torch.tensor([[1, 2], [3, 4]])
    n = [20, 9]
    rng = random.Random(0)
    toks = [[rng.randrange(500) for _ in range(k)] for k in n]
    pos = torch.tensor([p for k in n for p in range(k)])
    row = torch.tensor([r for r, k in enumerate(n) for _ in range(k)])
    new_slots = table[row, pos // BS] * BS + pos % BS
    exp = torch.full((2, 32), -1, dtype=torch.int64)
    for r, t in enumerate(toks):
        exp[r, : len(t)] = torch.tensor(t)
    pre = Step(cached_lens=torch.zeros(2, dtype=torch.int64), new_offsets=torch.tensor([0, n[0], n[0] + n[1]]),
               new_tokens=torch.tensor([x for t in toks for x in t]), new_positions=pos, new_slots=new_slots,
               block_table=table, block_size=BS, expected_tokens=exp)
    c.after_forward(pre)
    empty = torch.empty(0, dtype=torch.int64)
    read = Step(cached_lens=torch.tensor(n), new_offsets=torch.zeros(3, dtype=torch.int64), new_tokens=empty,
                new_positions=empty, new_slots=empty, block_table=table, block_size=BS, expected_tokens=exp)
    c.before_forward(read)
    c.after_forward(read)
    assert c.drain() == []
    slot = 2 * BS + 1  # row 0, position 17: layer 1's K, head 1, dim 3, at the backend's own index
    views[1][2, 1, 1, 3] = -views[1][2, 1, 1, 3] - 1
    c.before_forward(read)
    c.after_forward(read)
    got = [(v.slot, v.position, v.row, Check.CONTENT in v.checks) for v in c.drain()]
    assert got == [(slot, 17, 0, True)]


def test_each_known_backend_has_a_geometry_and_others_are_refused_by_name():
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    from kvcanary.engines.vllm import backends
    from kvcanary.errors import UnsupportedError
    from kvcanary.geometry.vllm_gpu import BACKENDS

    classes = _classes()
    assert sorted(classes) == sorted(BACKENDS)  # every GPU backend kvcanary knows, tested above
    t = vllm_views("LBNHC", 1)[0]
    cfg = forward_context(["mla"], TritonMLABackend)
    with pytest.raises(UnsupportedError, match="'TRITON_MLA'.*CPU_ATTN, FLASH_ATTN, FLASHINFER, TRITON_ATTN, "
                                               "FLEX_ATTENTION"):
        backends.geometry(backends.backend_of(cfg, "mla"), t, BS, spec(), "LBNHC", 0)
    with pytest.raises(UnsupportedError, match="FLEX_ATTENTION reads its cache in layout LBNHC.*LBHNC"):
        backends.geometry("FLEX_ATTENTION", vllm_views("LBHNC", 1)[0], BS, spec(), "LBHNC", 0)
    with pytest.raises(UnsupportedError, match="names no attention backend"):
        backends.backend_of(forward_context([], TritonMLABackend), "model.layers.0.self_attn.attn")
    from kvcanary.errors import LayoutError

    with pytest.raises(LayoutError, match="expected a cache in layout LBHNC"):  # the tensor is NHD
        backends.geometry("FLASH_ATTN", t, BS, spec(), "LBHNC", 0)
    fp8 = t.view(torch.uint8)
    with pytest.raises(UnsupportedError, match="quantized KV cache"):
        backends.geometry("FLASH_ATTN", fp8, BS, spec(), "LBNHC", 0)
