"""Guard slots: reserved slots and guarded live slots checked every forward, padding writes into live
or reserved KV, and the bound on how long a stamped slot's bytes go unverified."""

import dataclasses
import logging

import pytest
import torch

from kvcanary import Canary, CanaryConfig, ConfigError
from kvcanary.diagnosis import explain
from kvcanary.errors import LayoutError
from kvcanary.layout import KvLayout
from kvcanary.violations import Check, Site, events

from factories import paged_layout

BS, NB = 4, 16  # 64 slots; block 0 is the null block


def canary(backend="torch", mode="raise", reserved=tuple(range(BS)), guards=(), **cfg):
    layout = dataclasses.replace(paged_layout(NB, BS, row=32, nsrc=2), reserved=reserved, guards=guards)
    return Canary(NB * BS, layout, CanaryConfig(mode=mode, backend=backend, **cfg)), layout


def stamp(c, slots, positions):
    """Give ``slots`` a stamp whose content matches their bytes (as a write would)."""
    slots = torch.tensor(slots)
    c.stamps[slots, 1] = torch.tensor(positions)
    fp = torch.zeros(len(slots), dtype=torch.int64)
    c._ops["content"](slots, c.table, c.num_slots, fp)
    c.stamps[slots, 3] = fp


def smash(layout, slot):
    layout.sources[0].slot_bytes(slot)[0, 0] ^= 0x5A


@pytest.mark.parametrize("backend", ["torch", "fused", "triton"])
def test_a_write_into_a_reserved_slot_is_reported_once_with_its_step(backend):
    c, layout = canary(backend)
    assert c.guard_slots == BS + 1  # the null block, and the pool's first and last slot...
    assert c.guards.guarded.tolist() == [NB * BS - 1]  # ...of which slot 0 is reserved already
    c.guard()
    assert c.poll() == []  # untouched: nothing
    smash(layout, 2)
    c.guard()
    c.guard()  # the same change is one record, with the step it was first seen at
    with pytest.raises(Exception) as e:
        c.poll()
    (v,) = e.value.violations
    assert (v.site, v.checks, v.slot, v.step) == (Site.GUARD, Check.CONTENT, 2, 0)
    assert explain(events([v])[0]).kind == "padding_write"
    c.guard()
    assert c.poll() == []  # the changed bytes are the new reference: not reported again
    smash(layout, 2)
    c.guard()
    with pytest.raises(Exception):
        c.poll()


@pytest.mark.parametrize("backend", ["torch", "fused", "triton"])
def test_a_guarded_live_slot_whose_bytes_change_is_reported_every_forward(backend):
    c, layout = canary(backend, guards=(17,))
    last = NB * BS - 1
    stamp(c, [17, last, 30], [1, 3, 2])
    c.guard()
    assert c.poll() == []
    for s in (17, last, 30):
        smash(layout, s)
    c.guard()
    with pytest.raises(Exception) as e:
        c.poll()
    got = {(v.site, v.slot) for v in e.value.violations}
    assert got == {(Site.GUARD, 17), (Site.GUARD, last)}  # slot 30 is not a guard: left to the patrol and reads
    ev = events(e.value.violations)[0]
    assert explain(ev).kind == "padding_write" and "guarded" in explain(ev).evidence
    assert c.stats()["slots_scrubbed"] == 0 and c.stats()["guard_checks"] == 2 * c.guard_slots


def test_every_forward_runs_the_guards_and_a_guard_never_reports_an_unstamped_slot():
    from kvcanary.step import Step

    c, layout = canary(patrol_budget_bytes=0)
    t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    step = Step(slot_table=t(50)[None], cached_lens=t(0), new_offsets=t(0, 1), new_tokens=t(9), new_positions=t(0),
                new_slots=t(50))
    smash(layout, NB * BS - 1)  # empty: nothing to compare with (a write will stamp it)
    c.after_forward(step)
    assert c.poll() == []
    smash(layout, 1)
    c.after_forward(step)
    with pytest.raises(Exception) as e:
        c.poll()
    assert [(v.site, v.slot, v.step) for v in e.value.violations] == [(Site.GUARD, 1, 1)]  # that forward's step


@pytest.mark.parametrize("backend", ["torch", "fused", "triton"])
def test_padding_writes_into_live_or_reserved_slots_are_reported(backend):
    from kvcanary.step import Step

    c, layout = canary(backend, mode="log")
    t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    step = Step(slot_table=t(50)[None], cached_lens=t(0), new_offsets=t(0, 1), new_tokens=t(9), new_positions=t(0),
                new_slots=t(50))
    c.before_forward(step)
    stamp(c, [20, 21], [0, 1])
    pads = torch.tensor([-1, 20, 2, 40, 70])  # skipped, live, reserved, empty, outside the pool
    c.after_forward(step, padding_slots=pads)
    found = [v for v in c.poll() if v.checks & Check.PADDING_WRITE]
    assert {(v.slot, v.checks) for v in found} == {
        (20, Check.PADDING_WRITE), (2, Check.PADDING_WRITE), (70, Check.PADDING_WRITE | Check.BAD_SLOT)}
    assert all(v.site == Site.WRITE and v.step == 0 for v in found)
    live = next(e for e in events(found) if 20 in [v.slot for v in e.violations])
    assert "stamped for position 0 of a live sequence" in explain(live).evidence


def test_layout_guard_slots_are_checked():
    with pytest.raises(ConfigError, match="layout reserved: slot 64 is outside the pool, expected 0 .. 63"):
        canary(reserved=(0, 64))
    with pytest.raises(ConfigError, match="layout guards: slot -1 is outside the pool"):
        canary(guards=(-1,))
    with pytest.raises(LayoutError, match="reserved: expected slot ids"):
        KvLayout((), reserved=(0.5,))  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="guards: expected slot ids"):
        KvLayout((), guards="12")  # type: ignore[arg-type]
    assert Canary(64, config=CanaryConfig()).guard_slots == 0  # metadata only: no bytes to guard


def test_a_failing_guard_is_counted_never_raised_in_log_mode(caplog, monkeypatch):
    c, layout = canary(mode="log")

    def broken(*a):
        raise RuntimeError("content op failed")

    from kvcanary.step import Step

    t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    step = Step(slot_table=t(50)[None], cached_lens=t(0), new_offsets=t(0, 1), new_tokens=t(9), new_positions=t(0),
                new_slots=t(50))
    monkeypatch.setitem(c._ops, "content", broken)
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        c.after_forward(step)  # the guard fails inside it: counted, and the step's own stamps stand
        c.guard()
    assert c.internal_errors == 2 and c.poll() == []
    assert int(c.stamps[50, 1]) == 0 and c.stats()["steps"] == 1


def test_unverified_age_is_bounded_by_the_patrol_walk():
    c, _ = canary(mode="log", patrol_budget_bytes=64 * 16)  # 16 of 64 slots a call: a pass every 4 forwards
    assert c.stats()["patrol_pass_steps"] == 4
    for i in range(1, 11):
        c.forwards += 1  # as after_forward counts them
        assert c.stats()["unverified_age_max_steps"] == min(i, 4)  # a pass: 4 forwards
        c.patrol()
    nop, _ = canary(mode="log", patrol_budget_bytes=0)
    nop.forwards = 7
    assert nop.stats()["unverified_age_max_steps"] == 7  # no patrol: as old as the canary's watch


def _every_byte_of(geom, slot):
    """Every byte offset (from the storage's first byte) of ``slot``'s K and V in ``geom``."""
    return [geom.element(h, slot, head, d) + b for h in ("k", "v") for head in range(geom.num_kv_heads)
            for d in range(geom.head_dim) for b in range(geom.element_size)]


@pytest.mark.parametrize("isa", ["vec16", "amx"])
def test_the_fused_guard_snapshot_covers_every_byte_of_the_null_block(isa):
    """vLLM's CPU layouts: the fused guard compares the null block's bytes with a snapshot first;
    a change of any one byte of any reserved slot, in any layer, still reaches the per-slot check
    and is reported once with its slot, and then the snapshot holds the new bytes."""
    from kvcanary.geometry.vllm_cpu import vllm_cpu

    bs, heads, dim, blocks = 16, 2, 16, 6
    caches = [torch.randn(blocks, heads, bs, 2 * dim).to(torch.bfloat16) for _ in range(2)]
    geoms = [vllm_cpu(t, isa, bs, heads, dim, i) for i, t in enumerate(caches)]
    layout = KvLayout(tuple(s for i, g in enumerate(geoms) for s in g.sources(f"layer{i}")), reserved=tuple(range(bs)))
    c = Canary(blocks * bs, layout, CanaryConfig(mode="log", backend="fused"))
    g = c.guards
    assert g.snapshot is not None and g.regions.shape[0] >= 1
    assert int(g.regions[:, 1].sum()) <= 2 * bs * c.table.bytes_per_slot
    flat = [geoms[i].storage_bytes() for i in range(2)]
    import random

    rng = random.Random(3)
    for trial in range(12):
        layer, slot = rng.randrange(2), rng.randrange(bs)
        at = rng.choice(_every_byte_of(geoms[layer], slot))
        flat[layer][at] ^= 1 << rng.randrange(8)
        c.guard()
        found = c.poll()
        assert [(v.site, v.slot) for v in found] == [(Site.GUARD, slot)], (trial, layer, slot, at)
        c.guard()
        assert c.poll() == []  # the snapshot and the fingerprints hold the changed bytes now
    assert c.stats()["guard_checks"] == 24 * c.guard_slots


def test_no_snapshot_where_a_reserved_slot_spans_live_kv():
    """A reserved slot whose bytes lie far apart (here: K of one slot spread over a block shared
    with live slots) would make the guard compare and copy live KV on every forward: no snapshot,
    the per-slot check alone, with the same results."""
    from kvcanary.geometry.vllm_cpu import vllm_cpu

    bs, heads, dim, blocks = 16, 2, 16, 6
    cache = torch.randn(blocks, heads, bs, 2 * dim).to(torch.bfloat16)
    geom = vllm_cpu(cache, "vec16", bs, heads, dim, 0)
    c = Canary(blocks * bs, KvLayout(geom.sources("layer0"), reserved=(3,)), CanaryConfig(mode="log", backend="fused"))
    assert c.guards.snapshot is None
    geom.storage_bytes()[geom.element("k", 3, 1, 7)] ^= 4
    c.guard()
    assert [(v.site, v.slot) for v in c.poll()] == [(Site.GUARD, 3)]


@pytest.mark.parametrize("seed", range(4))
def test_the_snapshot_comparison_finds_any_changed_byte_at_any_alignment(seed):
    """The fused guard's snapshot comparison (chunked, vectorised where the words are aligned) says
    equal exactly when every byte of every region is, for regions of any length at any offset."""
    import numpy as np
    from numba import njit

    from kvcanary.fused.snapshot import R_LEN, same, take, taken

    @njit
    def _same(regions, snap):  # the inline helpers through one compiled entry
        return same(regions.ctypes.data, regions.shape[0], snap.ctypes.data)

    @njit
    def _take(regions, snap):
        take(regions.ctypes.data, regions.shape[0], snap.ctypes.data)

    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, 40_000, dtype=np.uint8)
    starts = np.sort(rng.choice(30_000, 5, replace=False))
    starts[0], starts[1] = starts[0] // 8 * 8, starts[1] // 8 * 8 + 3  # words aligned, and not
    lens = rng.integers(1, 2_000, 5)
    lens[0] = 1031  # over a chunk, with a tail of words and of bytes
    at = np.concatenate([[0], np.cumsum(-(-lens // 8) * 8)[:-1]])
    regions = np.stack([pool.ctypes.data + starts, lens, at], axis=1).astype(np.int64)
    snap = taken(regions)
    assert _same(regions, snap)
    for r in range(len(regions)):
        for off in (0, 1, int(regions[r, R_LEN]) // 2, int(regions[r, R_LEN]) - 1):
            i = starts[r] + off
            pool[i] ^= 0x10
            assert not _same(regions, snap), (r, off)
            pool[i] ^= 0x10
    assert _same(regions, snap)
    pool[starts[2]] ^= 1
    _take(regions, snap)  # the new bytes taken: equal again
    assert _same(regions, snap)


@pytest.mark.parametrize("seed", range(3))
def test_an_all_zero_snapshot_compares_the_live_bytes_with_zero(seed):
    """A snapshot whose bytes are all zero (a zeroed pool's null block) says so in its first word, and
    the comparison then reads only the live bytes: any byte set, at any alignment, makes it unequal;
    once the changed bytes are taken the snapshot is no longer all zero and compares with its copy,
    and taken back to zeros it is all zero again."""
    import numpy as np
    from numba import njit

    from kvcanary.fused.snapshot import HEADER, R_LEN, same, take, taken

    @njit
    def _same(regions, snap):
        return same(regions.ctypes.data, regions.shape[0], snap.ctypes.data)

    @njit
    def _take(regions, snap):
        take(regions.ctypes.data, regions.shape[0], snap.ctypes.data)

    def zero_flag(snap):
        return int(snap[:HEADER].view(np.int64)[0])

    rng = np.random.default_rng(seed)
    pool = np.zeros(40_000, dtype=np.uint8)
    starts = np.sort(rng.choice(30_000, 4, replace=False))
    starts[0], starts[1] = starts[0] // 8 * 8, starts[1] // 8 * 8 + 5  # words aligned, and not
    lens = rng.integers(1, 2_000, 4)
    lens[0] = 1031
    at = np.concatenate([[0], np.cumsum(-(-lens // 8) * 8)[:-1]])
    regions = np.stack([pool.ctypes.data + starts, lens, at], axis=1).astype(np.int64)
    snap = taken(regions)
    assert zero_flag(snap) == 1 and _same(regions, snap)
    for r in range(len(regions)):
        for off in (0, 1, int(regions[r, R_LEN]) // 2, int(regions[r, R_LEN]) - 1):
            i = starts[r] + off
            pool[i] = 0x80
            assert not _same(regions, snap), (r, off)
            pool[i] = 0
    assert _same(regions, snap)
    pool[starts[3] + int(lens[3]) - 1] = 7
    _take(regions, snap)  # the changed bytes taken: a copy to compare with
    assert zero_flag(snap) == 0 and _same(regions, snap)
    pool[starts[3] + int(lens[3]) - 1] = 0
    assert not _same(regions, snap)  # zero again differs from the copy
    _take(regions, snap)
    assert zero_flag(snap) == 1 and _same(regions, snap)
    pool[-1] = 9  # a byte past every region is none of the guard's business
    assert _same(regions, snap)
