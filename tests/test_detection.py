"""Each basic corruption is detected by the right check, at the right row, slot and position."""

import random

import pytest
import torch

from kvcanary import Canary, CanaryConfig, Check, Site
from kvcanary.sim.engine import EngineSpec, ScriptedEngine


def engine(table="block", layout="paged", **kw):
    spec = EngineSpec(num_blocks=32, block_size=4, layout=layout, table=table, num_layers=3, **kw)
    eng = ScriptedEngine(spec)
    # no patrol: these tests pin what the read and write checks find
    eng.canary = Canary(eng.num_slots, eng.layout, CanaryConfig(mode="log", content_budget_bytes=None,
                                                                patrol_budget_bytes=0))
    return eng


def warm(eng, n_req=3, prompt=10, steps=3):
    rng = random.Random(0)
    for _ in range(n_req):
        eng.add_request([rng.randrange(1000) for _ in range(prompt)], 20)
    for _ in range(steps):
        eng.step()
    assert eng.canary.poll() == []


def found(eng, steps=1):
    out = []
    for _ in range(steps):
        eng.step()
        out += eng.canary.poll()
    return out


@pytest.mark.parametrize("layout", ["paged", "packed", "head_major", "flat"])
@pytest.mark.parametrize("where", ["first", "last", "random"])
def test_flipped_kv_byte_in_any_layer_half_and_offset(layout, where):
    eng = engine(layout=layout)
    warm(eng)
    rng = random.Random(f"{layout}-{where}")
    req = eng.running[1]
    pos = rng.randrange(req.computed)
    slot = eng.slots_of(req, pos, pos + 1)[0]
    src = rng.choice(eng.layout.sources)
    b = src.slot_bytes(slot).reshape(-1) if src.rows == 1 else src.slot_bytes(slot)[-1]
    off = {"first": 0, "last": b.shape[0] - 1, "random": rng.randrange(b.shape[0])}[where]
    b[off] ^= 1 << rng.randrange(8)
    v = found(eng)
    assert [(x.checks, x.slot, x.position, x.row) for x in v] == [(Check.CONTENT, slot, pos, 1)]


def test_table_entry_pointing_at_another_requests_slot():
    eng = engine(table="token")
    warm(eng)
    b = eng.running[1]
    victim_pos = 5
    foreign = eng.slots_of(b, victim_pos, victim_pos + 1)[0]

    def redirect(e, step):
        step.slot_table[0, victim_pos] = foreign

    eng.hooks["before_forward"] = [redirect]
    v = found(eng)
    hit = [x for x in v if x.site == Site.VERIFY and x.position == victim_pos and x.row == 0]
    assert hit and hit[0].slot == foreign
    assert Check.TOKEN in hit[0].checks and Check.LINK in hit[0].checks
    # the slot after the redirected one no longer chains either
    assert any(x.position == victim_pos + 1 and Check.LINK in x.checks for x in v)


def test_block_table_entry_redirected_without_expected_tokens():
    eng = engine()
    warm(eng)
    b = eng.running[1]

    def redirect(e, step):
        step.expected_tokens = None
        step.block_table[0, 1] = b.blocks[0]  # positions 4..7 of row 0 now read row 1's positions 0..3

    eng.hooks["before_forward"] = [redirect]
    v = found(eng)
    hit = {x.position: x.checks for x in v if x.row == 0}
    assert set(range(4, 8)) <= set(hit)
    assert all(Check.POSITION in hit[p] for p in range(4, 8))


def test_freed_slot_reused_while_still_referenced():
    eng = engine()
    warm(eng)
    a = eng.running[0]
    stolen = a.blocks[0]
    eng.pool.free.appendleft(stolen)  # double ownership: the allocator hands out a block A still reads
    eng.add_request(list(range(500, 512)), 4)
    v = found(eng, steps=2)
    assert sum(r.blocks.count(stolen) for r in eng.running) >= 2  # two owners of one block
    hit = [x for x in v if x.site == Site.VERIFY and x.slot // 4 == stolen and x.position < 4]
    assert hit, v
    assert all(x.checks & (Check.POSITION | Check.LINK | Check.TOKEN) for x in hit)


def test_stamp_at_wrong_position_is_caught_at_write_and_at_next_read():
    eng = engine()
    warm(eng)

    def skew(e, step):
        step.new_positions[0] += 1  # engine and kernel disagree on row 0's cached length

    eng.hooks["after_forward"] = [skew]
    v = found(eng)
    w = [x for x in v if x.site == Site.WRITE]
    assert len(w) == 1 and Check.WRITE_POSITION in w[0].checks and w[0].row == 0
    assert w[0].stored_position == w[0].position + 1
    eng.hooks["after_forward"] = []
    v = found(eng)
    assert any(x.site == Site.VERIFY and Check.POSITION in x.checks and x.slot == w[0].slot for x in v)


@pytest.mark.parametrize("table", ["token", "block"])
def test_table_shifted_by_one_at_a_page_boundary(table):
    eng = engine(table=table)
    warm(eng, prompt=13)
    boundary = 8

    def shift(e, step):
        step.expected_tokens = None
        if table == "token":
            t = step.slot_table[0]
            t[boundary:-1] = t[boundary + 1 :].clone()
        else:
            t = step.block_table[0]
            t[boundary // 4 :] = t[boundary // 4 :].roll(-1)

    eng.hooks["before_forward"] = [shift]
    v = found(eng)
    first = min((x for x in v if x.row == 0), key=lambda x: x.position)
    assert first.position == boundary
    assert first.checks & (Check.POSITION | Check.LINK)


def test_unwritten_slot_read_is_empty():
    eng = engine()
    warm(eng)

    def point_to_unused(e, step):
        used = {b for r in e.running for b in r.blocks}
        unused = next(b for b in range(e.spec.num_blocks) if b not in used and b not in e.pool.hash_of)
        step.block_table[0, 0] = unused

    eng.hooks["before_forward"] = [point_to_unused]
    v = found(eng)
    assert any(x.checks == Check.EMPTY and x.position == 0 for x in v)


def test_scrub_finds_corruption_in_cold_cache():
    eng = engine()
    warm(eng)
    req = eng.running[2]
    eng.abort(req)  # its full blocks stay in the prefix cache, unread
    cold = next(iter(eng.pool.lru))
    eng.layout.sources[-1].slot_bytes(cold * 4 + 3)[0, 5] ^= 0x10
    canary = eng.canary
    for _ in range(-(-eng.num_slots // canary.config.scrub_slots)):
        canary.scrub()
    v = canary.poll()
    assert [(x.site, x.checks, x.slot) for x in v] == [(Site.SCRUB, Check.CONTENT, cold * 4 + 3)]


def test_write_to_a_slot_the_table_does_not_hold():
    eng = engine()
    warm(eng)

    def misplace(e, step):
        step.new_slots[0] = (step.new_slots[0] + 1) % e.num_slots

    eng.hooks["after_forward"] = [misplace]
    v = found(eng)
    assert any(x.site == Site.WRITE and Check.WRITE_TABLE in x.checks and x.row == 0 for x in v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_write_outside_the_pool_is_reported_and_not_stamped(backend):
    from kvcanary import Step
    from kvcanary.violations import Counter

    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # the interpreter on a CPU
    num_slots = 64
    canary = Canary(num_slots, config=CanaryConfig(mode="log", backend=backend, validate=False), device=dev)
    slots = torch.arange(60, 66, device=dev)  # 64 and 65 are outside the pool; the table agrees with the writes
    step = Step(cached_lens=torch.tensor([0], device=dev), new_offsets=torch.tensor([0, 6], device=dev),
                new_tokens=torch.arange(6, device=dev) + 100, new_positions=torch.arange(6, device=dev),
                new_slots=slots, slot_table=slots.view(1, 6))
    before = canary.stamps.clone()
    canary.after_forward(step)
    v = canary.poll()
    assert canary.internal_errors == 0
    assert [(x.site, x.checks, x.slot, x.position) for x in v] == [(Site.WRITE, Check.BAD_SLOT, s, s - 60)
                                                                  for s in (64, 65)]
    assert torch.equal(canary.stamps[:60], before[:60]) and (canary.stamps[60:64, 1].cpu() == torch.arange(4)).all()
    assert int(canary.ring.counters[Counter.SLOTS_STAMPED]) == 4
