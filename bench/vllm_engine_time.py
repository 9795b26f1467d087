"""Does the canary slow vLLM's own work? The engine's matrix products and forwards timed with the
canary off and on, in fresh engines alternating, beside the generate's wall time and the canary's own.

The workload of ``bench/vllm_cpu.py --model real`` (SmolLM2-135M-Instruct bf16, 16 chat requests, 64
new tokens each, greedy; engine start and a 4-request warm-up left out). In each run every call of
vLLM's CPU matrix product (``vllm._custom_ops.onednn_mm``) and of the model runner's forward
(``GPUModelRunner._model_forward``, which holds the canary's per-layer work) is timed during the
generate. Where the canary costs only its own time, ``added_s`` (the generate's wall time over the
off run's of the same round) matches ``canary_s``, and ``onednn_mm_s`` is the same in both modes;
where it slows the engine (its memory traffic evicting the engine's, say), ``onednn_mm_s`` grows
with it. One JSON line per run, then the rounds side by side.

    .venv-vllm/bin/python bench/vllm_engine_time.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def child(cfg: dict[str, Any]) -> None:
    """One engine run with the engine's calls timed during the generate; prints one RESULT line."""
    import vllm
    from vllm import _custom_ops as ops
    from vllm.v1.worker import gpu_model_runner

    from kvcanary.faults import vllm_runner

    spent: dict[str, float] = {"onednn_mm": 0.0, "model_forward": 0.0}
    armed = [False]

    def timed(obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            if not armed[0]:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    timed(ops, "onednn_mm", "onednn_mm")  # looked up on the module at each call
    timed(gpu_model_runner.GPUModelRunner, "_model_forward", "model_forward")
    generate = vllm.LLM.generate
    calls = [0]

    def second_timed(self: Any, *a: Any, **k: Any) -> Any:  # the warm-up is the first generate
        calls[0] += 1
        armed[0] = calls[0] == 2
        try:
            return generate(self, *a, **k)
        finally:
            armed[0] = False

    vllm.LLM.generate = second_timed  # type: ignore[method-assign]
    out = vllm_runner.run(cfg)
    st = out.get("stats", {})
    print("RESULT " + json.dumps({"wall_s": out["generate_s"], "canary_s": st.get("canary_us", 0) / 1e6,
                                  **{f"{k}_s": v for k, v in spent.items()}, "tokens": out["tokens"]}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    sys.path.insert(0, HERE)
    from vllm_cpu import real_workload
    from vllm_stages import run

    model, extra, name = real_workload(argparse.Namespace(requests=16))
    rows: list[dict[str, Any]] = []
    first = None
    for rnd in range(args.rounds):
        for canary in ((False, True) if rnd % 2 == 0 else (True, False)):
            cfg = {"model": model, "canary": canary, "requests": 16, "max_tokens": 64, "max_seqs": 16,
                   "num_blocks": 256, "warmup": 4, **extra}
            out = run(cfg, args.threads, [], script=__file__)
            tokens = sorted(out.pop("tokens").values())
            first = first or tokens
            row = {"round": rnd, "canary": canary, **{k: round(v, 4) for k, v in out.items()},
                   "same_tokens": tokens == first}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{name}, 16 requests x 64 new tokens, OMP_NUM_THREADS={args.threads}: per round, on minus off")
    print("round  added_s  canary_s  onednn_mm_s_off  onednn_mm_s_on  model_forward_s_off  model_forward_s_on")
    for rnd in range(args.rounds):
        off, on = (next(r for r in rows if r["round"] == rnd and r["canary"] == c) for c in (False, True))
        print(f"{rnd:5d}  {on['wall_s'] - off['wall_s']:7.3f}  {on['canary_s']:8.3f}  {off['onednn_mm_s']:15.3f}  "
              f"{on['onednn_mm_s']:14.3f}  {off['model_forward_s']:19.3f}  {on['model_forward_s']:18.3f}")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
