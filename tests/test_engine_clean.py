"""Randomized clean runs of the scripted engine verify clean: sharing, eviction, reuse, chunked
prefill, preemption, aborts, windows, padding, both table kinds, every layout kind."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcanary import Canary, CanaryConfig
from kvcanary.sim import workload
from kvcanary.sim.engine import EngineSpec, ScriptedEngine


def run_clean(spec: EngineSpec, wl: workload.Workload, budget=None):
    eng = ScriptedEngine(spec)
    canary = Canary(eng.num_slots, eng.layout, CanaryConfig(mode="raise", content_budget_bytes=budget))
    eng.canary = canary
    workload.run(eng, wl, on_step=lambda e: (canary.poll(), canary.scrub()))
    return eng, canary.stats()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    layout=st.sampled_from(["flat", "paged", "packed", "head_major", "mla"]),
    table=st.sampled_from(["block", "token"]),
    block_size=st.sampled_from([1, 2, 4, 16]),
    chunk=st.sampled_from([1, 3, 16]),
    window=st.sampled_from([None, None, 5]),
    pad_rows=st.integers(0, 2),
    budget=st.sampled_from([None, 0, 4096]),
    offload=st.booleans(),
)
def test_random_clean_runs(seed, layout, table, block_size, chunk, window, pad_rows, budget, offload):
    spec = EngineSpec(num_blocks=max(8, 160 // block_size), block_size=block_size, layout=layout, table=table,
                      chunk_size=chunk, window=window, pad_rows=pad_rows, offload=offload, seed=seed)
    wl = workload.Workload(requests=10, seed=seed, abort_p=0.1, preempt_p=0.1)
    eng, st_ = run_clean(spec, wl, budget)
    assert st_["violations"] == 0
    assert st_["internal_errors"] == 0
    assert st_["slots_stamped"] > 0 and st_["slots_verified"] > 0


def test_memory_pressure_exercises_eviction_reuse_and_preemption():
    spec = EngineSpec(num_blocks=20, block_size=4, chunk_size=8, max_running=6, seed=1)
    wl = workload.Workload(requests=40, num_prefixes=4, seed=1)
    eng, st_ = run_clean(spec, wl)
    assert st_["violations"] == 0
    assert eng.pool.evictions > 0 and eng.pool.hits > 0 and eng.preemptions > 0
    assert st_["content_bytes_verified"] > 0 and st_["slots_scrubbed"] > 0


def test_offload_and_reload_carry_stamps():
    spec = EngineSpec(num_blocks=20, block_size=4, chunk_size=8, max_running=6, offload=True, seed=2)
    wl = workload.Workload(requests=40, num_prefixes=4, seed=2, preempt_p=0.3)
    eng, st_ = run_clean(spec, wl)
    assert st_["violations"] == 0 and eng.offloads > 0 and eng.reloads > 0
