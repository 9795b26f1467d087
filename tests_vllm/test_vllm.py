"""vLLM's CPU build under the canary, turned on by the connector flag alone.

Each engine run is its own process (tests_vllm/engine_run.py): clean runs verify clean with the
same tokens as without the canary; the multiprocess, tensor-parallel and abort runs verify clean
and report what is injected into them. Each fault of :mod:`kvcanary.faults.vllm` runs once, in
test_selftest.py, where its detection, checks, hurt request and slot are asserted.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


def engine(model, env=None, **cfg):
    cfg = {"model": model, **cfg}
    p = subprocess.run([sys.executable, os.path.join(HERE, "engine_run.py"), json.dumps(cfg)], capture_output=True,
                       text=True, timeout=600, cwd=HERE, env={**os.environ, **(env or {})})
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


# chunked prefill, requests admitted over time and a pool small enough to preempt are crossed with the
# other features in test_fuzz.py (and the long draw of bench/vllm_fuzz.py)
CLEAN = [
    dict(),  # shared prefixes, one batch
]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    """The default run without the canary (shared by the tests that compare with it)."""
    return engine(tiny_llama)


@pytest.mark.parametrize("cfg", CLEAN, ids=["shared"])
def test_clean_runs_verify_clean_and_generate_the_same_tokens(tiny_llama, plain, cfg):
    base = plain if not cfg else engine(tiny_llama, **cfg)
    run = engine(tiny_llama, canary=True, full_scrub=True, **cfg)
    assert run["compilation"] == base["compilation"] == "NONE"  # eager, as asked (the runner's default)
    st = run["stats"]
    assert run["violations"] == [] and st["internal_errors"] == 0
    # the stamps' content, folded layer by layer inside the forward (every forward after the first,
    # whose layers are seen for the first time), is what the cache holds after it
    assert 0 < st["content_folded_in_layers"] < st["slots_stamped"]
    assert run["full_scrub"]["slots"] > 0 and run["full_scrub"]["violations"] == []
    assert st["slots_verified"] > 0 and st["content_bytes_verified"] > 0 and st["slots_stamped"] > 0
    assert sorted(run["tokens"].values()) == sorted(base["tokens"].values())
    assert run["loop_signatures_added"] == []  # kvcanary warmup compiled every loop a default run calls
    # every forward audited (at least one query each), all but the first in one compiled call after it
    assert st["audit_queries"] >= st["forwards"] and st["audit_forwards_one_call"] >= st["forwards"] - 1 > 0
    # forwards without audited queries ran on the last forward's plan (its tables kept), and the
    # full scrub above found their folded stamps right
    assert st["audit_plans_reused"] > 0
    # decode forwards of one shape ran on the kept steps (kvcanary.engines.vllm.steps.Kept), whose values
    # the verify above read right
    assert 0 < st["steps_kept"] < st["forwards"]
    if "num_blocks" in cfg:
        assert run["preemptions"] > 0  # the small pool did force preemption
    if not cfg:  # one batch of shared prefixes: prefix hits computed in the same forward, verified after it
        assert st["slots_verified_after_write"] > 0
    # past the warm-up the tiny model's canary takes more than its 1 % share: the write check thins over
    # the layers, and the layers left unchecked fold their fingerprints from their computed rows, which
    # the full scrub above found equal to the cache's bytes
    assert st["write_slots_unchecked"] > 0 and st["write_slots_checked"] > 0


def test_a_wrong_write_in_a_layer_the_budget_leaves_unchecked_is_found_by_the_content_verify(tiny_llama):
    """The first layer's cache write lands zeros from forward 12 on (past the 8 forwards that check
    every layer), with the default time budget, under which the tiny model's canary checks one of its
    two layers' writes a forward: forwards that check the first layer report WRITE_CONTENT at the
    write; in the others its new tokens' fingerprints are folded from the rows it computed, so the
    next forward's content verify (every read byte here) finds the zeros as CONTENT. The model runs
    compiled by torch.compile (vLLM's default; the other runs here are eager), so the patched
    attention, the write check and the fold are shown to run inside a compiled model too."""
    run = engine(tiny_llama, canary=True, fault="kernel_write_zeros", fault_at=12, eager=False,
                 env={"KVCANARY_CONTENT_BUDGET_BYTES": "none", "KVCANARY_MODE": "log"})
    st = run["stats"]
    assert run["compilation"] not in ("NONE", "unknown"), run["compilation"]  # vLLM did compile the model
    assert st["internal_errors"] == 0 and st["write_slots_unchecked"] > 0, st
    checks = {c for v in run["violations"] for c in v["checks"]}
    assert {"WRITE_CONTENT", "CONTENT"} <= checks, checks
    at = run["fault"]["step"]
    assert at >= 12 and all(v["step"] >= at for v in run["violations"]), (at, run["violations"][:3])


def test_steps_built_on_the_device_read_nothing_back_verify_clean_and_find_a_flipped_byte(tiny_llama, plain):
    """KVCANARY_DEVICE_STEPS=1: the GPU path on vLLM's CPU engine. Every forward's steps are built
    from the attention metadata with device ops (kvcanary.engines.vllm.device_steps) while the
    connector's before-forward runs under the host-sync guard (a device value read back by the
    engine adapters' code raises, which raise mode turns into a failed run): the run verifies clean
    with the plain run's tokens; a flipped cached byte is found in the forward it lands in."""
    env = {"KVCANARY_DEVICE_STEPS": "1", "KVCANARY_MODE": "raise"}
    run = engine(tiny_llama, canary=True, host_sync_guard=True, env=env)
    st = run["stats"]
    assert run["violations"] == [] and st["internal_errors"] == 0
    assert st["device_forwards"] == st["forwards"] > 0 and st["slots_verified"] > 0
    assert sorted(run["tokens"].values()) == sorted(plain["tokens"].values())
    hit = engine(tiny_llama, canary=True, host_sync_guard=True, fault="flip_v", env={**env, "KVCANARY_MODE": "log"})
    at = hit["fault"]["step"]
    found = [v for v in hit["violations"] if "CONTENT" in v["checks"]]
    assert found and found[0]["step"] == at and hit["stats"]["internal_errors"] == 0, hit["violations"][:3]
    assert not [v for v in hit["violations"] if v["step"] < at]


def test_the_canarys_own_failures_never_reach_the_engine_in_log_mode(tiny_llama, plain):
    """From the third forward on, the per-layer checks and the position check raise inside the worker:
    the engine generates what it generates without the canary, the failures are counted, nothing is
    reported."""
    base = plain
    run = engine(tiny_llama, canary=True, fault="canary_fails")
    st = run["stats"]
    assert run["fault"]["failing"]
    assert sorted(run["tokens"].values()) == sorted(base["tokens"].values())
    assert st["internal_errors"] > 0 and run["violations"] == []


def test_metadata_only_checks_every_forward_with_the_audit_on(tiny_llama):
    """KVCANARY_CONTENT=none (no content fingerprints): every forward is verified, stamped and
    audited without an internal error (the write check's token budget comes from the engine's own
    cache rows, not from a content layout, which this mode has none of)."""
    run = engine(tiny_llama, canary=True, env={"KVCANARY_CONTENT": "none", "KVCANARY_AUDIT_EVERY": "1"})
    st = run["stats"]
    assert run["violations"] == [] and st["internal_errors"] == 0
    assert st["forwards"] > 0 and st["slots_verified"] > 0 and st["slots_stamped"] > 0
    assert st["content_bytes_verified"] == 0 and st["write_slots_checked"] > 0 and st["audit_queries"] > 0


# The injected faults (kvcanary.faults.vllm) run once each in test_selftest.py, through the selftest:
# detected in time by the right checks, with the request they hurt and the slot they hit.


def test_multiprocess_engine_through_the_flag_alone_logs_to_the_jsonl_file(tiny_llama, tmp_path):
    from kvcanary import eventlog

    base = engine(tiny_llama, max_seqs=4)
    prom = tmp_path / "prom"
    prom.mkdir()
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "KVCANARY_VIOLATIONS_LOG": str(tmp_path / "clean.jsonl"),
           "KVCANARY_METRICS": "1", "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    clean = engine(tiny_llama, canary=True, max_seqs=4, env=env)
    assert not os.path.exists(tmp_path / "clean.jsonl")  # no event: nothing was written
    assert sorted(clean["tokens"].values()) == sorted(base["tokens"].values())
    # the worker process's metrics, collected from the multiprocess directory as vLLM's server does
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from prometheus_client.parser import text_string_to_metric_families

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(prom))
    got = {(s.name, s.labels.get("engine"), s.labels.get("tp_rank")): s.value
           for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}
    assert got.get(("kvcanary_slots_verified_total", "vllm", "0"), 0) > 0
    assert got.get(("kvcanary_slots_stamped_total", "vllm", "0"), 0) > 0
    assert got.get(("kvcanary_violations_total", "vllm", "0"), 0) == 0
    env = {**env, "KVCANARY_VIOLATIONS_LOG": str(tmp_path / "fault.jsonl"), "KVCANARY_TEST_FAULT": "flip_v",
           "PYTHONPATH": os.path.join(HERE, "fault_plugin")}
    engine(tiny_llama, canary=True, max_seqs=4, env=env)
    events = eventlog.read(str(tmp_path / "fault.jsonl"))
    assert events and all(e["engine"] == "vllm" for e in events)
    # a read names its reader; the patrol scrub, which reads no request's table, may find the flip first
    assert all(e["request"] for e in events if e["site"] == "verify") and any(e["site"] == "verify" for e in events)
    assert {"CONTENT"} <= {c for e in events for c in e["checks"]} and events[0]["pid"] != os.getpid()


def test_tensor_parallel_2_gives_each_rank_its_own_canary(tiny_llama, tmp_path):
    from kvcanary import eventlog

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "KVCANARY_VIOLATIONS_LOG": str(tmp_path / "tp.jsonl"), "KVCANARY_TEST_FAULT": "flip_v",
           "PYTHONPATH": os.path.join(HERE, "fault_plugin")}
    run = engine(tiny_llama, canary=True, max_seqs=4, tensor_parallel=2, env=env)
    assert run["tokens"]
    events = eventlog.read(str(tmp_path / "tp.jsonl"))
    # each rank holds half the KV heads and injects its own flip: both ranks' canaries report
    assert {e["rank"] for e in events} == {0, 1} and len({e["pid"] for e in events}) == 2


def test_aborted_requests_leave_nothing_that_reads_wrong(tiny_llama):
    run = engine(tiny_llama, canary=True, abort=3, num_blocks=16, max_model_len=256)
    st = run["stats"]
    assert run["violations"] == [] and st["internal_errors"] == 0 and st["slots_verified"] > 0
    assert 0 < len(run["tokens"]) < 12  # the aborted requests never finished
