"""Injectors for every detectable fault class, on the scripted paged engine.

An injector acts on a running :class:`~kvcanary.sim.engine.ScriptedEngine` through its
hooks or state, once, and returns an :class:`Injection` describing what it corrupted (or ``None``
when the engine has no suitable target yet; the runner then tries again a step later). The
injection's ``landed`` flag turns true when the corruption has actually happened, which for some
classes is a few steps after arming (a late write lands once the slot is reused).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvcanary.sim.engine import Request, ScriptedEngine
from kvcanary.step import Step


@dataclass
class Injection:
    """What an injector corrupted; ``landed`` once the corruption exists, ``in_forward`` if it lands
    inside a forward (so that forward's own checks may already see it)."""

    detail: dict[str, Any] = field(default_factory=dict)
    landed: bool = True
    in_forward: bool = False


Injector = Callable[[ScriptedEngine, random.Random], "Injection | None"]


def _live(eng: ScriptedEngine, rng: random.Random, min_cached: int = 1) -> Request | None:
    cands = [r for r in eng.running if r.computed >= min_cached and r.offloaded is None]
    return rng.choice(cands) if cands else None


def _once(eng: ScriptedEngine, point: str, fn: Callable[[ScriptedEngine, Any], bool]) -> None:
    """Run ``fn`` at hook ``point`` until it returns True, then remove it."""

    def hook(e: ScriptedEngine, arg: Any) -> None:
        if fn(e, arg):
            eng.hooks[point].remove(hook)

    eng.hooks.setdefault(point, []).append(hook)


def _corrupt_bytes(kind: str) -> Injector:
    def inject(eng: ScriptedEngine, rng: random.Random) -> Injection | None:
        cold = [b for b in eng.pool.lru]  # cached blocks no request is reading: found by the scrub
        req = _live(eng, rng)
        if cold and (req is None or rng.random() < 0.5):
            slot = rng.choice(cold) * eng.spec.block_size + rng.randrange(eng.spec.block_size)
            target: dict[str, Any] = {"target": "cold", "slot": slot}
        elif req is not None:
            pos = rng.randrange(req.computed)
            slot = eng.slots_of(req, pos, pos + 1)[0]
            target = {"target": "live", "request": req.rid, "position": pos, "slot": slot}
        else:
            return None
        src = rng.choice(eng.layout.sources)
        row = src.slot_bytes(slot)[rng.randrange(src.rows)]
        n = row.shape[0]
        if kind == "bit_flip":
            off = rng.randrange(n)
            row[off] ^= 1 << rng.randrange(8)
            offs = [off]
        elif kind == "multi_bit_flip":
            offs = rng.sample(range(n), min(n, rng.randint(2, 5)))
            for off in offs:
                row[off] ^= 1 << rng.randrange(8)
        elif kind == "byte_smash":
            offs = [rng.randrange(n)]
            row[offs[0]] ^= 0xFF
        else:  # 16-byte-aligned burst
            start = rng.randrange(n // 16) * 16
            offs = list(range(start, start + 16))
            row[start : start + 16] ^= torch.tensor([rng.randrange(1, 256) for _ in range(16)], dtype=torch.uint8)
        return Injection({**target, "source": src.name, "bytes": offs})

    return inject


def late_write_after_free(eng: ScriptedEngine, rng: random.Random) -> Injection | None:
    """Abort a request; its in-flight write lands later in a slot already given to another request."""
    req = _live(eng, rng, min_cached=2)
    if req is None:
        return None
    slots = eng.slots_of(req, 0, req.computed)
    stale = [[view[torch.tensor(slots)] for view in pair] for pair in eng.kv]  # index gathers are copies
    blocks = list(req.blocks)
    eng.abort(req)
    pool = eng.pool
    for b in blocks:  # an abort frees without caching; a LIFO free list hands the blocks out first
        if pool.refs[b]:
            continue
        if b in pool.lru:
            del pool.lru[b]
            del pool.cached[pool.hash_of.pop(b)]
        if b in pool.free:
            pool.free.remove(b)
        pool.free.appendleft(b)
    eng.add_request([rng.randrange(eng.spec.vocab) for _ in range(2 * eng.spec.block_size)], 2)
    inj = Injection({"aborted": req.rid, "slots": slots}, landed=False)

    def land(e: ScriptedEngine, step: Step) -> bool:
        owned = {s: r for r in e.running for s in e.slots_of(r, 0, r.computed)}
        for i, s in enumerate(slots):
            idx = torch.tensor([s])
            differs = any(not torch.equal(view[idx], rows[i : i + 1]) for pair, old in zip(e.kv, stale)
                          for view, rows in zip(pair, old))
            if s in owned and differs:  # a shared-prefix owner would hold the very same bytes
                for pair, old in zip(e.kv, stale):
                    for view, rows in zip(pair, old):
                        view[idx] = rows[i : i + 1]
                inj.detail.update(landed_in=s, new_owner=owned[s].rid)
                inj.landed = True
                return True
        return False

    _once(eng, "after_step", land)
    return inj


def slot_reused_while_referenced(eng: ScriptedEngine, rng: random.Random) -> Injection | None:
    """Give a block a request still reads back to the allocator (double ownership)."""
    cands = [r for r in eng.running if r.computed >= eng.spec.block_size and r.offloaded is None
             and r.max_new - r.generated >= 3]  # the victim keeps reading for a few more steps
    if not cands:
        return None
    req = rng.choice(cands)
    block = req.blocks[rng.randrange(req.computed // eng.spec.block_size)]
    eng.pool.free.appendleft(block)
    eng.add_request([rng.randrange(eng.spec.vocab) for _ in range(3 * eng.spec.block_size)], 4)
    return Injection({"request": req.rid, "block": block})


def _table_hook(shift: bool) -> Injector:
    def inject(eng: ScriptedEngine, rng: random.Random) -> Injection | None:
        bs = eng.spec.block_size
        if not any(r.computed >= 2 * bs for r in eng.running) or len(eng.running) < 2:
            return None
        inj = Injection({}, landed=False, in_forward=True)

        def corrupt(e: ScriptedEngine, step: Step) -> bool:
            rows = [i for i, r in enumerate(e.last_rows) if r.computed >= 2 * bs]
            if not rows:
                return False
            i = rng.choice(rows)
            req = e.last_rows[i]
            b = rng.randrange(1, req.computed // bs)  # a block boundary inside the cached part
            if shift:
                if step.slot_table is not None:
                    t = step.slot_table[i]
                    t[b * bs : -1] = t[b * bs + 1 :].clone()
                else:
                    t = step.block_table[i]  # type: ignore[index]
                    t[b:] = t[b:].roll(-1)
                inj.detail.update(request=req.rid, shifted_from_position=b * bs)
            else:
                victim_pos = rng.randrange(req.computed)
                own = req.blocks[victim_pos // bs]
                # the redirected slots (the whole block for a block table) holding the very same
                # bytes (an unshared copy of the same prefix) would be harmless: only a differing one is a fault
                span = range(bs) if step.slot_table is None else [victim_pos % bs]
                foreign_blocks = [b for r in e.running if r is not req for b in r.blocks if b not in req.blocks
                                  and not _same_bytes(e, [b * bs + o for o in span], [own * bs + o for o in span])]
                if not foreign_blocks:
                    return False
                foreign = rng.choice(foreign_blocks) * bs + victim_pos % bs
                if step.slot_table is not None:
                    step.slot_table[i, victim_pos] = foreign
                else:
                    step.block_table[i, victim_pos // bs] = foreign // bs  # type: ignore[index]
                inj.detail.update(request=req.rid, position=victim_pos, foreign_slot=foreign)
            inj.landed = True
            return True

        _once(eng, "before_forward", corrupt)
        return inj

    return inject


def _same_bytes(e: ScriptedEngine, a: list[int], b: list[int]) -> bool:
    """Slots ``a`` hold the same KV bytes as slots ``b``, pairwise, in every layer."""
    sa, sb = torch.tensor(a), torch.tensor(b)
    return all(torch.equal(view[sa], view[sb]) for pair in e.kv for view in pair)


def _step_hook(point: str, mutate: Callable[[ScriptedEngine, Step, random.Random, dict], bool]) -> Injector:
    def inject(eng: ScriptedEngine, rng: random.Random) -> Injection | None:
        inj = Injection({}, landed=False, in_forward=True)

        def fire(e: ScriptedEngine, step: Step) -> bool:
            if mutate(e, step, rng, inj.detail):
                inj.landed = True
                return True
            return False

        _once(eng, point, fire)
        return inj

    return inject


def _wrong_position(e: ScriptedEngine, step: Step, rng: random.Random, d: dict) -> bool:
    real = (step.new_slots >= 0).nonzero().squeeze(1)
    if not real.numel():
        return False
    i = int(real[rng.randrange(real.numel())])
    step.new_positions[i] += rng.choice([-1, 1]) if int(step.new_positions[i]) > 0 else 1
    d.update(token_index=i, slot=int(step.new_slots[i]))
    return True


def _wrong_token(e: ScriptedEngine, step: Step, rng: random.Random, d: dict) -> bool:
    if not step.num_new:
        return False
    i = rng.randrange(step.num_new)
    real = int(step.new_tokens[i])
    step.new_tokens[i] = (real + 1 + rng.randrange(e.spec.vocab - 1)) % e.spec.vocab
    d.update(token_index=i, real=real, fed=int(step.new_tokens[i]))
    return True


def _garbage(e: ScriptedEngine, slot: int, rng: random.Random) -> None:
    """Write another token's K/V (a padding token's) into ``slot``, as a stray write does."""
    e.write_kv(torch.tensor([0]), torch.tensor([0]), torch.tensor([slot]), torch.tensor([rng.getrandbits(40)]))


def _cached_slot(e: ScriptedEngine, step: Step, rng: random.Random, d: dict) -> int | None:
    """A live request's cached slot that ``step`` does not write (recorded in ``d``), if any."""
    req = _live(e, rng)
    if req is None:
        return None
    pos = rng.randrange(req.computed)
    slot = e.slots_of(req, pos, pos + 1)[0]
    if slot in step.new_slots.tolist():
        return None
    d.update(request=req.rid, position=pos, slot=slot)
    return slot


def _padding_write(e: ScriptedEngine, step: Step, rng: random.Random, d: dict) -> bool:
    slot = _cached_slot(e, step, rng, d)
    if slot is None:
        return False
    _garbage(e, slot, rng)
    return True


def _padding_into_reserved(e: ScriptedEngine, step: Step, rng: random.Random, d: dict) -> bool:
    if not e.layout.reserved:
        return False
    slot = rng.choice(e.layout.reserved)
    _garbage(e, slot, rng)
    d.update(target="reserved", slot=slot)
    return True


def _holds_kv(e: ScriptedEngine, slot: int) -> bool:
    """``slot`` holds written KV of a running request or of a cached prefix block."""
    bs = e.spec.block_size
    b, off = divmod(slot, bs)
    if b in e.pool.lru:
        return True
    return any(b in r.blocks and r.computed > r.blocks.index(b) * bs + off for r in e.running)


def padding_slot_wraps_to_live_kv(eng: ScriptedEngine, rng: random.Random) -> Injection | None:
    """A padding token's slot id -1 wraps to the pool's last slot while that slot holds KV."""
    last = eng.num_slots - 1
    if not _holds_kv(eng, last):
        return None
    inj = Injection({"target": "wrapped -1", "slot": last}, landed=False, in_forward=True)

    def fire(e: ScriptedEngine, step: Step) -> bool:
        if not _holds_kv(e, last) or last in step.new_slots.tolist():
            return False
        _garbage(e, last, rng)
        inj.landed = True
        return True

    _once(eng, "after_forward", fire)
    return inj


def _padding_token_write(e: ScriptedEngine, step: Step, rng: random.Random, d: dict) -> bool:
    slot = _cached_slot(e, step, rng, d)
    if slot is None:
        return False
    e.padding_writes = [slot]  # a stale write index left in the padded part of the batch
    return True


def _flip_cold(eng: ScriptedEngine, rng: random.Random, block: int) -> int:
    slot = block * eng.spec.block_size + rng.randrange(eng.spec.block_size)
    src = rng.choice(eng.layout.sources)
    row = src.slot_bytes(slot)[rng.randrange(src.rows)]
    row[rng.randrange(row.shape[0])] ^= 1 << rng.randrange(8)
    return slot


def cold_bytes_then_prefix_hit(eng: ScriptedEngine, rng: random.Random) -> Injection | None:
    """Flip a bit of a cached block no request reads, then send a request that hits it in the prefix
    cache: it lands at that request's first forward, whose first-read verification must catch it."""
    donors = [r for r in eng.finished if r.prompt_len > eng.spec.block_size]
    donor = rng.choice(donors) if donors else None
    block = eng.pool.cached.get(eng.prefix_hash(donor, 1)) if donor is not None else None
    if block is None or block not in eng.pool.lru:
        return None
    slot = _flip_cold(eng, rng, block)
    reader = eng.add_request(donor.tokens[: donor.prompt_len], 2)  # type: ignore[union-attr]
    inj = Injection({"target": "cold", "block": block, "slot": slot, "reader": reader.rid}, landed=False,
                    in_forward=True)

    def reads(e: ScriptedEngine, step: Step) -> bool:
        if reader in e.last_rows:
            inj.landed = block in reader.blocks  # evicted before the hit: the flipped bytes were overwritten
            inj.detail["evicted"] = not inj.landed
            return True
        return False

    _once(eng, "before_forward", reads)
    return inj


def cold_bytes_never_read(eng: ScriptedEngine, rng: random.Random) -> Injection | None:
    """Flip a bit of a cached block and take it out of the prefix cache and the pool: no request
    reads or reuses it again, so only the patrol can find it."""
    cold = [b for b in eng.pool.lru if b in eng.pool.hash_of]
    if not cold:
        return None
    block = rng.choice(cold)
    del eng.pool.lru[block]
    del eng.pool.cached[eng.pool.hash_of.pop(block)]
    return Injection({"target": "cold", "block": block, "slot": _flip_cold(eng, rng, block)})


def _transfer(kind: str) -> Injector:
    def inject(eng: ScriptedEngine, rng: random.Random) -> Injection | None:
        if not eng.spec.offload:
            raise ValueError("transfer faults need an engine with spec.offload=True")
        victims = [r for r in eng.running if r.computed >= 2 and r.offloaded is None]
        if len(eng.running) < 2 or not victims:
            return None
        victim = rng.choice(victims)
        inj = Injection({"request": victim.rid}, landed=False, in_forward=True)

        def on_offload(e: ScriptedEngine, payload: dict) -> bool:
            if kind != "torn_offload":
                return True
            n = payload["count"]
            tok = rng.randrange(n)
            li = rng.randrange(len(payload["kv"]))
            hi = rng.randrange(len(payload["kv"][li]))
            rows = payload["kv"][li][hi]
            half = rows.shape[1] // 2
            rows[tok, half:] = 0x5A5A  # the second half of the copy never landed on the host
            inj.detail.update(torn_token=tok, layer=li, half=hi)
            return True

        def on_reload(e: ScriptedEngine, payload: dict) -> bool:
            if kind == "transfer_lands_nothing":
                tok = rng.randrange(payload["count"])
                lost = int(payload["slots"][tok])
                for pair, saved in zip(e.kv, payload["kv"]):
                    for view, rows in zip(pair, saved):
                        rows[tok] = view[torch.tensor([lost])][0]  # the "copy" leaves what the slot held
                inj.detail.update(lost_slot=lost, position=tok)
            inj.landed = True
            return True

        _once(eng, "offload", on_offload)
        _once(eng, "reload", on_reload)
        eng.preempt(victim)
        return inj

    return inject


def prefix_cache_recycled_block(eng: ScriptedEngine, rng: random.Random) -> Injection | None:
    """Recycle a cached block for other tokens while its prefix-cache entry still points at it."""
    cached = [b for b in eng.pool.lru if b in eng.pool.hash_of]
    donors = [r for r in eng.finished if r.prompt_len > eng.spec.block_size]
    if not cached or not donors:
        return None
    donor = rng.choice(donors)
    h = eng.prefix_hash(donor, 1)
    block = eng.pool.cached.get(h)
    if block is None or block not in eng.pool.lru:
        return None
    del eng.pool.lru[block]  # recycled: allocatable again, yet still in the prefix cache
    eng.pool.free.appendleft(block)
    eng.add_request([rng.randrange(eng.spec.vocab) for _ in range(2 * eng.spec.block_size)], 2)
    inj = Injection({"block": block, "donor": donor.rid}, landed=False, in_forward=True)
    readers: list[Request] = []

    def add_reader(e: ScriptedEngine, step: Step) -> bool:
        if any(block in r.blocks for r in e.running):  # the filler now owns and wrote it
            readers.append(e.add_request(donor.tokens[: donor.prompt_len], 2))
            return True
        return False

    def reads(e: ScriptedEngine, step: Step) -> bool:
        if readers and readers[0] in e.last_rows and block in readers[0].blocks:
            inj.landed = True  # this forward reads the recycled block through the prefix cache
            return True
        return False

    _once(eng, "after_step", add_reader)
    _once(eng, "before_forward", reads)
    return inj


INJECTORS: dict[str, Injector] = {
    "bit_flip": _corrupt_bytes("bit_flip"),
    "multi_bit_flip": _corrupt_bytes("multi_bit_flip"),
    "byte_smash": _corrupt_bytes("byte_smash"),
    "burst_16b": _corrupt_bytes("burst_16b"),
    "late_write_after_free": late_write_after_free,
    "slot_reused_while_referenced": slot_reused_while_referenced,
    "table_redirect": _table_hook(shift=False),
    "table_shift": _table_hook(shift=True),
    "wrong_position": _step_hook("after_forward", _wrong_position),
    "wrong_input_token": _step_hook("before_forward", _wrong_token),
    "transfer_lands_nothing": _transfer("transfer_lands_nothing"),
    "torn_offload": _transfer("torn_offload"),
    "prefix_cache_recycled_block": prefix_cache_recycled_block,
    "padding_write_into_real_slot": _step_hook("after_forward", _padding_write),
    "padding_write_into_reserved": _step_hook("after_forward", _padding_into_reserved),
    "padding_slot_wraps_to_live_kv": padding_slot_wraps_to_live_kv,
    "padding_token_writes_live_slot": _step_hook("before_forward", _padding_token_write),
    "cold_bytes_then_prefix_hit": cold_bytes_then_prefix_hit,
    "cold_bytes_never_read": cold_bytes_never_read,
}
