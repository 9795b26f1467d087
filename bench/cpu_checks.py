"""CPU cost of kvcanary's checks, per verified slot and per stamped token.

Prints one JSON line per case with the fields of ``shared/bench/sglang_anchor.py`` (case, bs,
prefix, extend, real_kv, sources, kv_row_bytes, verify_entries, write_entries, plan_us, verify_us,
write_us, violations_on_clean_run, device) plus us_per_verified_slot, us_per_stamped_token and
bytes fingerprinted. With ``--anchor PYTHON`` it first runs SGLang's anchor script with that
interpreter (an environment with sglang installed) in the same run and prints the ratios.

    python bench/cpu_checks.py                        # small cases
    python bench/cpu_checks.py --full                 # the CPU cases of design.md
    python bench/cpu_checks.py --full --anchor /path/to/sglang-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvcanary import ByteSource, Canary, CanaryConfig, KvLayout, Step

KV_ROW = 2048
ANCHOR = Path(__file__).resolve().parents[2] / "shared" / "bench" / "sglang_anchor.py"


def build(bs: int, prefix: int, extend: int, nsrc: int, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    total = prefix + extend
    num_slots = bs * total + 1
    perm = torch.randperm(num_slots - 1, generator=g) + 1  # random placement; slot 0 unused
    table = perm.view(bs, total)
    tokens = torch.randint(0, 128000, (bs, total), generator=g)
    sources = tuple(
        ByteSource.from_tensor(f"src{i}", torch.randint(0, 256, (num_slots, KV_ROW), dtype=torch.uint8, generator=g))
        for i in range(nsrc)
    )
    canary = Canary(num_slots, KvLayout(sources), CanaryConfig(mode="raise", content_budget_bytes=None))

    def step(start: int, n: int) -> Step:
        pos = torch.arange(start, start + n).repeat(bs)
        return Step(
            slot_table=table,
            cached_lens=torch.full((bs,), start, dtype=torch.int64),
            new_offsets=torch.arange(bs + 1, dtype=torch.int64) * n,
            new_tokens=tokens[:, start : start + n].reshape(-1),
            new_positions=pos,
            new_slots=table[:, start : start + n].reshape(-1),
        )

    return canary, step


def timeit(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e6 / iters


def run_case(name: str, bs: int, prefix: int, extend: int, mode: str, nsrc: int, iters: int) -> dict:
    canary, step = build(bs, prefix, extend, nsrc if mode == "all" else 0)
    if prefix:
        canary.after_forward(step(0, prefix))
    s = step(prefix, extend)
    verify_us = timeit(lambda: canary.before_forward(s), iters) if prefix else 0.0
    write_us = timeit(lambda: canary.after_forward(s), iters)
    violations = len(canary.poll())
    ve, we = bs * prefix, bs * extend
    rec = dict(
        case=name, bs=bs, prefix=prefix, extend=extend, real_kv=mode, sources=nsrc if mode == "all" else 0,
        kv_row_bytes=KV_ROW, verify_entries=ve, write_entries=we, plan_us=0.0, verify_us=round(verify_us, 2),
        write_us=round(write_us, 2), violations_on_clean_run=violations, device="cpu",
        us_per_verified_slot=round(verify_us / ve, 4) if ve else None,
        us_per_stamped_token=round(write_us / we, 4),
        verify_content_bytes=ve * KV_ROW * (nsrc if mode == "all" else 0),
        threads=torch.get_num_threads(),
    )
    print(json.dumps(rec), flush=True)
    return rec


def run_anchor(python: str, full: bool) -> list[dict]:
    env = dict(os.environ, CPU_FULL="1" if full else "0")
    out = subprocess.run([python, str(ANCHOR)], env=env, capture_output=True, text=True, check=True).stdout
    recs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for r in recs:
        print(json.dumps({"sglang": True, **r}), flush=True)
    return [r for r in recs if "case" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the CPU cases of design.md (16 x 4K decode, 4K prefill)")
    ap.add_argument("--anchor", metavar="PYTHON", help="interpreter with sglang installed: run its anchor too")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    anchor = run_anchor(args.anchor, args.full) if args.anchor else []
    if args.full:
        cases = [("cpu_decode_bs16_ctx4k", 16, 4095, 1), ("cpu_prefill_1x4k", 1, 0, 4096)]
    else:
        cases = [("smoke_decode", 4, 64, 1), ("smoke_prefill", 1, 0, 128)]
    ours = [run_case(n, bs, p, e, m, 1, args.iters) for n, bs, p, e in cases for m in ("none", "all")]
    for o in ours:
        a = next((r for r in anchor if r["case"] == o["case"] and r["real_kv"] == o["real_kv"]), None)
        if a is None:
            continue
        ratio = {"case": o["case"], "real_kv": o["real_kv"]}
        if o["verify_entries"]:
            ratio["verify_speedup_vs_sglang_verify"] = round(a["verify_us"] / o["verify_us"], 1)
            ratio["verify_speedup_vs_sglang_plan_plus_verify"] = round((a["plan_us"] + a["verify_us"]) / o["verify_us"], 1)
        ratio["write_speedup_vs_sglang"] = round(a["write_us"] / o["write_us"], 1)
        print(json.dumps({"ratio": ratio}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
