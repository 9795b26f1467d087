"""Faults injected into a running transformers continuous-batching engine.

Each injector is a hook of :class:`kvcanary.engines.transformers.Protection`: it runs before the
checks of every forward, fires once (at forward ``at`` or the first later forward where its target
exists) and records what it corrupted in ``detail``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvcanary.faults.transformers_kernel import INJECTORS as KERNEL_INJECTORS


@dataclass
class CbFault:
    name: str
    at: int = 3
    seed: int = 0
    injected_at: int | None = None
    landed_at: int | None = None  # the forward from which the corruption exists
    detail: dict[str, Any] = field(default_factory=dict)

    def __call__(self, prot: Any, runner: Any, batch: dict) -> None:
        if self.injected_at is None and prot.forwards >= self.at:
            rng = random.Random(self.seed)
            if INJECTORS[self.name](prot, runner, batch, rng, self.detail):
                self.injected_at = prot.forwards
                if "watch_block" not in self.detail:
                    self.landed_at = self.injected_at
        if self.landed_at is None and self.injected_at is not None:
            g = full_group(prot)
            written = g.compact(batch["write_index"][g.index]) // g.block_size
            if bool((written == self.detail["watch_block"]).any()):  # the block's new owner writes it now
                self.landed_at = prot.forwards


def full_group(prot: Any) -> Any:
    """The protection's full-attention group (the one the injectors pick blocks from)."""
    return prot.groups.get("full_attention") or next(iter(prot.groups.values()))


def _shared_block(prot: Any, rng: random.Random) -> tuple[Any, int] | None:
    """The full-attention group and a block that several requests' tables hold, if there is one."""
    group = full_group(prot)
    seen: dict[int, int] = {}
    for blocks in group.allocator.block_table.values():
        for b in set(blocks):
            seen[b] = seen.get(b, 0) + 1
    shared = sorted(b for b, n in seen.items() if n >= 2)
    return (group, rng.choice(shared)) if shared else None


def _flip_bit(g: Any, slot: int, rng: random.Random) -> dict:
    """Flip one bit of one K or V byte of ``slot`` in group ``g``; what was flipped, for ``detail``."""
    src = rng.choice(g.canary.layout.sources)
    off = rng.randrange(src.row_bytes)
    src.slot_bytes(slot)[0, off] ^= 1 << rng.randrange(8)
    return {"slot": slot, "source": src.name, "byte": off}


def flip_shared_byte(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """Flip one bit of a K or V byte in a prefix block shared by several requests."""
    picked = _shared_block(prot, rng)
    if picked is None:
        return False
    g, block = picked
    detail.update(block=block, **_flip_bit(g, block * g.block_size + rng.randrange(g.block_size), rng))
    return True


def redirect_table_entry(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """Point one fully cached block of a request's table at another request's block."""
    g = full_group(prot)
    reqs = runner.inputs_and_outputs.requests_in_batch
    tables = g.allocator.block_table
    cu_k = batch["cu_seq_lens_k"][g.name] if isinstance(batch["cu_seq_lens_k"], dict) else batch["cu_seq_lens_k"]
    read = batch["read_index"][g.index]
    for i, fs in enumerate(reqs):
        past = fs.state.position_offset - fs.query_length
        mine = tables.get(fs.state.request_id, [])
        if past < g.block_size or not read.numel():
            continue
        others = sorted({b for rid, bl in tables.items() if rid != fs.state.request_id for b in bl} - set(mine))
        if not others:
            continue
        bi = rng.randrange(past // g.block_size)
        foreign = rng.choice(others)
        start = int(cu_k[i]) + bi * g.block_size
        read[start : start + g.block_size] = g.pages.physical(g.pages.block_slots([foreign])).to(read.dtype)
        detail.update(request=fs.state.request_id, block_index=bi, was=mine[bi], now=foreign)
        return True
    return False


def free_shared_block(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """Return a block still shared by several requests to the free pool, so it is handed out again."""
    picked = _shared_block(prot, rng)
    if picked is None:
        return False
    g, block = picked
    g.allocator.pool.free_blocks(g.index, [block])
    readers = [rid for rid, bl in g.allocator.block_table.items() if block in bl]
    detail.update(block=block, readers=readers, watch_block=block)
    return True


def flip_cold_byte(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """Flip one bit of a K or V byte of a stamped slot in a block the prefix cache keeps but no live
    request holds: no read finds it until a later request hits the prefix; the patrol scrub must."""
    g = full_group(prot)
    a = g.allocator
    held = {b for blocks in a.block_table.values() for b in blocks}
    cold = sorted((set(a.ledger.cached_blocks) | set(a.ledger.block_to_hash)) - held)
    pos = g.canary.stamps[:, 1]
    bs = g.block_size
    slots = [b * bs + i for b in cold for i in range(bs) if int(pos[b * bs + i]) >= 0]
    if not slots:
        return False
    slot = rng.choice(slots)
    detail.update(block=g.block_of(slot), cold=True, **_flip_bit(g, slot, rng))
    return True


def write_read_trash(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """A stray write (a padding token's write index left at 0) lands in the read trash, the slot
    padding tokens read their KV from and the engine never writes."""
    g = full_group(prot)
    detail.update(reserved=True, **_flip_bit(g, g.canary.layout.reserved[0], rng))
    return True


INJECTORS = {
    "flip_shared_byte": flip_shared_byte,
    "redirect_table_entry": redirect_table_entry,
    "free_shared_block": free_shared_block,
    "flip_cold_byte": flip_cold_byte,
    "write_read_trash": write_read_trash,
    **KERNEL_INJECTORS,  # the attention-kernel and cache-write faults (kvcanary.faults.transformers_kernel)
}
