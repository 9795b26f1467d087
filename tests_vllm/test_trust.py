"""vLLM's own features verify clean, and turning the canary on leaves the engine as it was.

- ngram speculative decoding: the drafts a forward writes are stamped with their real token ids,
  rejected drafts roll back, accepted ones verify as the committed tokens (before read windows and
  drafts, every such run reported hundreds of TOKEN violations);
- a sliding window on every layer: vLLM frees the blocks below the window and hands them out again
  while the worker's table keeps their stale ids; the canary reads what the kernel reads (before,
  a single greedy request reported POSITION|LINK|TOKEN on over a thousand slots);
- models mixing sliding and full layers keep vLLM's hybrid KV cache manager: the same KV cache
  groups and the same blocks with the canary as without it, each group with its own canary.

Every run is in raise mode: a single violation stops the engine and fails the run.
"""

import pytest

from kvcanary.faults import vllm_models
from kvcanary.faults.vllm_runner import run_in_subprocess

RAISE = {"KVCANARY_MODE": "raise", "KVCANARY_CONTENT_BUDGET_BYTES": "none"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return lambda arch: vllm_models.save(str(root / arch), arch) if not (root / arch).exists() else str(root / arch)


def test_ngram_speculative_decoding_verifies_clean(models):
    run = run_in_subprocess({"model": models("llama"), "canary": True, "spec": 3, "prompts": "repetitive",
                             "requests": 1, "max_tokens": 64}, RAISE)
    ev, st = run["events"], run["stats"]
    assert run["violations"] == [] and st["internal_errors"] == 0 and st["slots_verified"] > 0
    # drafts were written, some accepted (verified since as committed tokens), some rejected
    assert ev["drafts"] > ev["drafts_accepted"] > 0, ev


def test_a_sliding_window_on_every_layer_verifies_clean(models):
    run = run_in_subprocess({"model": models("mistral"), "canary": True, "requests": 1, "max_tokens": 256,
                             "max_batched": 64, "prefix": 40}, RAISE)
    ev, st = run["events"], run["stats"]
    assert run["violations"] == [] and st["internal_errors"] == 0 and st["slots_verified"] > 0
    assert ev["window_freed_blocks"] > 0 and ev["window_reused_blocks"] > 0, ev  # freed and handed out again


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_hybrid_models_keep_their_kv_cache_groups_and_blocks(models, arch):
    cfg = {"model": models(arch), "num_blocks": None, "requests": 6, "max_tokens": 80, "max_batched": 64,
           "prefix": 40, "max_seqs": 4}
    base = run_in_subprocess(cfg)
    run = run_in_subprocess({**cfg, "canary": True}, RAISE)
    kinds = [g["spec"] for g in base["kv_cache"]["groups"]]
    assert kinds == ["SlidingWindowSpec", "FullAttentionSpec"]  # the hybrid manager's two groups
    assert run["kv_cache"] == base["kv_cache"]  # same groups, layers, block sizes and pool
    st = run["stats"]
    assert st["kv_cache_groups"] == st["kv_cache_groups_covered"] == 2
    assert run["violations"] == [] and st["internal_errors"] == 0 and st["slots_verified"] > 0
    assert run["events"]["window_freed_blocks"] > 0
    assert sorted(run["tokens"].values()) == sorted(base["tokens"].values())


def test_a_recurrent_state_group_starts_uncovered_and_changes_nothing(models):
    """Qwen3-Next's gated-delta-net layers keep recurrent state (a Mamba-kind KV cache group), which
    is not per-token KV: the engine starts with the canary, that group is reported as not covered,
    the attention group is verified, and the KV cache, the pool and the tokens are as without it."""
    cfg = {"model": models("qwen3_next"), "num_blocks": None, "dtype": "bfloat16", "requests": 4, "max_tokens": 24,
           "max_batched": 64}
    base = run_in_subprocess(cfg)
    run = run_in_subprocess({**cfg, "canary": True}, RAISE)
    assert [g["spec"] for g in base["kv_cache"]["groups"]] == ["MambaSpec", "FullAttentionSpec"]
    assert run["kv_cache"] == base["kv_cache"]
    st = run["stats"]
    assert (st["kv_cache_groups"], st["kv_cache_groups_covered"]) == (2, 1)
    assert run["violations"] == [] and st["internal_errors"] == 0 and st["slots_verified"] > 0
    assert sorted(run["tokens"].values()) == sorted(base["tokens"].values())
