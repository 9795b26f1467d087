"""transformers continuous batching: one canary per layer group (full attention, sliding window),
each over its group's own slot space (:class:`~kvcanary.geometry.token_pages.TokenPages`)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from kvcanary.canary import Canary
from kvcanary.config import CanaryConfig
from kvcanary.engines.transformers import hooks as cb_hooks
from kvcanary.geometry.token_pages import TokenPages
from kvcanary.layout import KvLayout


def group_pages(allocator: Any) -> TokenPages:
    """The geometry of one CB layer group's cache (its allocator's tensor, pages and layers)."""
    return TokenPages(allocator.cache_tensor, allocator.tokens_per_page, allocator.block_physical_stride,
                      allocator.layer_indices)


def group_layout(allocator: Any) -> tuple[KvLayout, int]:
    """The layout of one CB layer group's K and V bytes, and its number of compact slots."""
    pages = group_pages(allocator)
    return pages.layout(), pages.num_slots


class Group:
    """One layer group's canary and slot numbering.

    Attributes
    ----------
    name, index, allocator : the group's name, its index in the batch's per-group tensors, its allocator
    pages : the group's cache geometry (the canary's compact slots)
    block_size : slots per block (the allocator's ``tokens_per_page``)
    trash : the write index padding tokens write to (the engine's own padding slot)
    """

    def __init__(self, name: str, index: int, allocator: Any, config: CanaryConfig) -> None:
        self.name, self.index, self.allocator = name, index, allocator
        self.pages = group_pages(allocator)
        self.block_size = self.pages.tokens_per_page
        self.trash = allocator.write_trash_index
        # the read trash (padding tokens read it; the engine never writes it) and the sentinel next to it
        reserved = {int(self.compact(torch.tensor(i))) for i in (allocator.read_trash_index, allocator.sentinel_index)}
        self.canary = Canary(self.pages.num_slots, self.pages.layout(reserved), config, healer="transformers")

    def compact(self, physical: torch.Tensor) -> torch.Tensor:
        return self.pages.compact(physical)

    def block_of(self, slot: int) -> int:
        return self.pages.block_of(slot)

    def block_slots(self, blocks: Iterable[int]) -> torch.Tensor:
        """Every slot of ``blocks``, on the canary's device."""
        return cb_hooks.to_device(self.canary.device, self.pages.block_slots(blocks))[0]

    def holders(self, block: int) -> list[str]:
        """The requests whose table in this group holds ``block``."""
        return [rid for rid, blocks in self.allocator.block_table.items() if block in blocks]
