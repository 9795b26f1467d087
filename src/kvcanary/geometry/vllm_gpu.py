"""vLLM's GPU attention backends: one layer's cache, described from the backend vLLM chose and the
cache layout the engine resolved (vLLM 0.32).

Every backend named in :data:`BACKENDS` gets, per layer, a logical view ``[num_blocks, num_kv_heads,
block_size, head_size + head_size_v]`` (vLLM's ``[B, H, N, C]``) whose last axis holds a token's K
then its V for one head: element ``(b, h, n, c)`` is K's dim ``c`` for ``c < head_size``, else V's
dim ``c - head_size``. The backends split it there, and differ in which physical orders of the
view their kernels accept. The order is vLLM's resolved cache layout, named by its axes outermost
first (``L`` the layer, ``B`` the block, ``H`` the head, ``N`` the token in its block, ``C`` the
content): ``LBNHC`` (NHD: a block's tokens, each with all its heads), ``LBHNC`` (HND: a block's
heads, each with all its tokens), the cross-layer ``BLNHC``/``BLHNC`` and the rest of
:data:`LAYOUTS`. A layer's addresses are its view's own strides, checked against that order.

vLLM's CPU backend has the same logical view, but its kernels reorder each head's block inside
(:mod:`kvcanary.geometry.vllm_cpu`); it is not one of these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary.errors import LayoutError, UnsupportedError
from kvcanary.geometry.strided import HalfStrides, StridedKv

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")  # vLLM's KV cache layouts by name
LEGACY = {"NHD": "LBNHC", "HND": "LBHNC"}  # the older names vLLM still takes for two of them


@dataclass(frozen=True)
class GpuBackend:
    """What kvcanary knows of one backend's cache: the layouts its kernels read (``None``: any)."""

    name: str
    layouts: tuple[str, ...] | None = None


BACKENDS = {b.name: b for b in (
    GpuBackend("FLASH_ATTN"),
    GpuBackend("FLASHINFER"),  # NHD, and HND (the only order its trtllm kernels read on SM100)
    GpuBackend("TRITON_ATTN"),
    GpuBackend("FLEX_ATTENTION", ("LBNHC",)),  # flattens blocks and tokens into one token axis
)}


def layout_name(name: str) -> str:
    """vLLM's cache layout ``name`` (or its legacy alias) as one of :data:`LAYOUTS`."""
    got = LEGACY.get(str(name).upper(), str(name).upper())
    if got not in LAYOUTS:
        raise UnsupportedError(f"vLLM KV cache layout {name!r}: expected one of {', '.join(LAYOUTS)} (or "
                               f"{', '.join(LEGACY)})")
    return got


def layer_order(layout: str) -> tuple[int, ...]:
    """The axes of a layer's logical ``[B, H, N, C]`` view, outermost first in memory under ``layout``."""
    return tuple("BHNC".index(x) for x in layout_name(layout) if x != "L")


def vllm_gpu(tensor: torch.Tensor, backend: str, layout: str, block_size: int, num_kv_heads: int, head_size: int,
             head_size_v: int | None = None, layer: int | str = 0) -> StridedKv:
    """One layer's geometry on vLLM's GPU backend ``backend`` (its ``get_name()``, one of
    :data:`BACKENDS`) under the resolved cache ``layout``.

    Parameters
    ----------
    tensor : the layer's cache as vLLM hands it to a connector, ``[num_blocks, num_kv_heads,
        block_size, head_size + head_size_v]`` at the layout's strides
    block_size, num_kv_heads, head_size, head_size_v : from the layer's KV cache spec
        (``head_size_v``: ``head_size`` when ``None``)
    layer : names the layer in errors
    """
    known = BACKENDS.get(backend)
    if known is None:
        raise UnsupportedError(f"vLLM attention backend {backend!r}: kvcanary describes the caches of "
                               f"{', '.join(BACKENDS)} (and CPU_ATTN), not this one")
    name = layout_name(layout)
    if known.layouts is not None and name not in known.layouts:
        raise UnsupportedError(f"layer {layer}: {backend} reads its cache in layout {', '.join(known.layouts)}, "
                               f"but the resolved layout is {name}")
    hv = head_size if head_size_v is None else int(head_size_v)
    want = (block_size, num_kv_heads, head_size + hv)
    if tensor.dim() != 4 or (tensor.shape[2], tensor.shape[1], tensor.shape[3]) != want:
        raise LayoutError(f"layer {layer}: {backend} cache: expected [num_blocks, {num_kv_heads}, {block_size}, "
                          f"{head_size + hv}] ([num_blocks, num_kv_heads, block_size, head_size + head_size_v]), "
                          f"got shape {tuple(tensor.shape)}")
    if hv != head_size:
        raise UnsupportedError(f"layer {layer}: K and V of different head sizes ({head_size}, {hv}): the canary's "
                               f"checks take one head_dim for both")
    _check_order(tensor, name, layer)
    es = tensor.element_size()
    st = [s * es for s in tensor.stride()]
    base = int(tensor.storage_offset()) * es
    k = HalfStrides(base, st[0], st[2], st[1], st[3])
    v = HalfStrides(base + head_size * es, st[0], st[2], st[1], st[3])
    return StridedKv(tensor, tensor.shape[0], block_size, num_kv_heads, head_size, k, v)


def _check_order(t: torch.Tensor, layout: str, layer: int | str) -> None:
    """The view's strides nest in ``layout``'s order: content contiguous, and each axis (of more
    than one element) spanning at least the axes inside it."""
    order = [a for a in layer_order(layout) if t.shape[a] > 1]
    inner = 1
    for a in reversed(order):
        if t.stride(a) < inner or (a == 3 and t.stride(a) != 1):
            raise LayoutError(f"layer {layer}: expected a cache in layout {layout} (axes [B, H, N, C] outermost "
                              f"first as {''.join('BHNC'[x] for x in layer_order(layout))}), "
                              f"got shape {tuple(t.shape)} at strides {tuple(t.stride())}")
        inner = t.stride(a) * t.shape[a]
