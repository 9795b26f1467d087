"""Randomized clean fuzz of vLLM's CPU build under the canary in raise mode (kvcanary.faults.vllm_fuzz).

Each configuration crosses a model (tiny random-weight Llama, Qwen3, Mistral with a window on every
layer, Gemma2, Gemma3 and GPT-OSS with sliding and full KV cache groups, or the trained
SmolLM2-135M-Instruct, ``smollm2``, prompted with real text), fp32 or bf16, a head size (80
and 112 select the vec16 kernels), block size 32/64/128, prefix caching with shared prefixes on and
off block boundaries, chunked prefill, a pool small enough to preempt, parallel sampling, ngram
speculative decoding, tensor parallel 2, aborts, max_tokens 1, every read byte verified in part of
them, in about 30 % the steps built on the device as on a GPU (``device_steps``; the
connector's before-forward under the host-sync guard where the engine runs in-process), and in about
20 % vLLM's default model execution, the model compiled by torch.compile (``compiled``; the others run
``--enforce-eager``, whose engines start faster). Each runs without the canary (twice where vLLM itself is not deterministic) and with it.
A clean engine must give zero violations, zero internal errors, the same KV cache groups and
blocks, the same greedy tokens where vLLM is deterministic, and the events the configuration claims.

Progress per configuration on stderr; one JSON line per configuration and a final JSON summary on
stdout. Exit status 1 when any configuration failed. Run it in .venv-vllm (scripts/setup-vllm):

    .venv-vllm/bin/python bench/vllm_fuzz.py [--configs 150] [--seed 1] [--out results.jsonl]
    .venv-vllm/bin/python bench/vllm_fuzz.py --seed 1 --only 7      # rerun the 8th configuration
    .venv-vllm/bin/python bench/vllm_fuzz.py --config '{"arch": "gemma3", "spec": 3}'
    .venv-vllm/bin/python bench/vllm_fuzz.py --archs smollm2 --configs 8   # the trained model only
    .venv-vllm/bin/python bench/vllm_fuzz.py --device-steps --configs 8    # the GPU path's steps, on a CPU

The trained model is converted once by an interpreter with kvcanary's ``real`` extra (vLLM's
environment has no ``gguf``): ``KVCANARY_REAL_PYTHON``, else the checkout's ``.venv/bin/python``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from typing import Any

from kvcanary.faults.vllm_fuzz import ARCHS, FuzzConfig, draw, run_config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=150)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", type=int, help="run only the configuration of this index in the seed's draw")
    ap.add_argument("--config", help="run one configuration given as the JSON of FuzzConfig's fields")
    ap.add_argument("--out", help="also append each configuration's JSON line to this file")
    ap.add_argument("--archs", default=",".join(ARCHS),
                    help=f"comma-separated models to draw from (default all: {','.join(ARCHS)})")
    ap.add_argument("--device-steps", action="store_true",
                    help="every configuration's steps built on the device (the GPU path; drawn in 30 %% otherwise)")
    args = ap.parse_args()
    archs = tuple(args.archs.split(","))
    if set(archs) - set(ARCHS):
        ap.error(f"--archs: expected names of {list(ARCHS)}, got {sorted(set(archs) - set(ARCHS))}")
    rng = random.Random(args.seed)
    drawn = [draw(rng, args.seed * 1000 + i, archs)
             for i in range(args.configs if args.only is None else args.only + 1)]
    configs = drawn[args.only:] if args.only is not None else drawn
    if args.device_steps:
        configs = [dataclasses.replace(c, device_steps=True) for c in configs]
    if args.config is not None:
        configs = [FuzzConfig(**json.loads(args.config))]
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcanary-vllm-fuzz-") as models:
        for i, cfg in enumerate(configs):
            print(f"[{i + 1}/{len(configs)}] {cfg.name} ({time.perf_counter() - t0:.0f} s so far) ...", file=sys.stderr,
                  flush=True)
            res = run_config(cfg, models)
            results.append(res)
            line = json.dumps(res)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as fh:
                    fh.write(line + "\n")
            print(f"    {'ok' if res['ok'] else 'FAIL ' + '; '.join(res['failures'])}: {res['forwards']} forwards, "
                  f"{res['slots_verified']} slots verified, drafts {res['drafts_accepted']} accepted / "
                  f"{res['drafts_rejected']} rejected, {res['preemptions']} preemptions, "
                  f"{res['window_freed_blocks']} blocks freed by a window", file=sys.stderr, flush=True)
    print(json.dumps(summary(results, time.perf_counter() - t0)))
    return 0 if all(r["ok"] for r in results) else 1


def summary(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Totals over every configuration, and how many crossed each feature."""
    keys = ("forwards", "slots_verified", "content_slots_verified", "drafts", "drafts_accepted", "drafts_rejected",
            "preemptions", "window_freed_blocks", "window_reused_blocks", "violations", "internal_errors", "audit_queries")
    cfgs = [r["cfg"] for r in results]
    return {
        "configs": len(results), "failed": sum(not r["ok"] for r in results), "wall_s": round(wall),
        **{k: sum(r[k] for r in results) for k in keys},
        "false_positives": sum(r["violations"] for r in results),
        "crossed": {
            "archs": sorted({c["arch"] for c in cfgs}),
            "several_kv_cache_groups": sum(r["groups"] > 1 for r in results),
            "ngram": sum(bool(c["spec"]) for c in cfgs), "tp2": sum(c["tensor_parallel"] > 1 for c in cfgs),
            "parallel_sampling": sum(c["n"] > 1 for c in cfgs), "aborts": sum(bool(c["abort"]) for c in cfgs),
            "tight_pool": sum(bool(c["num_blocks"]) for c in cfgs), "bf16": sum(c["dtype"] == "bfloat16" for c in cfgs),
            "chunked_prefill": sum(c["max_batched"] < 2048 for c in cfgs),
            "no_prefix_caching": sum(not c["prefix_caching"] for c in cfgs),
            "every_byte": sum(c["every_byte"] for c in cfgs), "max_tokens_1": sum(c["max_tokens"] == 1 for c in cfgs),
            "vec16_head_size": sum(c["head_dim"] in (80, 112) for c in cfgs),
            "block_sizes": sorted({c["block_size"] for c in cfgs}),
            "device_steps": sum(bool(c.get("device_steps")) for c in cfgs),
            "compiled": sum(bool(c.get("compiled")) for c in cfgs),
        },
        "failures": [{"config": r["config"], "failures": r["failures"]} for r in results if not r["ok"]],
    }


if __name__ == "__main__":  # vLLM starts its helper processes by spawn
    sys.exit(main())
