"""transformers continuous batching: what the protection follows of the engine's scheduler and cache
manager besides the forwards. The layer groups of the cache it first sees (blocks a warm engine
already holds start unknown), requests new to the canary (their first read of cached KV is
verified byte for byte), blocks the engine frees or gives back all at once, and requests that left."""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvcanary.config import CanaryConfig
from kvcanary.engines.base import hook
from kvcanary.engines.transformers import hooks as cb_hooks
from kvcanary.engines.transformers.groups import Group
from kvcanary.step import Step


class SchedulerSide:
    """The protection's hooks on the CB scheduler and cache manager.

    Attributes
    ----------
    groups : layer group name -> its :class:`~kvcanary.engines.transformers.groups.Group`
    cache : the engine's paged cache the groups were made for
    seen : requests whose first read of cached KV was verified
    """

    config: CanaryConfig
    audit: Any
    quarantine: Any
    freed_stamps: dict[str, dict[int, torch.Tensor]]
    book: Any
    rows: dict[int, list[str]]
    verify_first_read: Callable[[str, Step, int, int, int, str], None]  # the adapter's (kvcanary.engines.base)

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.cache: Any = None
        self.seen: set[str] = set()
        # blocks the engine freed (allocator index, blocks), released together at the next hook: the engine
        # frees a request's blocks one call at a time, dozens in some forwards, and each release alone paid
        # 0.1-0.2 ms of numpy and torch calls on caches the forward left cold
        self.frees: list[tuple[int, list[int]]] = []

    def ensure_groups(self, cache: Any, fresh: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        """Build one canary per layer group the first time a cache is seen. Blocks it already holds
        were written before the canary was watching (a warm engine): they start unknown, except
        those of ``fresh`` requests (nothing cached yet, so nothing of theirs was written)."""
        if self.cache is cache:
            return
        groups = {name: Group(name, a.index, a, self.config) for name, a in cache.cache_allocators.items()}
        for g in groups.values():
            a = g.allocator
            held = {b for rid, blocks in a.block_table.items() if rid not in fresh for b in blocks}
            held |= set(a.ledger.cached_blocks) | set(a.ledger.block_to_hash)
            if held:
                g.canary.forget(g.block_slots(held))
        self.groups, self.cache = groups, cache
        self.frees.clear()  # the old pool's
        self.audit.groups_changed(groups)
        cb_hooks.protect_cache(cache.cache_tensor, self)
        cb_hooks.BY_POOL[id(cache.pool)] = self

    def verify_first_reads(self, reqs: list, steps: dict[str, Step], rids: list[str]) -> None:
        """A request seen for the first time with KV already cached (a prefix-cache hit, a fork's
        child) reads blocks it did not write: every byte of them is verified before this forward."""
        if self.seen.issuperset(rids):
            return
        for i, fs in enumerate(reqs):
            rid = rids[i]
            if rid in self.seen:
                continue
            self.seen.add(rid)
            past = fs.state.position_offset - fs.query_length
            if past <= 0:
                continue
            for name, step in steps.items():
                self.verify_first_read(name, step, i, int(step.starts()[i]), past, rid)

    def forget_departed(self) -> None:
        """Drop the token streams and first-read marks of requests that left the cache."""
        if self.cache is None:
            return
        live = {rid for a in self.cache.cache_allocators.values() for rid in a.block_table}
        self.book.forget_except(live)
        self.seen &= live | {rid for rids in list(self.rows.values())[-2:] for rid in rids}

    def free_later(self, index: int, blocks: list[int]) -> None:
        """The engine returned ``blocks`` of the group with allocator ``index`` to its free pool: noted,
        released by the next hook before it reads or writes a stamp (:meth:`release_frees`)."""
        self.frees.append((index, list(blocks)))

    @hook("the block-free hook")
    def released(self) -> None:
        """The blocks the engine freed since the last hook, released (at the end of a run)."""
        self.release_frees()

    def release_frees(self, export: bool = True) -> None:
        """Release the blocks freed since the last hook (:meth:`free_later`), every group's in one
        batch: their stamps forgotten, and (``export``) kept until the next forward for the offload
        hook (the forward's own release needs none: it clears them)."""
        if not self.frees:
            return
        frees, self.frees = self.frees, []
        freed_of: dict[int, list[int]] = {}
        for index, noted in frees:
            freed_of.setdefault(index, []).extend(noted)
        for name, g in self.groups.items():
            blocks = freed_of.get(g.index)
            if not blocks:
                continue
            # the offloading manager frees a victim's blocks before it copies them out: keep their stamps
            # until the next forward, for the offload hook
            was = g.canary.export_stamps(g.block_slots(blocks)) if export else None
            if was is not None:
                bs = g.block_size
                self.freed_stamps.setdefault(name, {}).update(
                    (b, was[i * bs : (i + 1) * bs]) for i, b in enumerate(blocks))
            g.canary.release_blocks(blocks, g.block_size)
            self.quarantine.freed(name, blocks)

    @hook("the pool-reset hook")
    def pool_reset(self) -> None:
        """The engine gave every block back (a cache reset): every slot is free."""
        self.frees.clear()
        for g in self.groups.values():
            g.canary.release(torch.arange(g.canary.num_slots, device=g.canary.device))
        self.quarantine.poisoned.clear()
