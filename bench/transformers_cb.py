"""Throughput of transformers continuous batching with the canary on versus off, in the same run.

The canary runs in log mode with metadata checks on every forward and content checks of every
layer within the default budget. Runs alternate off/on ``--repeats`` times per workload; the
median of each is reported (``overhead_pct``), and so is the canary's own host time against the
run without it (``canary_time_pct``), which a shared, noisy machine disturbs less. One JSON line
per workload.

``--audit`` adds a run of the canary without its write check and read audit (``kvcanary.audit``) to
each round, alternating with the default one, so the audit's share is the difference of two
canary-time shares from the same run (``audit_points``: percentage points of the run without the
canary; ``audit_us_per_forward``).

``--priorities`` adds a third run to each round: the canary without its content priorities (no
patrol scrub, no first-read verification of prefix hits, no guard slots), so their cost per
forward is the difference of the medians of two figures from the same run
(``priorities_us_per_forward``; ``priorities_pct`` against the run without the canary).

``--model llama2048`` runs a forward realistic for CPU serving instead of the demo model: a
Llama shape (hidden size 2048, 16 layers, 32 query and 4 KV heads of 64, MLP 5632, vocabulary
32000; about 1.0B parameters), random weights from a fixed seed, bf16.

    python bench/transformers_cb.py [--repeats 5] [--device cpu|cuda] [--priorities] [--audit] [--threads N]
                                    [--model demo|llama2048]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time

import torch

from kvcanary import CanaryConfig
from kvcanary.canary import Canary
from kvcanary.engines.transformers import Protection, cb_configs, protect, tiny_model

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


@contextlib.contextmanager
def without_priorities():  # type: ignore[no-untyped-def]
    """The canary with no first-read verification and no guard slots (the patrol is off by config)."""
    saved = Protection._verify_first_reads, Canary.guard
    Protection._verify_first_reads = lambda self, *a: None  # type: ignore[method-assign]
    Canary.guard = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Protection._verify_first_reads, Canary.guard = saved  # type: ignore[method-assign]


def llama2048():  # type: ignore[no-untyped-def]
    """A Llama-shaped model realistic for CPU serving (random weights, bf16)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--backend", default="auto", help="the canary's backend (kvcanary.ops: torch, fused, triton)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    ap.add_argument("--priorities", action="store_true",
                    help="also run the canary without its content priorities (patrol, first reads, guards)")
    ap.add_argument("--audit", action="store_true",
                    help="also run the canary without its write check and read audit, alternating")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument("--model", default="demo", choices=("demo", "llama2048"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.audit and args.priorities:
        ap.error("--audit and --priorities: one comparison per run")
    if args.model == "llama2048":
        model = llama2048().to(args.device)
    else:
        model = tiny_model(seed=0, layers=args.layers, hidden=args.hidden).to(args.device)
    for name in args.workloads.split(","):
        n, prefix, tail, new = WORKLOADS[name]
        ps = prompts(n, prefix, tail)
        gen, cb = cb_configs(max_new_tokens=new, num_blocks=256, max_batch_tokens=256)

        def run(on: bool, plain: bool = False) -> tuple[float, dict]:
            """``plain``: without the priorities (``--priorities``) or without the audit (``--audit``)."""
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.inference_mode():
                if on:
                    cfg = CanaryConfig(mode="log", backend=args.backend,
                                       patrol_budget_bytes=0 if plain and args.priorities else "auto",
                                       write_check=not (plain and args.audit),
                                       audit_queries=0 if plain and args.audit else 4)
                    no_priorities = plain and args.priorities
                    with protect(model, cfg) as guard, (without_priorities() if no_priorities else contextlib.nullcontext()):
                        model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
                    stats = guard.stats()
                else:
                    model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
                    stats = {}
            if args.device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t, stats

        run(False)  # warm-up
        off, on, plain, stats, pstats = [], [], [], {}, {}
        us_on, us_plain = [], []  # the canary's own host time per forward, each run
        per_fwd = lambda st: st.get("canary_us", 0) / max(1, st.get("forwards", 1))  # noqa: E731
        for i in range(args.repeats):
            off.append(run(False)[0])
            # with --priorities the two canary runs swap places every round: the run right after the
            # one without the canary is measurably slower on a small CPU, whichever it is
            order = ((True, False) if i % 2 == 0 else (False, True)) if args.priorities or args.audit else (True,)
            for variant in order:
                if variant:
                    t, stats = run(True)
                    on.append(t)
                    us_on.append(per_fwd(stats))
                else:
                    t, pstats = run(True, plain=True)
                    plain.append(t)
                    us_plain.append(per_fwd(pstats))
        m_off, m_on = statistics.median(off), statistics.median(on)
        tokens = n * new
        extra: dict = {}
        if plain and args.audit:
            d_us = statistics.median(us_on) - statistics.median(us_plain)
            extra = {"canary_us_per_forward_median": round(statistics.median(us_on), 1),
                     "canary_us_per_forward_without_audit_median": round(statistics.median(us_plain), 1),
                     "audit_us_per_forward": round(d_us, 1),
                     "audit_points": round(100 * d_us * stats.get("forwards", 0) / 1e6 / m_off, 2),
                     "overhead_pct_without_audit": round(100 * (statistics.median(plain) - m_off) / m_off, 2),
                     "audit_queries": stats.get("audit_queries"), "write_slots_checked": stats.get("write_slots_checked")}
        elif plain:
            d_us = statistics.median(us_on) - statistics.median(us_plain)
            extra = {"overhead_pct_without_priorities": round(100 * (statistics.median(plain) - m_off) / m_off, 2),
                     "canary_us_per_forward_median": round(statistics.median(us_on), 1),
                     "canary_us_per_forward_without_priorities_median": round(statistics.median(us_plain), 1),
                     "priorities_us_per_forward": round(d_us, 1),
                     "priorities_pct": round(100 * d_us * stats.get("forwards", 0) / 1e6 / m_off, 2),
                     "slots_scrubbed": stats.get("slots_scrubbed"), "guard_checks": stats.get("guard_checks"),
                     "patrol_pass_steps": stats.get("patrol_pass_steps")}
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
            "model": ("llama2048 layers=16 hidden=2048 bf16" if args.model == "llama2048"
                      else f"llama layers={args.layers} hidden={args.hidden}"), **extra,
        }), flush=True)


if __name__ == "__main__":
    main()
