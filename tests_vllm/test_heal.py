"""Healing on vLLM: in ``repair`` mode the requests that read corrupted KV are computed again from
their first bad block and finish as a clean run; in ``quarantine`` mode they fail with an error;
every other request finishes as in a clean run, and poisoned blocks are not served again.

Each run is one engine process with one fault of kvcanary.faults.vllm injected, every read byte
verified; the clean run is the same engine without the canary.
"""

import pytest

from kvcanary.faults.vllm_runner import run_in_subprocess

EVERY_BYTE = {"KVCANARY_CONTENT_BUDGET_BYTES": "none"}


def healed(model, mode, fault, env=None, model_cfg=None):
    policy = {"repair": "recompute", "quarantine": "fail"}[mode]
    kvc = {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
           "kv_connector_extra_config": {"mode": mode}}
    return run_in_subprocess({"model": model, "max_seqs": 4, "canary": True, "fault": fault, "kv_transfer_config": kvc,
                              **(model_cfg or {})}, {**EVERY_BYTE, **(env or {})})


@pytest.fixture(scope="module")
def clean(tiny_llama):
    return run_in_subprocess({"model": tiny_llama, "max_seqs": 4})


def same_as_clean(run, clean, except_=()):
    """Every request outside ``except_`` finished with the clean run's tokens."""
    keep = [k for k in clean["tokens"] if k not in except_]
    assert keep and all(run["tokens"][k] == clean["tokens"][k] for k in keep), \
        [k for k in keep if run["tokens"][k] != clean["tokens"][k]]


def short(rid):
    return rid.split("-")[0]  # vLLM's offline requests are "<index>-<random suffix>" inside the engine


@pytest.mark.parametrize("device", [False, True], ids=["host_steps", "device_steps"])
def test_repair_recomputes_the_readers_of_a_flipped_shared_block(tiny_llama, clean, device):
    """Also with the steps built on the device (the GPU path, its before-forward under the host-sync
    guard): healing takes the same path once the rows are read back after the forward."""
    if device:
        run = healed(tiny_llama, "repair", "flip_v", {"KVCANARY_DEVICE_STEPS": "1"}, {"host_sync_guard": True})
        assert run["stats"]["device_forwards"] == run["stats"]["forwards"] > 0
        assert run["stats"]["internal_errors"] == 0
    else:
        run = healed(tiny_llama, "repair", "flip_v")
    st = run["stats"]
    assert run["violations"] and st["repairs"] >= 2 and st["requests_failed"] == 0
    assert st["harmful_tokens"] == 0  # every read byte verified: found before any forward sampled from it
    assert set(run["finish"].values()) == {"length"}
    same_as_clean(run, clean)  # the readers included: their output is a clean run's


def test_quarantine_fails_the_readers_of_a_flipped_shared_block(tiny_llama, clean):
    run = healed(tiny_llama, "quarantine", "flip_v")
    readers = {short(r) for r in run["fault"]["readers"]}
    failed = {k for k, v in run["finish"].items() if v == "error"}
    assert failed == readers and run["stats"]["requests_failed"] >= 1
    same_as_clean(run, clean, except_=failed)


def test_repair_fails_a_request_whose_table_stays_wrong_after_the_limit(tiny_llama, clean):
    """A redirected table entry that stays wrong is not fixed by recomputing: the request is
    repaired twice (the default limit), then fails with the evidence; the rest finish cleanly."""
    run = healed(tiny_llama, "repair", "redirect_stuck")
    victim = short(run["fault"]["request"])
    assert run["finish"][victim] == "error" and run["stats"]["requests_failed"] == 1
    same_as_clean(run, clean, except_={victim})


def test_a_cold_block_the_patrol_finds_corrupted_never_serves_a_prefix_hit(tiny_llama, clean):
    """A cached block no request holds is corrupted; the patrol scrub finds it and it is evicted from
    the prefix cache, so the requests that come later with its prefix compute it afresh: no read of
    the block is ever reported, and every output is a clean run's."""
    run = healed(tiny_llama, "repair", "flip_cold", env={"KVCANARY_PATROL_BUDGET_BYTES": str(1 << 30)})
    block = run["fault"]["block"]
    found = run["violations"]
    assert found and {v["site"] for v in found} == {"scrub"} and run["stats"]["blocks_evicted"] == 1
    assert all(v["slot"] // 32 == block for v in found)
    same_as_clean(run, clean)


def test_repair_heals_the_readers_of_a_block_reused_while_still_read(tiny_llama, clean):
    """A block two requests still read is handed to a third, which writes its own KV into it: the
    readers are computed again and finish cleanly; the writer, whose worker table now holds the
    foreign block for good, is repaired or failed, never finished from bad KV."""
    run = healed(tiny_llama, "repair", "reuse")
    readers = {short(r) for r in run["fault"]["readers"]}
    failed = {k for k, v in run["finish"].items() if v == "error"}
    same_as_clean(run, clean, except_=failed)
    assert readers - failed and run["stats"]["repairs"] >= 1


def test_a_mode_and_a_policy_that_contradict_are_refused_at_start(tiny_llama):
    kvc = {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"mode": "repair"}}
    with pytest.raises(RuntimeError, match="mode 'repair' needs kv_load_failure_policy 'recompute'"):
        run_in_subprocess({"model": tiny_llama, "canary": True, "kv_transfer_config": kvc, "requests": 1})


def test_several_kv_cache_groups_fail_the_readers_by_request(tmp_path):
    """Gemma3 runs sliding-window and full KV cache groups, where vLLM takes no bad block ids: the
    readers of a flipped block fail by request instead (repair cannot recompute them), the block
    leaves the prefix cache, and every other request finishes as in a clean run."""
    from kvcanary.faults import vllm_models

    model = vllm_models.save(str(tmp_path / "gemma3"), "gemma3")
    clean = run_in_subprocess({"model": model, "max_seqs": 4})
    run = healed(model, "quarantine", "flip_v")
    readers = {short(r) for r in run["fault"]["readers"]}
    failed = {k for k, v in run["finish"].items() if v == "error"}
    assert failed and failed <= readers and run["stats"]["blocks_evicted"] >= 1
    same_as_clean(run, clean, except_=failed)
