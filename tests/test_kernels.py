"""Triton kernels equal the torch path bit for bit: stamps, counters, violation sets.

Without a GPU they run under ``TRITON_INTERPRET=1`` on CPU tensors (small cases); with one, on CUDA.
"""

import os
import random

import pytest
import torch

from kvcanary import Canary, CanaryConfig, UnsupportedError, checks
from kvcanary.sim import workload
from kvcanary.sim.engine import EngineSpec, ScriptedEngine
from kvcanary.kernels import stamp as kstamp
from kvcanary.kernels import verify as kverify
from kvcanary.kernels._common import source_table
from kvcanary.kernels.content import content
from kvcanary.violations import NUM_COUNTERS, NUM_FIELDS, Counter

from factories import DEV, clone_step, corrupt, make_layout, prefill_of, random_step, step_to

def rows_of(ring, counters):
    n = int(counters[Counter.VIOLATIONS])
    assert n <= ring.shape[0]
    return sorted(map(tuple, ring[:n].cpu().tolist()))


def first_mismatch(a, b):
    bad = (a != b).nonzero()
    return None if not bad.numel() else (tuple(bad[0].tolist()), a[tuple(bad[0])].item(), b[tuple(bad[0])].item())


CASES = [(bs, kind, lay) for bs in (1, 16, 64) for kind in ("block", "token")
         for lay in ("paged", "packed", "head_major", "partial", "mixed", "none")]
CASES += [(16, kind, lay) for kind in ("block", "token") for lay in ("vec", "amx")]  # narrow runs: one page size


@pytest.mark.parametrize("bs,kind,lay", CASES)
def test_verify_and_stamp_match_torch(bs, kind, lay):
    for seed in range(int(os.environ.get("KVC_KERNEL_SEEDS", 2))):
        rng = random.Random(f"{bs}-{kind}-{lay}-{seed}")  # str seeds are stable across processes
        nb = max(8, 400 // bs)
        layout = make_layout(lay, nb, bs, seed)
        table = source_table(layout, DEV)
        long_row = rng.randint(70, 140)  # more entries than one program's block of 32
        lens = [(long_row, rng.randint(0, 3))] + [(rng.randint(0, 20), rng.randint(0, 40)) for _ in range(2)]
        step, stoks = random_step(rng, nb * bs, bs, lens, kind, rng.randint(0, 2), rng.random() < 0.5,
                                  rng.choice([None, 5]))
        step = step_to(step, DEV)
        pre = step_to(prefill_of(step, stoks), DEV)
        st_t = checks.new_stamps(nb * bs, DEV)
        st_k = st_t.clone()
        c_t, c_k = _zeros(), _zeros()
        ring = torch.zeros(512, NUM_FIELDS, dtype=torch.int64, device=DEV)
        assert checks.stamp(st_t, layout, pre, c_t, 0).shape[0] == 0
        kstamp.stamp(st_k, table, pre, c_k, ring, block=32, carry_pass=rng.choice([2, 1024]))  # several blocks
        assert torch.equal(st_t, st_k), first_mismatch(st_t, st_k)
        assert torch.equal(c_t, c_k)
        corrupt(rng, st_t, layout, step)
        st_k.copy_(st_t)
        for budget in (None, 0, 7):
            c_t, c_k, ring = _zeros(), _zeros(), ring.zero_()
            cur_t = torch.tensor([rng.randrange(50)], device=DEV)
            cur_k = cur_t.clone()
            rows_t = checks.verify(st_t, layout, step, c_t, cur_t, budget, 0)
            kverify.verify(st_k, table, step, c_k, cur_k, budget, ring, block=rng.choice([None, 32]),
                           max_programs_per_row=rng.choice([1, 2, kverify.MAX_GRID_Y]))  # several grid passes
            c_t[Counter.VIOLATIONS] += rows_t.shape[0]
            assert sorted(map(tuple, rows_t.cpu().tolist())) == rows_of(ring, c_k)
            assert torch.equal(c_t, c_k) and torch.equal(cur_t, cur_k)
        if rng.random() < 0.5 and step.num_new:
            step.new_positions[rng.randrange(step.num_new)] += 1
        if rng.random() < 0.5 and step.num_new:  # a write outside the pool: reported, never stamped
            step.new_slots[rng.randrange(step.num_new)] = nb * bs + rng.randrange(3)
        c_t, c_k, ring = _zeros(), _zeros(), ring.zero_()
        rows_t = checks.stamp(st_t, layout, step, c_t, 0)
        unknown = bool((st_k[:, checks.POSITION] == checks.UNKNOWN_POS).any())
        seeds = checks.canonical_seeds(st_k, step) if unknown or rng.random() < 0.5 else None
        kstamp.stamp(st_k, table, step, c_k, ring, block=rng.choice([32, 256]), seeds=seeds)
        c_t[Counter.VIOLATIONS] += rows_t.shape[0]
        assert torch.equal(st_t, st_k), first_mismatch(st_t, st_k)
        assert sorted(map(tuple, rows_t.cpu().tolist())) == rows_of(ring, c_k) and torch.equal(c_t, c_k)


@pytest.mark.parametrize("lay", ["paged", "packed", "head_major", "partial", "mixed"])
def test_content_matches_fingerprint(lay):
    layout = make_layout(lay, 9, 16, 3)
    slots = torch.randperm(9 * 16, device=DEV)[:37]  # a prime count
    slots[5], slots[6] = -1, 9 * 16  # outside the pool: 0
    out = torch.empty(37, dtype=torch.int64, device=DEV)
    content(slots, source_table(layout, DEV), 9 * 16, out)
    want = layout.fingerprint(slots.clamp(0, 9 * 16 - 1))
    want[5] = want[6] = 0
    assert torch.equal(out, want), first_mismatch(out, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scripted engine's pool is on the CPU, and the Triton "
                    "interpreter is off where CUDA is present (the GPU parity tests above cover the kernels there)")
def test_canary_triton_backend_equals_torch_backend_on_an_engine_run():
    stats = {}
    for backend in ("torch", "triton"):
        spec = EngineSpec(num_blocks=24, block_size=4, layout="paged", seed=3)
        eng = ScriptedEngine(spec)
        canary = Canary(eng.num_slots, eng.layout, CanaryConfig(mode="raise", backend=backend, validate=True,
                                                                 content_budget_bytes=1024))
        eng.canary = canary
        workload.run(eng, workload.Workload(requests=6, seed=3), on_step=lambda e: canary.poll())
        assert canary.backend == backend
        stats[backend] = (canary.stats(), canary.stamps.clone())
    assert stats["torch"][0] == stats["triton"][0]
    assert torch.equal(stats["torch"][1], stats["triton"][1])


def test_dispatch():
    assert Canary(8, config=CanaryConfig()).backend == "fused"  # a CPU pool
    assert Canary(8, config=CanaryConfig(backend="torch")).backend == "torch"
    if torch.cuda.is_available():
        assert Canary(8, device="cuda").backend == "triton"
    with pytest.raises(UnsupportedError, match="device: expected cpu or cuda, got meta"):
        Canary(8, device="meta")


def test_triton_on_a_cpu_pool_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UnsupportedError, match="backend 'triton' on a CPU pool .* TRITON_INTERPRET=1"):
        Canary(8, config=CanaryConfig(backend="triton"))


@pytest.mark.parametrize("graph", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU"))])
@pytest.mark.parametrize("budget", [None, 4096])
def test_cuda_graph_replay_matches_eager(budget, graph):
    """Capture a before/after-forward pair, refill the step's tensors in place, replay: the same
    stamps, counters, cursor and violations as eager calls on the new step. Without ``graph`` the
    pair runs on the refilled step without capture (any device: the kernels read the step's tensors
    at launch, which is what a replay relies on)."""
    rng = random.Random(5)
    nb, bs = 64, 16
    layout = make_layout("paged", nb, bs, 5)
    lens = [(40, 1), (70, 3), (33, 300)]  # the 300-token chunk spans several scan blocks
    step, stoks = random_step(rng, nb * bs, bs, lens, "block")
    step, pre = step_to(step, DEV), step_to(prefill_of(step, stoks), DEV)
    other = clone_step(step)  # same shapes and cached prefix; other new tokens, a redirected block, a torn byte
    other.new_tokens.random_(0, 1 << 16)
    other.block_table[0, 1] = step.block_table[1, 1]
    cfg = CanaryConfig(mode="log", validate=False, content_budget_bytes=budget, backend="triton")

    def fresh():
        c = Canary(nb * bs, layout, cfg)
        c.after_forward(pre)
        return c

    warm = fresh()  # compiles every kernel for these shapes outside the capture
    warm.before_forward(step)
    warm.after_forward(step)
    eager, graphed = fresh(), fresh()
    layout.sources[0].slot_bytes(int(step.block_table[1, 0]) * bs)[0, 0] ^= 1  # row 1, position 0
    eager.before_forward(other)
    eager.after_forward(other)
    if graph:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            graphed.before_forward(step)
            graphed.after_forward(step)
    for f in step.__dataclass_fields__:  # refill the captured step in place
        v = getattr(step, f)
        if isinstance(v, torch.Tensor):
            v.copy_(getattr(other, f))
    if graph:
        g.replay()
        torch.cuda.synchronize()
    else:
        graphed.before_forward(step)
        graphed.after_forward(step)
    assert graphed.internal_errors == eager.internal_errors == 0
    assert torch.equal(eager.stamps, graphed.stamps), first_mismatch(eager.stamps, graphed.stamps)
    assert torch.equal(eager.ring.counters, graphed.ring.counters)
    assert torch.equal(eager.cursor, graphed.cursor)
    found = sorted(str(v) for v in eager.poll())
    assert found == sorted(str(v) for v in graphed.poll())
    assert eager.stats()["content_slots_verified"] > 0 and any("CONTENT" in v for v in found)


def _zeros():
    return torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=DEV)

