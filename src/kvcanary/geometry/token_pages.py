"""transformers continuous batching: one layer group's paged cache, and the canary's compact slots.

A group's cache tensor is token rows ``[total_tokens, 2, Hkv, D]`` (viewed as ``2 * total_tokens``
rows of ``[Hkv, D]``). Block ``b`` spans ``block_stride`` rows (``block_physical_stride``): for
each layer ``i`` of the group, a K page then a V page of ``tokens_per_page`` rows. The engine's
read and write indices are *physical* rows of a layer's K view (which starts at row ``2 * i *
tokens_per_page``); the canary numbers slots compactly::

    slot     = (physical // block_stride) * tokens_per_page + physical % block_stride
    physical = (slot // tokens_per_page) * block_stride + slot % tokens_per_page

so block ``b`` holds slots ``[b * tokens_per_page, (b + 1) * tokens_per_page)`` in every layer.
"""

from __future__ import annotations

from typing import Iterable

import torch

from kvcanary.errors import LayoutError
from kvcanary.geometry.base import block_slots
from kvcanary.geometry.strided import HalfStrides, StridedKv
from kvcanary.layout import KvLayout


class TokenPages:
    """One layer group's cache (see the module's doc).

    Parameters
    ----------
    cache : the group's ``[total_tokens, 2, Hkv, D]`` tensor
    tokens_per_page : slots per block
    block_stride : physical rows per block (``2 * len(layers) * tokens_per_page``)
    layers : the group's layer indices, in the order their pages sit in a block
    """

    def __init__(self, cache: torch.Tensor, tokens_per_page: int, block_stride: int, layers: Iterable[int]) -> None:
        if cache.dim() != 4 or cache.shape[1] != 2:
            raise LayoutError(f"cache: expected [total_tokens, 2, num_kv_heads, head_dim], got shape {tuple(cache.shape)}")
        self.cache, self.tokens_per_page, self.block_stride = cache, int(tokens_per_page), int(block_stride)
        self.layers = tuple(int(x) for x in layers)
        if self.block_stride < 2 * len(self.layers) * self.tokens_per_page:
            raise LayoutError(f"block_stride: expected >= {2 * len(self.layers) * self.tokens_per_page} rows "
                              f"(a K and a V page per layer), got {self.block_stride}")
        self.num_blocks = (cache.shape[0] * 2) // self.block_stride
        self.num_kv_heads, self.head_dim = int(cache.shape[2]), int(cache.shape[3])
        self._geometry: dict[int, StridedKv] = {}

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.tokens_per_page

    @property
    def row_bytes(self) -> int:
        """One token row ``[Hkv, D]``, in bytes."""
        return self.num_kv_heads * self.head_dim * self.cache.element_size()

    def compact(self, physical: torch.Tensor) -> torch.Tensor:
        """The canary's slots of physical rows (int64)."""
        physical = physical.long()
        return torch.div(physical, self.block_stride, rounding_mode="floor") * self.tokens_per_page \
            + physical % self.block_stride

    def physical(self, slots: torch.Tensor) -> torch.Tensor:
        """The physical rows of the canary's slots (int64)."""
        slots = slots.long()
        return torch.div(slots, self.tokens_per_page, rounding_mode="floor") * self.block_stride \
            + slots % self.tokens_per_page

    def blocks_of_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """The blocks of page indices (the decode fast path's block table counts pages of
        ``tokens_per_page`` rows: ``block_stride // tokens_per_page`` of them a block), -1 kept."""
        pages = pages.long()
        per_block = self.block_stride // self.tokens_per_page
        return torch.where(pages >= 0, torch.div(pages, per_block, rounding_mode="floor"), -1)

    def block_of(self, slot: int) -> int:
        return slot // self.tokens_per_page

    def block_slots(self, blocks: Iterable[int]) -> torch.Tensor:
        """Every slot of ``blocks`` (sorted when a set), int64 ``[len(blocks) * tokens_per_page]`` on the CPU."""
        return block_slots(sorted(blocks) if isinstance(blocks, (set, frozenset)) else blocks, self.tokens_per_page)

    def layer(self, layer: int) -> StridedKv:
        """Layer ``layer``'s K and V by the canary's slots."""
        g = self._geometry.get(layer)
        if g is None:
            if layer not in self.layers:
                raise LayoutError(f"layer {layer}: expected one of the group's layers {list(self.layers)}")
            i, row = self.layers.index(layer), self.row_bytes
            es = self.cache.element_size()
            base = int(self.cache.storage_offset()) * es
            half = lambda h: HalfStrides(base + (2 * i + h) * self.tokens_per_page * row,  # noqa: E731
                                         self.block_stride * row, row, self.head_dim * es, es)
            g = self._geometry[layer] = StridedKv(self.cache, self.num_blocks, self.tokens_per_page,
                                                  self.num_kv_heads, self.head_dim, half(0), half(1))
        return g

    def layout(self, reserved: Iterable[int] = ()) -> KvLayout:
        """Every layer's K and V bytes, layer by layer (``layer{i}.k``, ``layer{i}.v``)."""
        return KvLayout(tuple(s for layer in self.layers for s in self.layer(layer).sources(f"layer{layer}")),
                        reserved=tuple(reserved))
