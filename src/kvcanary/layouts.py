"""Layouts of common KV caches, built from the engine's tensors and geometry alone (no engine
imported): every byte of every layer's K and V, one source per layer half (``"layer3.k"``),
layer by layer, K before V. Page size = block size. Where the bytes are is each cache's geometry
(:mod:`kvcanary.geometry`).

========================== ================================================================
builder                    one layer's tensor
========================== ================================================================
:func:`vllm_cpu_vec`       ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, ``vec``
:func:`vllm_cpu_amx`       the same shape, ``amx`` packing (bf16)
:func:`paged_kv_split`     ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K, V)
:func:`paged_kv_packed`    ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
========================== ================================================================
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvcanary.errors import LayoutError
from kvcanary.geometry.base import KvGeometry
from kvcanary.geometry.pages import page_major
from kvcanary.geometry.vllm_cpu import AmxKv, vllm_cpu
from kvcanary.layout import KvLayout


def of_layers(layers: Sequence[KvGeometry]) -> KvLayout:
    """Every layer's K and V sources, layer by layer (``layer{i}.k``, ``layer{i}.v``)."""
    return KvLayout(tuple(s for i, g in enumerate(layers) for s in g.sources(f"layer{i}")))


def vllm_cpu_vec(layer_tensors: Sequence[torch.Tensor], block_size: int, num_kv_heads: int,
                 head_dim: int) -> KvLayout:
    """Every layer's K and V on vLLM's CPU backend with ``vec`` kernels (fp32, fp16).

    Parameters
    ----------
    layer_tensors : per layer ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` (each block
        and head's ``[block_size, 2 * head_dim]`` contiguous, as the kernels view it)
    """
    return of_layers([vllm_cpu(t, "vec", block_size, num_kv_heads, head_dim, i)
                      for i, t in enumerate(_layers(layer_tensors))])


def vllm_cpu_amx(layer_tensors: Sequence[torch.Tensor], block_size: int, num_kv_heads: int,
                 head_dim: int) -> KvLayout:
    """Every layer's K and V on vLLM's CPU backend with ``amx`` kernels (bf16).

    Parameters
    ----------
    layer_tensors : per layer ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, 2-byte
        elements; ``block_size`` a multiple of 16 and ``head_dim`` of 16 (vLLM asks 32 of both)
    """
    return of_layers([AmxKv(t, block_size, num_kv_heads, head_dim, i) for i, t in enumerate(_layers(layer_tensors))])


def paged_kv_split(kv: Sequence[torch.Tensor]) -> KvLayout:
    """Every layer's K and V from per-layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    tensors (FlashAttention, FlashInfer): K = ``kv[0]``, V = ``kv[1]``."""
    out = []
    for i, t in enumerate(_layers(kv)):
        if t.dim() != 5 or t.shape[0] != 2:
            raise LayoutError(f"layer {i}: expected [2, num_blocks, block_size, num_kv_heads, head_dim], got shape "
                              f"{tuple(t.shape)}")
        out.append(page_major(t[0], t[1], i))
    return of_layers(out)


def paged_kv_packed(kv: Sequence[torch.Tensor]) -> KvLayout:
    """Every layer's K and V from per-layer ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
    tensors: each block holds its K page, then its V page."""
    out = []
    for i, t in enumerate(_layers(kv)):
        if t.dim() != 5 or t.shape[1] != 2:
            raise LayoutError(f"layer {i}: expected [num_blocks, 2, block_size, num_kv_heads, head_dim], got shape "
                              f"{tuple(t.shape)}")
        out.append(page_major(t[:, 0], t[:, 1], i))
    return of_layers(out)


def _layers(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = list(tensors)
    if not out:
        raise LayoutError("expected at least one layer tensor, got none")
    return out
