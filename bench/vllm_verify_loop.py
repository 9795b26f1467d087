"""The compiled verify (:meth:`kvcanary.fused.forward.ForwardArgs.before`) inside a vLLM engine: the
trained model (SmolLM2-135M-Instruct in bf16, the workload of ``bench/vllm_cpu.py --model real``),
vLLM's default compiled execution, one intra-op thread. Forwards 20, 30 and 40 of the timed
generate are each verified first as the engine calls it (after the model's forward: caches cold),
then ``--repeat`` times more with the same step (warm), with the content window the canary chose
and without one (the metadata checks alone: each read slot's token, position and prefix link).

    .venv-vllm/bin/python bench/vllm_verify_loop.py [--repeat 50]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CALLS = (20, 30, 40)


def child(cfg: dict[str, Any], repeat: int) -> None:
    from kvcanary.faults import vllm_runner

    found = vllm_runner.process_canary
    rows: list[dict[str, Any]] = []

    def timed_from_here() -> Any:  # between the warm-up generate and the timed one
        from kvcanary.fused import forward

        original = forward.ForwardArgs.before
        calls = [0]

        def before(self: Any, d: Any, content_slots: int, part: int, check: bool, fwd: int) -> int:
            calls[0] += 1
            t = time.perf_counter()
            out = original(self, d, content_slots, part, check, fwd)
            cold = time.perf_counter() - t
            if calls[0] in CALLS:
                took = []
                for window in (content_slots, 0):
                    t = time.perf_counter()
                    for _ in range(repeat):
                        original(self, d, window, part, check, fwd)
                    took.append((time.perf_counter() - t) / repeat)
                rows.append({"call": calls[0], "read_slots": out, "content_slots": content_slots,
                             "cold_us": round(cold * 1e6, 1), "warm_us": round(took[0] * 1e6, 1),
                             "warm_metadata_only_us": round(took[1] * 1e6, 1)})
            return out

        forward.ForwardArgs.before = before  # type: ignore[method-assign]
        return found()

    vllm_runner.process_canary = timed_from_here
    vllm_runner.run(cfg)
    for r in rows:
        print("ROW " + json.dumps(r), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child), args.repeat)
        return 0
    sys.path.insert(0, HERE)
    from vllm_cpu import real_workload

    model, extra, _ = real_workload(argparse.Namespace(requests=16))
    cfg = {"model": model, "canary": True, "requests": 16, "max_tokens": 64, "max_seqs": 16, "num_blocks": 256,
           "warmup": 4, "eager": False, **extra}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg), "--repeat",
                        str(args.repeat)], capture_output=True, text=True, timeout=1200, env=env)
    rows = [ln[4:] for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
    if p.returncode != 0 or not rows:
        raise SystemExit(f"vllm_verify_loop.py: the engine run failed:\n{p.stderr[-3000:]}")
    for r in rows:
        print(json.dumps({**json.loads(r), "threads": 1}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
