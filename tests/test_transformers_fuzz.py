"""Clean fuzz of transformers continuous batching under the canary in raise mode: a fixed list of
crossed configurations (every architecture, every engine feature) gives zero violations, zero
internal errors, no failed request, no exception and the same tokens as without the canary; each
configuration proves it exercised what it names (forks copied blocks, requests were offloaded and
restored, soft reset, served from a warm prefix cache, prefilled in chunks). One crossing runs on the
trained model (SmolLM2-135M-Instruct in bfloat16, real text prompts). The long randomized run is
bench/transformers_fuzz.py."""

import logging
import random

import pytest

from kvcanary.engines.transformers.models import ARCHS, full_layers, tiny_arch
from kvcanary.faults.cb_soak import (CANARY, MEMORY, MODELS, REAL, CbConfig, count_events, cpu_offload_shim,
                                     draw_configs, failure, prompts, random_cb_config, run_cb_config, session, tokens)


def C(seed, arch, **kw):
    return CbConfig(seed=seed, arch=arch, **kw)


# (configuration, the engine events it must show). At 69ce319, before 8e988de, three of them failed:
# llama-warm-offload-chunked (verify EMPTY on the warm prefix cache's blocks), gemma2-forks-tight-chunked
# and gemma3-forks-offload-unshared-chunk24 (transfer CONTENT on fork copies), each with the raise-mode
# error left in the requests' error strings instead of raised to the caller
CI = [
    pytest.param(C(7003, "llama", layers=4, requests=7, prefix=24, prefixes=1, max_new_tokens=6, memory="offload",
                   warm=True, page_size=16, max_batch_tokens=48),
                 {"offloaded", "restored", "prefix_hit_tokens", "prefill_chunks"}, id="llama-warm-offload-chunked"),
    pytest.param(C(100, "gemma2", requests=10, prefix=24, max_new_tokens=9, forks=2, sample=True, memory="tight",
                   max_batch_tokens=48),
                 {"forks", "copied_blocks", "soft_resets", "prefill_chunks"}, id="gemma2-forks-tight-chunked"),
    pytest.param(C(107, "gpt_oss", requests=12, prefix=40, max_new_tokens=12, forks=2, sample=True, memory="tight",
                   max_batch_tokens=48),
                 {"forks", "copied_blocks", "soft_resets", "prefill_chunks"}, id="gpt_oss-forks-tight-chunked"),
    pytest.param(C(7018, "qwen2", requests=10, prefix=16, prefixes=1, max_new_tokens=20, memory="offload", warm=True,
                   page_size=4, max_batch_tokens=48),
                 {"offloaded", "restored", "prefill_chunks"}, id="qwen2-warm-offload-page4"),
    pytest.param(C(7008, "cohere2", requests=9, prefix=16, max_new_tokens=7, forks=2, sample=True, memory="tight",
                   warm=True),
                 {"forks", "copied_blocks", "soft_resets"}, id="cohere2-forks-tight-warm"),
    pytest.param(C(5, "gemma3", layers=4, requests=10, prefix=40, max_new_tokens=16, memory="tight", page_size=16,
                   canary="default"),
                 {"soft_resets"}, id="gemma3-L4-tight-page16-default-canary"),
    pytest.param(C(7010, "gemma3", requests=8, prefix=0, max_new_tokens=8, forks=3, sample=True, memory="offload",
                   max_batch_tokens=24),
                 {"forks", "copied_blocks", "prefill_chunks"}, id="gemma3-forks-offload-unshared-chunk24"),
    pytest.param(C(7023, "mistral", requests=6, prefix=16, prefixes=1, max_new_tokens=6, forks=3, sample=True,
                   warm=True, max_batch_tokens=24),
                 {"forks", "copied_blocks", "prefill_chunks"}, id="mistral-forks-warm-chunk24"),
    pytest.param(C(7029, "llama", requests=11, prefix=16, prefixes=2, max_new_tokens=7, forks=2, sample=True,
                   memory="tight", page_size=4, canary="default"),
                 {"forks", "copied_blocks", "soft_resets", "cache_evictions", "prefix_hit_tokens"},
                 id="llama-forks-tight-prefix-page4-default-canary"),
    pytest.param(C(7027, "gemma2", layers=4, requests=8, prefix=0, max_new_tokens=14, sample=True, memory="offload",
                   page_size=8),
                 {"offloaded", "restored"}, id="gemma2-L4-sampled-offload"),
]


@pytest.fixture(autouse=True)
def _quiet_canary():
    logging.getLogger("kvcanary").setLevel(logging.ERROR)


@pytest.mark.parametrize("cfg,exercised", CI)
def test_crossed_configuration_is_clean(cfg, exercised):
    res = run_cb_config(cfg)
    assert res["exception"] is None, failure(res)
    assert res["violations"] == 0, res["first_violations"]
    assert res["internal_errors"] == 0 and res["baseline_errors"] == 0, failure(res)
    assert res["request_errors"] == 0 and res["missing_requests"] == 0, res["first_request_error"]
    assert res["outputs_identical"] is True, failure(res)
    assert res["slots_verified"] > 0 and res["slots_stamped"] > 0 and res["content_bytes"] > 0
    missing = {e for e in exercised if res["events"][e] == 0}
    assert not missing, f"{cfg.label()} did not exercise {sorted(missing)}: {res['events']}"
    if exercised & {"copied_blocks", "restored"}:
        assert res["slots_scrubbed"] > 0  # fork copies and restored blocks were verified where they landed
    if cfg.canary == "default":  # the time budget's cadence ran: forwards with queries and forwards without
        assert res["audit_queries"] > 0 and res["audit_forwards_without_queries"] > 0, res


def test_the_trained_model_crossing_is_clean(monkeypatch):
    # trained attention (sharp, sink-heavy logits over real text) through 30 layers in bfloat16: the
    # read audit on every forward, every read byte verified, a warm manager, a tight pool whose
    # victims go to the CPU tier and come back (their blocks verified where they land), prefix-cache
    # evictions and hits, chunked prefill
    from test_real_model import converted_cache

    monkeypatch.setenv("KVCANARY_CACHE_DIR", converted_cache())
    cfg = C(1, REAL, requests=8, prefix=24, prefixes=2, max_new_tokens=8, memory="offload", warm=True,
            max_batch_tokens=48)
    assert cfg.layers == 30 and cfg.model_dtype == "bfloat16" and "smollm2 bf16 L30" in cfg.label()
    res = run_cb_config(cfg)
    assert res["ok"], failure(res)
    assert res["outputs_identical"] is True and res["content_bytes"] > 0 and res["slots_scrubbed"] > 0
    missing = {e for e in ("offloaded", "restored", "cache_evictions", "prefix_hit_tokens", "prefill_chunks")
               if res["events"][e] == 0}
    assert not missing, res["events"]


def test_ci_list_covers_every_architecture_and_feature_crossed():
    cfgs = [p.values[0] for p in CI]
    assert {c.arch for c in cfgs} == set(ARCHS)
    assert {c.memory for c in cfgs} == set(MEMORY)
    hybrid = [c for c in cfgs if 0 < full_layers(c.arch, c.layers) < c.layers]
    assert any(c.forks == 3 for c in cfgs) and any(c.forks > 1 and c.memory == "tight" for c in hybrid)
    assert any(c.warm and c.memory == "offload" for c in cfgs) and any(c.warm and c.forks > 1 for c in cfgs)
    assert any(c.memory == "tight" and c.arch.startswith("gemma") for c in cfgs)
    assert any(c.sample and c.forks == 1 for c in cfgs) and any(not c.sample for c in cfgs)
    assert any(c.prefix == 0 for c in cfgs) and any(c.prefixes > 1 for c in cfgs)
    assert {c.page_size for c in cfgs} >= {4, 8, 16} and {c.layers for c in cfgs} == {2, 4}
    assert any(c.max_batch_tokens < 32 for c in cfgs)
    assert {c.canary for c in cfgs} == set(CANARY)


def test_sampling_with_forks_reproduces_under_cb_so_sampled_runs_are_compared():
    # CB seeds torch's global generator from ContinuousBatchingConfig.seed when it builds the batch
    # processor, and a persistent manager's second session continues that stream: the same seed gives
    # the same tokens (forks included), while the sampling is real: the children of a parent diverge
    cfg = C(11, "qwen2", requests=5, prefix=16, max_new_tokens=10, forks=3, sample=True, warm=True)
    model = tiny_arch(cfg.arch, seed=cfg.seed)
    first, again = tokens(session(model, cfg).out), tokens(session(model, cfg).out)
    assert len(first) == cfg.requests * cfg.forks and first == again
    parents = [k for k in first if "__child#" not in k]
    assert all(first[p] != first[f"{p}__child#0"] for p in parents)


def test_a_clean_harness_still_sees_an_injected_fault():
    # the harness reads violations, exceptions and request errors: a real corruption fails it
    from kvcanary.faults.transformers_cb import CbFault

    fault = CbFault("flip_shared_byte", at=2, seed=1)
    res = run_cb_config(C(3, "llama", requests=10, prefix=24, max_new_tokens=8), hooks=[fault])
    assert fault.injected_at is not None
    assert not res["ok"] and res["violations"] > 0 and "CONTENT" in res["first_violations"][0]
    assert res["exception"] is not None or res["request_errors"] > 0
    assert "violation" in failure(res)


def test_random_configurations_are_seeded_and_cover_the_space():
    assert draw_configs(5, seed=3) == draw_configs(5, seed=3)
    cfgs = [random_cb_config(random.Random(k)) for k in range(300)]
    assert {c.arch for c in cfgs} == set(MODELS) == set(ARCHS) | {REAL} and {c.memory for c in cfgs} == set(MEMORY)
    real = [c for c in cfgs if c.arch == REAL]
    assert all(c.layers == 30 for c in real) and {c.model_dtype for c in real} == {"bfloat16", "float32"}
    # the tiny models alone draw what they drew before the real model joined (earlier seeds rerun)
    assert [c.label() for c in draw_configs(2, seed=4, models=sorted(ARCHS))] == [
        "seed=4000 gemma3 L2 page=8 sample tight prefix=40x1 default-canary",
        "seed=4001 llama L4 page=8 sample prefix=24x1 chunk=48 default-canary"]
    assert {c.canary for c in cfgs} == set(CANARY)
    with pytest.raises(ValueError, match="canary: expected one of"):
        C(1, "llama", canary="fast")
    assert {c.forks for c in cfgs} == {1, 2, 3} and all(c.sample for c in cfgs if c.forks > 1)
    assert any(c.warm for c in cfgs) and any(c.max_batch_tokens < 32 for c in cfgs)
    warm, measured = prompts(cfgs[0])
    assert len(measured) == cfgs[0].requests and warm[: len(warm) // 2] == measured[: len(warm) // 2]
    with pytest.raises(ValueError, match="expected sample=True with forks > 1"):
        C(1, "llama", forks=2)


def test_event_counters_and_offload_shim_leave_the_engine_as_they_found_it():
    from transformers.generation.continuous_batching import offloading_manager
    from transformers.generation.continuous_batching.requests import RequestState

    fork, torch_module = RequestState.fork, offloading_manager.torch
    with count_events() as ev, cpu_offload_shim():
        assert RequestState.fork is not fork and set(ev) >= {"forks", "offloaded", "prefill_chunks"}
    assert RequestState.fork is fork and offloading_manager.torch is torch_module
