"""Run a tiny vLLM CPU engine once, optionally under the canary and with one fault injected in the
worker, and print one JSON line: every request's tokens, the canary's stats and violations.

    python engine_run.py '{"model": DIR, "canary": true, "fault": "flip_v", "num_blocks": 24, ...}'

A process per run: vLLM keeps per-process globals (the KV connector agent) that a second engine in
the same process would inherit.
"""

import json
import os
import random
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def prompts(n, seed, prefix=64):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(512) for _ in range(prefix)] for _ in range(3)]
    return [rng.choice(prefixes) + [rng.randrange(512) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def main():
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcanary.faults import vllm as faults_vllm

    kvc = None
    if cfg.get("canary"):
        kvc = cfg.get("kv_transfer_config") or {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both"}
    from vllm.v1.core.sched import scheduler

    preempted = [0]
    orig = scheduler.Scheduler._preempt_request

    def count(self, *a, **k):
        preempted[0] += 1
        return orig(self, *a, **k)

    scheduler.Scheduler._preempt_request = count  # in-process engines only: the test's own count
    fault = faults_vllm.install(cfg["fault"], cfg.get("fault_at", 3)) if cfg.get("fault") else None
    llm = LLM(model=cfg["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=cfg.get("dtype", "float32"),
              block_size=32, enable_prefix_caching=True, num_gpu_blocks_override=cfg.get("num_blocks", 64),
              max_num_batched_tokens=cfg.get("max_batched", 2048), max_num_seqs=cfg.get("max_seqs", 16),
              max_model_len=cfg.get("max_model_len", 512), kv_transfer_config=kvc, seed=0)
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(cfg.get("requests", 12), cfg.get("seed", 0))]
    sp = SamplingParams(max_tokens=cfg.get("max_tokens", 16), temperature=0, ignore_eos=True)
    outs = llm.generate(ps, sp, use_tqdm=False)
    out = {"tokens": {o.request_id: list(o.outputs[0].token_ids) for o in outs}, "preemptions": preempted[0]}
    if kvc is not None:
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        conn = get_kv_transfer_group()
        canary = next(c for c in getattr(conn, "_connectors", [conn]) if hasattr(c, "violations"))
        out["stats"] = canary.stats()
        out["violations"] = [v.to_dict() for v in canary.violations[:200]]
    if fault is not None:
        out["fault"] = fault.detail
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
