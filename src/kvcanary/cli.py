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


def _prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts drawn from a few shared prefixes plus a random tail."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(16, 40))] for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(2, 16))] for _ in range(n)]


def _table(rows: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def _transformers_run(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("kvcanary demo needs transformers: pip install 'kvcanary[transformers]' "
              "(or run `kvcanary demo --engine scripted`)", file=sys.stderr)
        return 2
    import logging

    import torch

    from kvcanary.engines.transformers import cb_configs, protect, tiny_model
    from kvcanary.faults.transformers_cb import CbFault

    model = tiny_model(seed=args.seed, layers=args.layers, path=args.model)
    prompts = _prompts(args.requests, args.seed)
    gen, cb = cb_configs(max_new_tokens=args.max_new_tokens, num_blocks=args.blocks)
    config = CanaryConfig.from_env(CanaryConfig(mode="log"))

    def generate(progress: bool) -> tuple[dict, float]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=progress and not args.json)
        return out, time.perf_counter() - t0

    generate(False)  # warm the allocator and kernels so both timed runs start equal
    base, t_off = generate(False)
    with protect(model, config) as guard:
        out, t_on = generate(True)
    same = all(base[k].generated_tokens == out[k].generated_tokens for k in base)
    st = guard.stats()
    summary: dict[str, object] = {
        "engine": f"transformers {transformers.__version__} continuous batching (CPU, tiny random Llama)",
        "requests": len(prompts),
        "tokens_generated": sum(len(o.generated_tokens) for o in out.values()),
        "forwards": st["forwards"],
        "slots_verified": st["slots_verified"],
        "slots_stamped": st["slots_stamped"],
        "content_bytes_checked": st["content_bytes_verified"] + st["content_bytes_stamped"],
        "violations": st["violations"],
        "internal_errors": st["internal_errors"],
        "outputs_identical": same,
        "wall_s_without_canary": round(t_off, 3),
        "wall_s_with_canary": round(t_on, 3),
        "overhead_pct": round(100 * (t_on - t_off) / t_off, 1),
    }
    ok = same and st["violations"] == 0 and st["internal_errors"] == 0
    if args.inject:
        logging.getLogger("kvcanary").setLevel(logging.ERROR)
        faults = [CbFault("flip_shared_byte", at=3, seed=args.seed), CbFault("redirect_table_entry", at=5, seed=args.seed),
                  CbFault("free_shared_block", at=7, seed=args.seed)]
        with protect(model, config) as guard:
            guard.hooks.extend(faults)
            generate(False)
        found = []
        for f in faults:
            hits = [v for v in guard.violations if f.injected_at is not None and v.step >= f.injected_at]
            first = hits[0] if hits else None
            found.append({"fault": f.name, "injected_at_forward": f.injected_at, "detail": f.detail,
                          "detected": first is not None,
                          "first_detection": guard.describe(first) if first else None})
            ok = ok and first is not None
        summary["injected"] = found
    if args.json:
        print(json.dumps(summary))
        return 0 if ok else 1
    _table([(k, v) for k, v in summary.items() if k != "injected"])
    for f in summary.get("injected", []):  # type: ignore[attr-defined]
        print(f"\n  fault {f['fault']} at forward {f['injected_at_forward']}: {f['detail']}")
        print(f"    detected: {f['first_detection'] or 'NO'}")
    return 0 if ok else 1


def _demo(args: argparse.Namespace) -> int:
    return _scripted_run(args) if args.engine == "scripted" else _transformers_run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcanary", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run continuous batching with the canary on and print a summary")
    d.add_argument("--engine", default="transformers", choices=["transformers", "scripted"])
    d.add_argument("--inject", action="store_true", help="also run with faults injected and show each detection")
    d.add_argument("--requests", type=int, default=32)
    d.add_argument("--max-new-tokens", type=int, default=16)
    d.add_argument("--model", help="a local model directory (default: a tiny random Llama, nothing downloaded)")
    d.add_argument("--blocks", type=int, default=96)
    d.add_argument("--block-size", type=int, default=8)
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--layout", default="paged", choices=["flat", "paged", "packed", "head_major", "mla"])
    d.add_argument("--table", default="block", choices=["block", "token"])
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    d.set_defaults(fn=_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
