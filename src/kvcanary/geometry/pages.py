"""Page-major caches: one layer's K and V as ``[num_blocks, block_size, num_kv_heads, head_dim]`` views
(FlashAttention, FlashInfer's NHD, Triton and FlexAttention; a head-major ``[num_blocks,
num_kv_heads, block_size, head_dim]`` cache is passed as its permuted view). Each head's
``head_dim`` elements are contiguous; blocks, tokens and heads at any stride."""

from __future__ import annotations

import torch

from kvcanary.errors import LayoutError
from kvcanary.geometry.strided import HalfStrides, StridedKv


def page_major(k: torch.Tensor, v: torch.Tensor, layer: int | str = 0) -> StridedKv:
    """One layer from its K and V page views (one storage; shapes ``[blocks, block_size, Hkv, D]``)."""
    strides = []
    for name, t in ((f"layer{layer}.k", k), (f"layer{layer}.v", v)):
        if t.dim() != 4:
            raise LayoutError(f"source {name!r}: expected [num_blocks, block_size, num_kv_heads, head_dim], got shape "
                              f"{tuple(t.shape)}")
        if t.shape[3] > 1 and t.stride(3) != 1:
            raise LayoutError(f"source {name!r}: expected contiguous head_dim elements (stride 1), got stride "
                              f"{t.stride(3)}")
        es = t.element_size()
        strides.append(HalfStrides(int(t.storage_offset()) * es, *(s * es for s in t.stride())))
    if k.shape != v.shape or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        raise LayoutError(f"layer {layer}: expected K and V of one shape in one storage, got {tuple(k.shape)} and "
                          f"{tuple(v.shape)}")
    nb, bs, h, d = k.shape
    return StridedKv(k, nb, bs, h, d, strides[0], strides[1])
