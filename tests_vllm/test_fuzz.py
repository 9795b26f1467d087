"""A few fixed crossings of the randomized vLLM clean fuzz (bench/vllm_fuzz.py runs the long draw):
each runs without the canary (twice where vLLM is not deterministic) and with it in raise mode, and
must show zero violations, zero internal errors, the same KV cache groups and blocks, the same
greedy tokens where vLLM is deterministic, and the engine events it claims. One crossing runs the
model compiled (vLLM's default), the others eager. One crossing runs on the
trained model (SmolLM2-135M-Instruct in bf16, real text prompts; converted once by the checkout's
.venv interpreter, or KVCANARY_REAL_PYTHON's, where kvcanary's cache does not hold it yet)."""

import pytest

from kvcanary.faults.vllm_fuzz import REAL, FuzzConfig, pool_for_preemption, run_config

CROSSINGS = [
    # sliding + full groups, bf16, vec16 kernels, a prefix off the block boundary, chunked prefill,
    # a pool that preempts, ngram drafts, and the model compiled by torch.compile (vLLM's default; the
    # other crossings run --enforce-eager, whose engines start faster)
    FuzzConfig(arch="gemma2", dtype="bfloat16", head_dim=80, block_size=64, prefix=80, max_batched=48,
               num_blocks=pool_for_preemption("gemma2", 64, 256), requests=8, max_seqs=8, max_tokens=96, spec=3,
               compiled=True, seed=11),
    # full attention, block size 128, parallel sampling, aborts, every read byte verified, no prefix cache
    FuzzConfig(arch="qwen3", head_dim=112, block_size=128, prefix=128, prefix_caching=False, n=2, abort=4,
               requests=8, max_tokens=48, every_byte=True, seed=12),
    # the trained model: 30 layers of trained attention over real text in bf16, a prefix off the block
    # boundary, chunked prefill, every read byte verified, the read audit on every forward
    FuzzConfig(arch=REAL, dtype="bfloat16", head_dim=64, block_size=32, prefix=48, max_batched=48, requests=8,
               max_tokens=32, every_byte=True, audit=64, seed=21),
    # the GPU path's steps (built on the device, nothing read back before the forward, under the
    # host-sync guard): sliding + full groups, ngram drafts rolled back, chunked prefill, a pool that
    # preempts
    FuzzConfig(arch="gpt_oss", block_size=32, prefix=40, max_batched=48, num_blocks=pool_for_preemption("gpt_oss", 32, 256),
               requests=8, max_seqs=8, max_tokens=96, spec=3, device_steps=True, seed=13),
]
# (tensor parallel 2 runs in test_vllm.py with a fault in each rank, and across the features in the long
# draw of bench/vllm_fuzz.py: its three engine starts of two workers each would double this file's time)


@pytest.mark.parametrize("cfg", CROSSINGS, ids=[c.name for c in CROSSINGS])
def test_fixed_crossing_verifies_clean_and_changes_nothing(cfg, tmp_path):
    res = run_config(cfg, str(tmp_path))
    assert res["ok"], res["failures"]
    assert res["slots_verified"] > 0 and res["forwards"] > 0
    if cfg.audit:  # every forward audited: the trained model's attention outputs checked against the cache
        assert res["audit_queries"] >= cfg.audit * res["forwards"] // 2, res
