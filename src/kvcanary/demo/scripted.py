"""The demo on the scripted paged engine (:mod:`kvcanary.sim`): no model, any cache layout."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvcanary.config import CanaryConfig
from kvcanary.demo.common import coverage, pool_fits, print_summary, setup_time


def run(args: argparse.Namespace, config: CanaryConfig) -> int:
    from kvcanary.canary import Canary
    from kvcanary.sim import workload
    from kvcanary.sim.engine import ScriptedEngine
    from kvcanary.sim.spec import EngineSpec

    wl = workload.Workload(requests=args.requests, seed=args.seed)
    need = -(-wl.max_request_tokens // args.block_size)
    if args.blocks < need:
        print(f"kvcanary demo: --blocks: expected at least {need} (the workload's longest request holds up to "
              f"{wl.max_request_tokens} tokens, {need} blocks of {args.block_size} slots), got {args.blocks}",
              file=sys.stderr)
        return 2
    spec = EngineSpec(num_blocks=args.blocks, block_size=args.block_size, num_layers=args.layers,
                      layout=args.layout, table=args.table, seed=args.seed)
    # K and V of every layer, then the canary's stamps, last writers and check ledger
    per_slot = args.layers * 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize + 56
    too_big = pool_fits(args, per_slot, f"K and V of {args.layers} layers and the canary's 56 bytes")
    if too_big:
        print(f"kvcanary demo: {too_big}", file=sys.stderr)
        return 2
    eng = ScriptedEngine(spec)
    setup = setup_time(config)
    t0 = time.perf_counter()
    canary = Canary(eng.num_slots, eng.layout, config)
    setup += time.perf_counter() - t0
    eng.canary = canary
    found: list[object] = []
    t0 = time.perf_counter()

    def on_step(e: ScriptedEngine) -> None:
        found.extend(canary.poll())
        if e.steps % 10 == 0 and not args.json:
            print(f"\r  step {e.steps}: {len(e.finished)}/{wl.requests} requests done", end="", file=sys.stderr)

    steps = workload.run(eng, wl, on_step=on_step)
    wall = time.perf_counter() - t0
    st = canary.stats()
    summary: dict[str, object] = {
        "engine": "scripted",
        "layout": spec.layout,
        "table": spec.table,
        "requests": wl.requests,
        "finished": len(eng.finished),
        "aborted": eng.aborts,
        "preemptions": eng.preemptions,
        "prefix_cache_hits": eng.pool.hits,
        "evictions": eng.pool.evictions,
        "steps": steps,
        "tokens_written": st["slots_stamped"],
        "tokens_generated": eng.tokens_generated,
        "slots_verified": st["slots_verified"],
        "content_bytes_stamped": st["content_bytes_stamped"],
        "content_bytes_verified": st["content_bytes_verified"],
        "slots_unverifiable": st["slots_unverifiable"],  # read but never seen written (counted, not checked)
        "write_slots_checked": st.get("write_slots_checked", 0),  # new tokens' K/V against the cache, per layer
        "attention_queries_audited": st.get("audit_queries", 0),  # recomputed from the verified KV
        **coverage(st),
        "violations": st["violations"],
        "internal_errors": st["internal_errors"],
        "setup_s": round(setup, 3),  # one-time: the canary made, its compiled loops loaded (not in wall_s)
        "wall_s": round(wall, 3),
    }
    if not args.json:
        print(file=sys.stderr)
    ok = st["violations"] == 0 and st["internal_errors"] == 0
    if not eng.finished:
        print(f"kvcanary demo: no request of {wl.requests} finished ({eng.aborts} aborted)", file=sys.stderr)
        ok = False
    if args.inject:
        faults = _faults(args, spec)
        summary["injected"] = faults
        ok = ok and all(f["detected"] and f["in_time"] for f in faults)
    print_summary(summary, "step", args.json)
    return 0 if ok else 1


def _faults(args: argparse.Namespace, spec: Any) -> list[dict[str, object]]:
    """The demo's fault classes, each injected once into a busy scripted engine of ``spec``'s
    geometry, layout and table (the selftest's runner), and what caught each."""
    from kvcanary.faults import runner
    from kvcanary.faults.catalog import BY_NAME

    found: list[dict[str, object]] = []
    for i, name in enumerate(runner.CB_FAULTS):  # the classes the transformers demo injects
        if not args.json:
            print(f"injecting {name} ...", file=sys.stderr, flush=True)
        r = runner.run_scripted(BY_NAME[name], args.seed + i, table=spec.table, layout=spec.layout, base=spec)
        found.append({"fault": r.fault, "injected_at_step": r.injected_at, "detail": r.detail,
                      "detected": r.detected, "forwards_to_detect": r.forwards_to_detect,
                      "deadline_forwards": r.max_forwards, "in_time": r.ok, "checks_fired": r.checks_fired,
                      "first_detection": r.first})
    return found

