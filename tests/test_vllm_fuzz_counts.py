"""The vLLM fuzz's counters from a tensor-parallel run's Prometheus samples
(kvcanary.faults.vllm_fuzz.summed): each KV cache group's canary counts the forwards, so a rank's
forwards are the most of its groups' counts, not their sum, and the connector's device-step count
is compared with that."""

from kvcanary.faults.vllm_fuzz import summed


def test_forwards_are_a_rank_s_most_over_its_groups_summed_over_ranks():
    samples = []
    for rank in ("0", "1"):
        for group, steps, verified in (("full", 109, 1000), ("sliding", 109, 500)):
            samples.append(("kvcanary_steps_total", {"group": group, "tp_rank": rank}, steps))
            samples.append(("kvcanary_slots_verified_total", {"group": group, "tp_rank": rank}, verified))
        samples.append(("kvcanary_device_steps_total", {"group": "full", "tp_rank": rank}, 109))
        samples.append(("kvcanary_device_steps_total", {"group": "sliding", "tp_rank": rank}, 0))
    samples.append(("kvcanary_internal_errors_total", {"group": "full", "tp_rank": "1"}, 2))
    samples.append(("kvcanary_guard_checks_total", {"group": "full", "tp_rank": "0"}, 7))  # not a fuzz counter
    for rank, queries, writes in (("0", 40, 960), ("1", 38, 960)):  # the adapter's, with its first group's labels
        samples.append(("kvcanary_audit_queries_total", {"group": "full", "tp_rank": rank}, queries))
        samples.append(("kvcanary_write_slots_checked_total", {"group": "full", "tp_rank": rank}, writes))
        samples.append(("kvcanary_audit_queries_total", {"group": "sliding", "tp_rank": rank}, 0))
    out = summed(samples)
    assert out["forwards"] == out["steps"] == 218 and out["device_forwards"] == 218
    assert out["audit_queries"] == 78 and out["write_slots_checked"] == 1920  # every worker's checks, summed
    assert out["slots_verified"] == 3000 and out["internal_errors"] == 2 and "guard_checks" not in out
    # a rank whose steps fell back to the host shows as fewer device steps than forwards
    samples.append(("kvcanary_device_steps_total", {"group": "full", "tp_rank": "2"}, 10))
    samples.append(("kvcanary_steps_total", {"group": "full", "tp_rank": "2"}, 109))
    out = summed(samples)
    assert out["forwards"] == 327 and out["device_forwards"] == 228


def test_a_fifth_of_the_draws_run_vllm_compiled_and_the_rest_of_a_seed_s_crossings_stay():
    """``compiled`` (vLLM's default model execution, torch.compile) is drawn apart from the other
    features: a seed's crossings are what they were without it, the engine runs eager unless it is set."""
    import dataclasses
    import json
    import os
    import random

    from kvcanary.faults.vllm_fuzz import ARCHS, draw

    drawn = []
    for seed in range(40):
        rng = random.Random(seed)
        drawn += [draw(rng, seed * 1000 + i, ARCHS) for i in range(5)]
    share = sum(c.compiled for c in drawn) / len(drawn)
    assert 0.1 < share < 0.3, share
    for c in drawn:
        cfg = c.run_cfg("model")
        assert cfg["eager"] is (not c.compiled) and ("compiled" in c.name) is c.compiled
    # the other fields are what the seed drew before ``compiled`` existed (seed 191's run at bd953ae)
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "bench", "results", "vllm_fuzz_seed191_configs6_bd953ae.jsonl")) as fh:
        recorded = [json.loads(line)["config"] for line in fh if line.startswith('{"config"')]
    rng = random.Random(191)
    now = [draw(rng, 191000 + i, ARCHS) for i in range(len(recorded))]
    assert len(recorded) == 6 and [c.name.replace("-compiled", "") for c in now] == recorded
    assert any(c.compiled for c in now) and not all(c.compiled for c in now)


def test_a_crossing_whose_engine_ran_otherwise_than_it_says_fails():
    """The fuzz judges each run's compilation mode (as the runner reads it from vLLM's configuration)
    against the crossing: a compiled crossing whose engine ran eager, or the other way round, fails."""
    from kvcanary.faults.vllm_fuzz import FuzzConfig, judge

    def runs(mode):
        same = {"kv_cache": {"groups": 1}, "tokens": {"0": [1, 2]}, "events": {}, "compilation": mode}
        return {"off": dict(same), "on": {**same, "stats": {"slots_verified": 4, "forwards": 2}}}

    compiled, eager = FuzzConfig(compiled=True, max_tokens=2), FuzzConfig(max_tokens=2)
    assert judge(compiled, runs("VLLM_COMPILE"), [])["ok"] and judge(eager, runs("NONE"), [])["ok"]
    for cfg, mode in ((compiled, "NONE"), (eager, "VLLM_COMPILE")):
        res = judge(cfg, runs(mode), [])
        assert not res["ok"] and len(res["failures"]) == 2, res["failures"]  # the run without and the run with
        assert all("compilation mode" in f for f in res["failures"]), res["failures"]
    # a runner that says nothing, or could not read vLLM's configuration, is not judged on it
    assert all(judge(c, runs(m), [])["ok"] for c in (compiled, eager) for m in (None, "unknown"))
