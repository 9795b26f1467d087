"""Triton kernels vs the torch path on randomized clean scripted-engine runs (zero false positives).

Each run draws an engine (layout, table kind, page size, chunking, window, padding rows, offload)
and a content budget, runs the same seeded workload (sharing, eviction, aborts, preemption) under a
torch canary and a Triton canary (interpreted: the engine's pool lives on the CPU), and requires identical counters, an
identical stamp pool, no violations and no internal errors. Prints one line per run and a summary;
exits 1 on any difference.

    python bench/triton_soak.py [--runs 100] [--seed 901]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time

import torch

os.environ["TRITON_INTERPRET"] = "1"  # the scripted engine's pool lives on the CPU

from kvcanary import Canary, CanaryConfig  # noqa: E402
from kvcanary.sim import workload  # noqa: E402
from kvcanary.sim.engine import ScriptedEngine  # noqa: E402
from kvcanary.faults.runner import random_spec  # noqa: E402


def one(seed: int, backend: str) -> tuple[dict, torch.Tensor, int, str]:
    rng = random.Random(seed)
    spec = random_spec(rng, seed)
    budget = rng.choice([None, 512, 4096])
    eng = ScriptedEngine(spec)
    c = Canary(eng.num_slots, eng.layout, CanaryConfig(mode="log", backend=backend, validate=True,
                                                         content_budget_bytes=budget, scrub_slots=64))
    eng.canary = c
    n = workload.run(eng, workload.Workload(requests=12, seed=seed, abort_p=0.05, preempt_p=0.1), max_steps=120,
                     on_step=lambda e: (c.scrub(), c.poll()))
    what = f"{spec.layout} {spec.table} page={spec.block_size} window={spec.window} budget={budget}"
    return c.stats(), c.stamps.clone(), n, what


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=901)
    args = ap.parse_args()
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)  # violations are counted below
    t0, steps, bad, slots = time.time(), 0, 0, 0
    for k in range(args.runs):
        seed = args.seed * 1000 + k
        (st, pt, n, what), (sk, pk, _, _) = one(seed, "torch"), one(seed, "triton")
        ok = st == sk and torch.equal(pt, pk) and st["violations"] == 0 and sk["internal_errors"] == 0
        steps, slots, bad = steps + n, slots + st["slots_verified"], bad + (not ok)
        diff = {key: (st[key], sk[key]) for key in st if st[key] != sk[key]}
        print(f"run {k}: {what}, {n} steps, {'ok' if ok else 'DIFFERENT ' + str(diff)} ({time.time() - t0:.0f} s)",
              flush=True)
    print(json.dumps(dict(runs=args.runs, seed=args.seed, steps=steps, slots_verified=slots, failed_runs=bad)))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
