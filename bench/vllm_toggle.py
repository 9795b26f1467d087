"""One part of the canary switched off and on between the generates of one vLLM engine: the
canary's own time per forward and its two hooks' with and without the part, in one process.

    OMP_NUM_THREADS=1 taskset -c 1 .venv-vllm/bin/python bench/vllm_toggle.py --switch kept [--rounds 4]
        [--dtype bfloat16|float32] [--set KVCANARY_X=V ...]

Separate engine processes differ by more than a change worth a tenth of a millisecond a forward (the
per-layer calls' cost swings with where each process's memory lies); one engine alternating the
part between its generates (A B B A ...) compares like with like. A switch is a part that can be
turned off from outside between generates without changing what the canary checks:

- ``kept``: the rows' and steps' buffers kept across forwards (the connector's ``kept``;
  :class:`kvcanary.engines.vllm.steps.Kept`); off, each forward's rows and steps are made afresh;

The workload is ``bench/vllm_cpu.py``'s trained one (SmolLM2-135M-Instruct, 16 chat requests, 64 new
tokens each, greedy), compiled by torch.compile (vLLM's default), in-process engine, after a 4-request
warm-up generate. ``KVCANARY_AUDIT_BUDGET`` defaults to 0.001 here (the read audit at its least, as it
runs where the canary's other work already takes its 1 % share); ``--set`` gives others. One
``TOGGLE`` JSON line per generate, then the medians by setting and the median of the neighbouring
pairs' differences. Exit status 1 if a generate reported a violation or an internal error, or
generated other tokens than the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def _switch(name: str, conn: Any) -> Callable[[bool], None]:
    """A function that turns ``name`` on or off for the generates after it."""
    if name == "kept":
        kept = conn.kept

        def kept_on(on: bool) -> None:
            conn.kept = kept if on else None

        return kept_on
    raise ValueError(f"switch: expected 'kept', got {name!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--switch", required=True, choices=("kept",))
    ap.add_argument("--rounds", type=int, default=4, help="pairs of generates (on, off), alternating their order")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--set", action="append", default=[], metavar="KVCANARY_X=V")
    args = ap.parse_args()
    bad = [kv for kv in args.set if not kv.startswith("KVCANARY_") or "=" not in kv]
    if bad:
        ap.error(f"--set: expected KVCANARY_NAME=VALUE, got {', '.join(bad)}")
    for k in [k for k in os.environ if k.startswith("KVCANARY_")]:
        del os.environ[k]
    os.environ["KVCANARY_AUDIT_BUDGET"] = "0.001"
    os.environ.update(kv.split("=", 1) for kv in args.set)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, HERE)
    from vllm_cpu import real_workload

    from kvcanary.faults import vllm_runner

    for k, v in vllm_runner.ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcanary.engines.vllm.entry import KvCanaryConnector

    hooks = {"before": 0.0, "after": 0.0}

    def timed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                hooks[name] += time.perf_counter() - t

        return wrapper

    KvCanaryConnector.before_forward = timed(KvCanaryConnector.before_forward, "before")  # type: ignore[method-assign]
    KvCanaryConnector.after_forward = timed(KvCanaryConnector.after_forward, "after")  # type: ignore[method-assign]
    path, extra, name = real_workload(argparse.Namespace(requests=16, dtype=args.dtype))
    print(f"[vllm_toggle] {name}, compiled, switch {args.switch!r}, {args.rounds} pairs of generates "
          f"(engine start and compile first, a minute or two) ...", file=sys.stderr, flush=True)
    cfg = {"model": path, "max_seqs": 16, "num_blocks": 256, "eager": False, **extra}
    llm = vllm_runner._engine(cfg, {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both"})
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    ps = [TokensPrompt(prompt_token_ids=p) for p in extra["prompt_ids"]]
    llm.generate(ps[:4], sp, use_tqdm=False)  # warm-up
    conn = vllm_runner.process_canary()
    turn = _switch(args.switch, conn)
    order: list[bool] = []
    for r in range(args.rounds):
        order += [True, False] if r % 2 == 0 else [False, True]
    ref = None
    rows = []
    ok = True
    for on in order:
        turn(True)  # (the stats read the part's own counts)
        before, h0 = conn.stats(), dict(hooks)
        turn(on)
        t0 = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        turn(True)
        st = conn.stats()
        toks = [list(o.outputs[0].token_ids) for o in outs]
        ref = ref or toks
        fw = st["forwards"] - before["forwards"]
        row = {args.switch: on, "canary_us_per_forward": round((st["canary_us"] - before["canary_us"]) / fw, 1),
               "forwards": fw, "before_forward_us": round((hooks["before"] - h0["before"]) * 1e6 / fw, 1),
               "after_forward_us": round((hooks["after"] - h0["after"]) * 1e6 / fw, 1),
               "steps_kept": st["steps_kept"] - before["steps_kept"],
               "wall_s": round(wall, 3), "tokens_same": toks == ref,
               "violations": len(conn.violations), "internal_errors": st["internal_errors"]}
        ok = ok and row["tokens_same"] and not row["violations"] and not row["internal_errors"]
        rows.append(row)
        print("TOGGLE " + json.dumps(row), flush=True)
    for key in ("canary_us_per_forward", "before_forward_us", "after_forward_us", "wall_s"):
        on_ = [r[key] for r in rows if r[args.switch]]
        off = [r[key] for r in rows if not r[args.switch]]
        diffs = [a[key] - b[key] for a, b in zip(rows[::2], rows[1::2])]  # each pair: first minus second
        signed = [d if a[args.switch] else -d for d, a in zip(diffs, rows[::2])]  # on minus off
        print(f"{key:>24}: on {statistics.median(on_):9.1f}  off {statistics.median(off):9.1f}  "
              f"(on - off in each pair: {', '.join(f'{d:+.1f}' for d in signed)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
