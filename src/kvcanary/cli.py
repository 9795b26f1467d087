"""``kvcanary`` command line: a thin layer over the library.

Exit codes: 0 success; 1 a violation was found where none was expected (or a fault was missed);
2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from kvcanary.canary import Canary
from kvcanary.config import CanaryConfig


def _scripted_run(args: argparse.Namespace) -> int:
    from kvcanary.engines import workload
    from kvcanary.engines.scripted import EngineSpec, ScriptedEngine

    spec = EngineSpec(num_blocks=args.blocks, block_size=args.block_size, num_layers=args.layers,
                      layout=args.layout, table=args.table, seed=args.seed)
    eng = ScriptedEngine(spec)
    canary = Canary(eng.num_slots, eng.layout, CanaryConfig.from_env(CanaryConfig(mode="log")))
    eng.canary = canary
    wl = workload.Workload(requests=args.requests, seed=args.seed)
    found: list[object] = []
    t0 = time.perf_counter()

    def on_step(e: ScriptedEngine) -> None:
        found.extend(canary.poll())
        if e.steps % 10 == 0 and not args.json:
            print(f"\r  step {e.steps}: {len(e.finished)}/{wl.requests} requests done", end="", file=sys.stderr)

    steps = workload.run(eng, wl, on_step=on_step)
    wall = time.perf_counter() - t0
    st = canary.stats()
    summary = {
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
        "violations": st["violations"],
        "internal_errors": st["internal_errors"],
        "wall_s": round(wall, 3),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(file=sys.stderr)
        width = max(map(len, summary))
        for k, v in summary.items():
            print(f"  {k:<{width}}  {v}")
    return 0 if st["violations"] == 0 and st["internal_errors"] == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcanary", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run a scripted paged engine with the canary on and print a summary")
    d.add_argument("--requests", type=int, default=48)
    d.add_argument("--blocks", type=int, default=96)
    d.add_argument("--block-size", type=int, default=8)
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--layout", default="paged", choices=["flat", "paged", "packed", "head_major", "mla"])
    d.add_argument("--table", default="block", choices=["block", "token"])
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    d.set_defaults(fn=_scripted_run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
