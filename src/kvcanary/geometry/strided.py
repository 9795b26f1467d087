"""A layer whose every K and V element sits at byte strides: most engines' caches.

Element ``(slot, head, dim)`` of one half lives at::

    offset + (slot // block_size) * block_stride + (slot % block_size) * token_stride
           + head * head_stride + dim * dim_stride

vLLM's CPU ``vec`` layout (K ``[D, block]`` and V ``[block, D]`` per block and head),
transformers' token rows, and the page-major caches of FlashAttention, FlashInfer, Triton and
FlexAttention (``[blocks, block_size, heads, dim]`` and the head-major ``[blocks, heads,
block_size, dim]``) are all strided; vLLM's ``amx`` tiles are not
(:class:`~kvcanary.geometry.vllm_cpu.AmxKv`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary.errors import LayoutError
from kvcanary.geometry.base import KvGeometry, _half, runs, source
from kvcanary.source import ByteSource


@dataclass(frozen=True)
class HalfStrides:
    """Where one half (K or V) of a layer lives, in bytes: the first element's offset from the
    storage's first byte, and the strides of a block, a token in its block, a head and a dim."""

    offset: int
    block_stride: int
    token_stride: int
    head_stride: int
    dim_stride: int


class StridedKv(KvGeometry):
    """One layer's K and V at :class:`HalfStrides` in the storage of ``tensor``."""

    def __init__(self, tensor: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 k: HalfStrides, v: HalfStrides) -> None:
        self.tensor, self.num_blocks, self.block_size = tensor, int(num_blocks), int(block_size)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.k, self.v = k, v
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}: expected >= 1, got {getattr(self, name)}")
        es, nbytes = tensor.element_size(), tensor.untyped_storage().nbytes()
        for h, st in (("K", k), ("V", v)):
            fields = (st.offset, st.block_stride, st.token_stride, st.head_stride, st.dim_stride)
            if any(x < 0 or x % es for x in fields):
                raise LayoutError(f"{h}: expected offsets and strides >= 0 in whole {es}-byte elements, got {st}")
            end = (st.offset + (self.num_blocks - 1) * st.block_stride + (self.block_size - 1) * st.token_stride
                   + (self.num_kv_heads - 1) * st.head_stride + (self.head_dim - 1) * st.dim_stride + es)
            if end > nbytes:
                raise LayoutError(f"{h}: described bytes end at {end}, beyond the tensor's storage of {nbytes} bytes")
        self._views = tuple(self._typed(st) for st in (k, v))

    def _typed(self, st: HalfStrides) -> torch.Tensor:
        """The half as a typed view ``[blocks, block_size, Hkv, D]`` over the storage's elements."""
        es = self.element_size
        flat = torch.empty(0, dtype=self.dtype, device=self.tensor.device)
        n = self.tensor.untyped_storage().nbytes() // es
        flat = flat.set_(self.tensor.untyped_storage(), 0, (n,), (1,))
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        strides = tuple(x // es for x in (st.block_stride, st.token_stride, st.head_stride, st.dim_stride))
        return flat.as_strided(shape, strides, st.offset // es)

    def _rows(self, view: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor | None) -> torch.Tensor:
        b = torch.div(slots, self.block_size, rounding_mode="floor")
        t = slots - b * self.block_size
        return view[b, t] if heads is None else view[b, t, heads]

    def k_rows(self, slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        return self._rows(self._views[0], slots, heads)

    def v_rows(self, slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        return self._rows(self._views[1], slots, heads)

    def set_rows(self, half: str, slots: torch.Tensor, value: float) -> None:
        view = self._views[0 if _half(half) == "k" else 1]
        b = torch.div(slots, self.block_size, rounding_mode="floor")
        view[b, slots - b * self.block_size] = value

    def strides(self, half: str) -> HalfStrides:
        return self.k if _half(half) == "k" else self.v

    def descriptors(self) -> tuple[list[int], list[int]]:
        base = self.tensor.untyped_storage().data_ptr()
        return tuple([base + st.offset, self.block_size, st.block_stride, st.token_stride, st.head_stride,  # type: ignore[return-value]
                      st.dim_stride, self.block_size, 0, self.head_dim, 0] for st in (self.k, self.v))

    def element(self, half: str, slot: int, head: int, dim: int) -> int:
        st = self.strides(half)
        b, t = divmod(slot, self.block_size)
        return st.offset + b * st.block_stride + t * st.token_stride + head * st.head_stride + dim * st.dim_stride

    def sources(self, name: str) -> tuple[ByteSource, ByteSource]:
        return self._source(f"{name}.k", self.k), self._source(f"{name}.v", self.v)

    def _source(self, name: str, st: HalfStrides) -> ByteSource:
        """A token's bytes of one half as runs: a head's dims contiguous make one stretch (the
        heads too, where they follow each other), else every element is a run of its own."""
        es, h, d = self.element_size, self.num_kv_heads, self.head_dim
        if d > 1 and st.dim_stride != es:
            token_runs = runs([(h, st.head_stride), (d, st.dim_stride)], es, es)
        elif h == 1 or st.head_stride == d * es:
            token_runs = runs([], h * d * es, es)
        else:
            token_runs = runs([(h, st.head_stride)], d * es, es)
        return source(name, self.tensor, self.block_size, self.num_blocks, st.block_stride, st.token_stride, st.offset,
                      token_runs)
