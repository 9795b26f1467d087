"""Layouts of common KV caches, built from the engine's tensors and geometry alone (no engine
imported): every byte of every layer's K and V, one source per layer half (``"layer3.k"``),
layer by layer, K before V. Page size = block size.

========================== ================================================================
builder                    one layer's tensor
========================== ================================================================
:func:`vllm_cpu_vec`       ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, ``vec``
:func:`vllm_cpu_amx`       the same shape, ``amx`` packing (bf16)
:func:`paged_kv_split`     ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K, V)
:func:`paged_kv_packed`    ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
========================== ================================================================

vLLM's CPU backend views each block and head of a layer as ``[2 * block_size, head_dim]``: K's
``block_size * head_dim`` elements, then V's. With ``vec`` kernels K is column-major (element
``(d, t)`` at ``d * block_size + t``) and V row-major (``t * head_dim + d``). With ``amx`` K is
packed in 4-byte pairs ``(d, d + 1)`` across 16 tokens (pair ``j`` of token ``t`` at byte
``(t // 16) * 32 * head_dim + j * 64 + (t % 16) * 4``) and V by token pairs in 16-element strips
of the head (element ``d = 16 * i + k`` at byte ``i * 32 * block_size + (t // 2) * 64 + k * 4 +
(t % 2) * 2``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvcanary.errors import LayoutError
from kvcanary.layout import LOAD_WIDTH, NARROW_WIDTHS, ByteSource, KvLayout

AMX_PACK_K, AMX_PACK_V = 16, 2  # tokens whose K (V) elements interleave in vLLM's amx layout


def vllm_cpu_vec(layer_tensors: Sequence[torch.Tensor], block_size: int, num_kv_heads: int,
                 head_dim: int) -> KvLayout:
    """Every layer's K and V on vLLM's CPU backend with ``vec`` kernels (fp32, fp16).

    Parameters
    ----------
    layer_tensors : per layer ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` (each block
        and head's ``[block_size, 2 * head_dim]`` contiguous, as the kernels view it)
    """
    sources = []
    for i, t in enumerate(_layers(layer_tensors)):
        es, page, head, base = _cpu_geometry(i, t, block_size, num_kv_heads, head_dim)
        k = _runs([(num_kv_heads, head), (head_dim, block_size * es)], es, es)  # one element per run
        v = _runs([(num_kv_heads, head)], head_dim * es, es)
        sources += [_source(f"layer{i}.k", t, block_size, page, es, base, k),
                    _source(f"layer{i}.v", t, block_size, page, head_dim * es, base + block_size * head_dim * es, v)]
    return KvLayout(tuple(sources))


def vllm_cpu_amx(layer_tensors: Sequence[torch.Tensor], block_size: int, num_kv_heads: int,
                 head_dim: int) -> KvLayout:
    """Every layer's K and V on vLLM's CPU backend with ``amx`` kernels (bf16).

    Parameters
    ----------
    layer_tensors : per layer ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, 2-byte
        elements; ``block_size`` a multiple of 16 and ``head_dim`` of 16 (vLLM asks 32 of both)
    """
    if block_size % AMX_PACK_K or head_dim % 16:
        raise LayoutError(f"amx layout: expected block_size and head_dim multiples of 16, got block_size "
                          f"{block_size}, head_dim {head_dim}")
    sources = []
    for i, t in enumerate(_layers(layer_tensors)):
        es, page, head, base = _cpu_geometry(i, t, block_size, num_kv_heads, head_dim)
        if es != 2:
            raise LayoutError(f"layer {i}: amx layout: expected 2-byte elements (bf16), got {t.dtype}")
        k = _runs([(num_kv_heads, head), (head_dim // 2, 64)], 4, 4)  # pairs (d, d + 1), 16 tokens apart
        v = _runs([(num_kv_heads, head), (head_dim // 16, 16 * block_size * es), (16, 2 * es)], es, es)
        sources += [_source(f"layer{i}.k", t, block_size, page, 4, base, k, AMX_PACK_K, 16 * head_dim * es),
                    _source(f"layer{i}.v", t, block_size, page, es, base + block_size * head_dim * es, v,
                            AMX_PACK_V, 2 * 16 * es)]
    return KvLayout(tuple(sources))


def paged_kv_split(kv: Sequence[torch.Tensor]) -> KvLayout:
    """Every layer's K and V from per-layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    tensors (FlashAttention, FlashInfer): K = ``kv[0]``, V = ``kv[1]``."""
    sources = []
    for i, t in enumerate(_layers(kv)):
        if t.dim() != 5 or t.shape[0] != 2:
            raise LayoutError(f"layer {i}: expected [2, num_blocks, block_size, num_kv_heads, head_dim], got shape "
                              f"{tuple(t.shape)}")
        sources += [_paged(f"layer{i}.{h}", t[j]) for j, h in enumerate("kv")]
    return KvLayout(tuple(sources))


def paged_kv_packed(kv: Sequence[torch.Tensor]) -> KvLayout:
    """Every layer's K and V from per-layer ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
    tensors: each block holds its K page, then its V page."""
    sources = []
    for i, t in enumerate(_layers(kv)):
        if t.dim() != 5 or t.shape[1] != 2:
            raise LayoutError(f"layer {i}: expected [num_blocks, 2, block_size, num_kv_heads, head_dim], got shape "
                              f"{tuple(t.shape)}")
        sources += [_paged(f"layer{i}.{h}", t[:, j]) for j, h in enumerate("kv")]
    return KvLayout(tuple(sources))


Runs = tuple[tuple[tuple[int, int], ...], int, int, int]  # groups, rows, row_stride, row_bytes


def _layers(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = list(tensors)
    if not out:
        raise LayoutError("expected at least one layer tensor, got none")
    return out


def _runs(dims: list[tuple[int, int]], nbytes: int, align: int) -> Runs:
    """A token's runs: ``nbytes`` contiguous bytes at every point of ``dims`` (``(count, stride)``,
    outermost first), each stretch one run where a run can be that wide, else split into narrow
    runs of the widest width dividing it and ``align`` (the stretch's alignment)."""
    if nbytes % LOAD_WIDTH and nbytes not in NARROW_WIDTHS:
        w = max(x for x in NARROW_WIDTHS if nbytes % x == 0 and align % x == 0)
        dims, nbytes = dims + [(nbytes // w, w)], w
    dims = [d for d in dims if d[0] > 1] or [(1, nbytes)]
    return tuple(dims[:-1]), dims[-1][0], dims[-1][1], nbytes


def _source(name: str, t: torch.Tensor, page_size: int, page_stride: int, token_stride: int, offset: int,
            runs: Runs, token_pack: int | None = None, pack_stride: int = 0) -> ByteSource:
    groups, rows, row_stride, row_bytes = runs
    return ByteSource(name=name, tensor=t, page_size=page_size, num_pages=t.shape[0], page_stride=page_stride,
                      token_stride=token_stride, rows=rows, row_stride=row_stride, row_bytes=row_bytes,
                      offset=offset, groups=groups, token_pack=token_pack, pack_stride=pack_stride)


def _paged(name: str, t: torch.Tensor) -> ByteSource:
    """One page-major half ``[num_blocks, block_size, num_kv_heads, head_dim]``: each head's
    ``head_dim`` elements contiguous, the heads of a token at any stride (NHD or HND)."""
    es = t.element_size()
    _, bs, h, d = t.shape
    if d > 1 and t.stride(3) != 1:
        raise LayoutError(f"source {name!r}: expected contiguous head_dim elements (stride 1), got stride "
                          f"{t.stride(3)}")
    if h == 1 or t.stride(2) == d:  # a token's heads back to back: one stretch
        runs = _runs([], h * d * es, es)
    else:
        runs = _runs([(h, t.stride(2) * es)], d * es, es)
    return _source(name, t, bs, t.stride(0) * es, t.stride(1) * es, int(t.storage_offset()) * es, runs)


def _cpu_geometry(i: int, t: torch.Tensor, block_size: int, heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """Element size, block and head strides and the first byte of one layer of vLLM's CPU cache."""
    want = (heads, block_size, 2 * head_dim)
    if t.dim() != 4 or tuple(t.shape[1:]) != want:
        raise LayoutError(f"layer {i}: expected [num_blocks, {', '.join(map(str, want))}] ([num_blocks, "
                          f"num_kv_heads, block_size, 2 * head_dim]), got shape {tuple(t.shape)}")
    if (t.stride(2), t.stride(3)) != (2 * head_dim, 1):
        raise LayoutError(f"layer {i}: expected each block and head contiguous (strides [..., {2 * head_dim}, 1] "
                          f"for its last two dims), got strides {tuple(t.stride())}")
    es = t.element_size()
    return es, t.stride(0) * es, t.stride(1) * es, int(t.storage_offset()) * es
