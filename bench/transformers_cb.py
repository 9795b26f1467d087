"""Throughput of transformers continuous batching with the canary on versus off, in the same run.

The canary runs in log mode with metadata checks on every forward and content checks of every
layer within the default budget. Runs alternate off/on ``--repeats`` times per workload; the
median of each is reported (``overhead_pct``), and so is the canary's own host time against the
run without it (``canary_time_pct``), which a shared, noisy machine disturbs less. One JSON line
per workload.

    python bench/transformers_cb.py [--repeats 5] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvcanary import CanaryConfig
from kvcanary.engines.transformers import cb_configs, protect, tiny_model

WORKLOADS = {
    # name: (requests, prefix length, tail length range, new tokens)
    "mixed_shared_prefix": (32, 32, (2, 16), 16),
    "decode_heavy": (16, 8, (1, 4), 96),
    "prefill_heavy": (16, 192, (8, 64), 2),
}


def prompts(n: int, prefix: int, tail: tuple[int, int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(prefix)] for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(*tail))] for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--backend", default="auto", help="the canary's backend (kvcanary.ops: torch, fused, triton)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    args = ap.parse_args()
    model = tiny_model(seed=0, layers=args.layers, hidden=args.hidden).to(args.device)
    for name in args.workloads.split(","):
        n, prefix, tail, new = WORKLOADS[name]
        ps = prompts(n, prefix, tail)
        gen, cb = cb_configs(max_new_tokens=new, num_blocks=256, max_batch_tokens=256)

        def run(on: bool) -> tuple[float, dict]:
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.inference_mode():
                if on:
                    with protect(model, CanaryConfig(mode="log", backend=args.backend)) as guard:
                        model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
                    stats = guard.stats()
                else:
                    model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
                    stats = {}
            if args.device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t, stats

        run(False)  # warm-up
        off, on, stats = [], [], {}
        for _ in range(args.repeats):
            off.append(run(False)[0])
            t, stats = run(True)
            on.append(t)
        m_off, m_on = statistics.median(off), statistics.median(on)
        tokens = n * new
        print(json.dumps({
            "workload": name, "device": args.device, "requests": n, "new_tokens": tokens,
            "wall_s_off": round(m_off, 4), "wall_s_on": round(m_on, 4),
            "tok_per_s_off": round(tokens / m_off, 1), "tok_per_s_on": round(tokens / m_on, 1),
            "overhead_pct": round(100 * (m_on - m_off) / m_off, 2),
            # the canary's own host time per run against the run without it: steadier on a shared machine
            "canary_time_pct": round(100 * stats.get("canary_us", 0) / 1e6 / m_off, 2),
            "canary_us_per_forward": round(stats.get("canary_us", 0) / max(1, stats.get("forwards", 1)), 1),
            "forwards": stats.get("forwards"), "slots_verified": stats.get("slots_verified"),
            "content_bytes_verified": stats.get("content_bytes_verified"),
            "content_bytes_stamped": stats.get("content_bytes_stamped"),
            "violations": stats.get("violations"), "internal_errors": stats.get("internal_errors"),
            "repeats": args.repeats, "threads": torch.get_num_threads(), "backend": args.backend,
            "model": f"llama layers={args.layers} hidden={args.hidden}",
        }), flush=True)


if __name__ == "__main__":
    main()
