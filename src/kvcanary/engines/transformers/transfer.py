"""transformers continuous batching: stamps that travel with KV the engine moves. Blocks offloaded to
the CPU tier keep their stamps beside them and are verified when restored; the blocks a fork copies
inside the pool carry their source's stamps and are verified as they land."""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvcanary.engines.base import hook


class TransferSide:
    """The protection's hooks around the engine's block copies and its CPU tier.

    Attributes
    ----------
    offloaded_stamps : request id -> each group's stamps of its offloaded blocks (``None``: they could not be read)
    freed_stamps : group -> block -> the stamps a block had when the engine freed it since the last
        forward (the offloading manager frees a victim's blocks before it copies them out)
    """

    groups: dict[str, Any]
    ensure_groups: Callable[[Any], None]  # the scheduler side's
    release_frees: Callable[[], None]  # the scheduler side's: the blocks freed since the last hook, released first
    poll: Callable[..., list]  # the protection's

    def __init__(self) -> None:
        self.offloaded_stamps: dict[str, dict[str, torch.Tensor | None]] = {}
        self.freed_stamps: dict[str, dict[int, torch.Tensor]] = {}

    @hook("the offload hook")
    def offloaded(self, cache: Any, rids: set[str], tables: dict[str, dict[str, list[int]]]) -> None:
        """Blocks of ``rids`` were copied to the CPU tier: keep their stamps beside them."""
        self.release_frees()
        self.ensure_groups(cache)
        for rid in rids:
            self.offloaded_stamps[rid] = {name: self._stamps_of(name, blocks)
                                          for name, blocks in tables[rid].items() if blocks}

    def _stamps_of(self, name: str, blocks: list[int]) -> torch.Tensor | None:
        """The stamps of ``blocks`` of group ``name`` as they were before the engine freed them."""
        g, freed = self.groups[name], self.freed_stamps.get(name, {})
        now = g.canary.export_stamps(g.block_slots(blocks))
        if now is None or not freed:
            return now
        bs = g.block_size
        return torch.cat([freed.get(b, now[i * bs : (i + 1) * bs]) for i, b in enumerate(blocks)])

    @hook("the block-copy hook")
    def copied(self, allocator: Any, source: list[int], dest: list[int]) -> None:
        """A fork copied whole blocks inside the pool: their stamps follow, and the copies are verified."""
        self.release_frees()
        g = next((g for g in self.groups.values() if g.allocator is allocator), None)
        if g is not None:
            g.canary.import_stamps(g.block_slots(dest), g.canary.export_stamps(g.block_slots(source)))
            self.poll()

    @hook("the restore hook")
    def restored(self, cache: Any, rids: list[str]) -> None:
        """Blocks of ``rids`` came back from the CPU tier: install their stamps and verify the bytes."""
        self.release_frees()
        self.ensure_groups(cache)
        for rid in rids:
            saved = self.offloaded_stamps.pop(rid, {})
            for name, g in self.groups.items():
                blocks = g.allocator.block_table.get(rid, [])
                stamps = saved.get(name)
                bs = g.block_size
                n = 0 if stamps is None else min(len(blocks), stamps.shape[0] // bs)
                if n:
                    g.canary.import_stamps(g.block_slots(blocks[:n]), stamps[: n * bs])  # type: ignore[index]
                if len(blocks) > n:  # stamps that did not travel: the canary lost track, not corruption
                    g.canary.forget(g.block_slots(blocks[n:]))
            self.poll(request=rid)
