"""vLLM's CPU attention backend: one layer's cache ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``.

The kernels view each block and head of a layer as ``[2 * block_size, head_dim]``: K's
``block_size * head_dim`` elements, then V's. Which kernels vLLM picks (by dtype, block size and
head size) fixes how the elements are ordered:

- ``vec`` and ``vec16`` (fp32, fp16, bf16 without AMX): K column-major (element ``(d, t)`` at
  ``d * block_size + t``), V row-major (``t * head_dim + d``): a strided layout;
- ``amx`` (bf16): K in 4-byte pairs ``(d, d + 1)`` across 16 tokens (pair ``j`` of token ``t`` at
  byte ``(t // 16) * 32 * head_dim + j * 64 + (t % 16) * 4``) and V by token pairs in 16-element
  strips of the head (element ``d = 16 * i + k`` at byte ``i * 32 * block_size + (t // 2) * 64 + k
  * 4 + (t % 2) * 2``).
"""

from __future__ import annotations

import torch

from kvcanary.errors import LayoutError
from kvcanary.geometry.base import KvGeometry, _half, runs, source
from kvcanary.geometry.strided import HalfStrides, StridedKv
from kvcanary.source import ByteSource

ISAS = ("vec", "vec16", "amx")
AMX_PACK_K, AMX_PACK_V = 16, 2  # tokens whose K (V) elements interleave in the amx layout


def vllm_cpu(tensor: torch.Tensor, isa: str, block_size: int, num_kv_heads: int, head_dim: int,
             layer: int | str = 0) -> KvGeometry:
    """One layer's geometry on vLLM's CPU backend with kernels ``isa`` (``"vec"``, ``"vec16"`` or
    ``"amx"``); ``layer`` names it in errors."""
    if isa not in ISAS:
        raise LayoutError(f"vLLM CPU attention kernels {isa!r}: expected one of {', '.join(map(repr, ISAS))}")
    es, block_stride, head_stride, base = _cpu_strides(layer, tensor, block_size, num_kv_heads, head_dim)
    if isa == "amx":
        return AmxKv(tensor, block_size, num_kv_heads, head_dim, layer)
    k = HalfStrides(base, block_stride, es, head_stride, block_size * es)  # K: [D, block] per block and head
    v = HalfStrides(base + block_size * head_dim * es, block_stride, head_dim * es, head_stride, es)  # V: [block, D]
    return StridedKv(tensor, tensor.shape[0], block_size, num_kv_heads, head_dim, k, v)


class AmxKv(KvGeometry):
    """One layer with vLLM's ``amx`` kernels (bf16, 16-token tiles; see the module's doc)."""

    def __init__(self, tensor: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int,
                 layer: int | str = 0) -> None:
        if block_size % AMX_PACK_K or head_dim % 16:
            raise LayoutError(f"amx layout: expected block_size and head_dim multiples of 16, got block_size "
                              f"{block_size}, head_dim {head_dim}")
        es, self.block_stride, self.head_stride, self.base = _cpu_strides(layer, tensor, block_size, num_kv_heads,
                                                                           head_dim)
        if es != 2:
            raise LayoutError(f"layer {layer}: amx layout: expected 2-byte elements (bf16), got {tensor.dtype}")
        self.tensor, self.num_blocks, self.block_size = tensor, int(tensor.shape[0]), block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        s0, s1, d, bs = tensor.stride(0), tensor.stride(1), head_dim, block_size
        off = tensor.storage_offset()
        # typed views: K [blocks, heads, tile, token in tile, pair, 2], V [blocks, heads, token pair, 2, strip, 16]
        self._k = tensor.as_strided((self.num_blocks, num_kv_heads, bs // 16, 16, d // 2, 2),
                                    (s0, s1, 16 * d, 2, 32, 1), off)
        self._v = tensor.as_strided((self.num_blocks, num_kv_heads, bs // 2, 2, d // 16, 16),
                                    (s0, s1, 32, 1, 16 * bs, 2), off + bs * d)

    def k_rows(self, slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        b, t = torch.div(slots, self.block_size, rounding_mode="floor"), slots % self.block_size
        rows = self._k[b, slice(None) if heads is None else heads, torch.div(t, 16, rounding_mode="floor"), t % 16]
        return rows.reshape(*slots.shape, *(() if heads is not None else (self.num_kv_heads,)), self.head_dim)

    def v_rows(self, slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        b, t = torch.div(slots, self.block_size, rounding_mode="floor"), slots % self.block_size
        rows = self._v[b, slice(None) if heads is None else heads, torch.div(t, 2, rounding_mode="floor"), t % 2]
        return rows.reshape(*slots.shape, *(() if heads is not None else (self.num_kv_heads,)), self.head_dim)

    def set_rows(self, half: str, slots: torch.Tensor, value: float) -> None:
        b, t = torch.div(slots, self.block_size, rounding_mode="floor"), slots % self.block_size
        if _half(half) == "k":
            self._k[b, :, torch.div(t, 16, rounding_mode="floor"), t % 16] = value
        else:
            self._v[b, :, torch.div(t, 2, rounding_mode="floor"), t % 2] = value

    def element(self, half: str, slot: int, head: int, dim: int) -> int:
        b, t = divmod(slot, self.block_size)
        at = self.base + b * self.block_stride + head * self.head_stride
        if _half(half) == "k":
            return at + (t // 16) * 32 * self.head_dim + (dim // 2) * 64 + (t % 16) * 4 + (dim % 2) * 2
        at += self.block_size * self.head_dim * 2
        return at + (dim // 16) * 32 * self.block_size + (t // 2) * 64 + (dim % 16) * 4 + (t % 2) * 2

    def descriptors(self) -> tuple[list[int], list[int]]:
        # K: 16-token tiles of 4-byte pairs (d, d + 1); V: 16-dim strips of 2-token pairs
        at, d, bs = self.tensor.untyped_storage().data_ptr() + self.base, self.head_dim, self.block_size
        return ([at, bs, self.block_stride, 4, self.head_stride, 2, AMX_PACK_K, 32 * d, 2, 64],
                [at + 2 * bs * d, bs, self.block_stride, 2, self.head_stride, 4, AMX_PACK_V, 64, 16, 32 * bs])

    def sources(self, name: str) -> tuple[ByteSource, ByteSource]:
        es, h, d, bs = 2, self.num_kv_heads, self.head_dim, self.block_size
        k = runs([(h, self.head_stride), (d // 2, 64)], 4, 4)  # pairs (d, d + 1), 16 tokens apart
        v = runs([(h, self.head_stride), (d // 16, 16 * bs * es), (16, 2 * es)], es, es)
        nb, bst = self.num_blocks, self.block_stride
        return (source(f"{name}.k", self.tensor, bs, nb, bst, 4, self.base, k, AMX_PACK_K, 16 * d * es),
                source(f"{name}.v", self.tensor, bs, nb, bst, es, self.base + bs * d * es, v, AMX_PACK_V, 2 * 16 * es))


def _cpu_strides(layer: int | str, t: torch.Tensor, block_size: int, heads: int,
                 head_dim: int) -> tuple[int, int, int, int]:
    """Element size, block and head strides and the first byte of one layer of vLLM's CPU cache."""
    want = (heads, block_size, 2 * head_dim)
    if t.dim() != 4 or tuple(t.shape[1:]) != want:
        raise LayoutError(f"layer {layer}: expected [num_blocks, {', '.join(map(str, want))}] ([num_blocks, "
                          f"num_kv_heads, block_size, 2 * head_dim]), got shape {tuple(t.shape)}")
    if (t.stride(2), t.stride(3)) != (2 * head_dim, 1):
        raise LayoutError(f"layer {layer}: expected each block and head contiguous (strides [..., {2 * head_dim}, 1] "
                          f"for its last two dims), got strides {tuple(t.stride())}")
    es = t.element_size()
    return es, t.stride(0) * es, t.stride(1) * es, int(t.storage_offset()) * es
