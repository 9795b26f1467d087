"""Where the canary's time goes in a vLLM CPU run, stage by stage: each stage's time per forward (and
per layer call, for the per-layer stages) and its share of the canary's time, stages nested as the
connector calls them, on the trained model (default) or the tiny random one.

    .venv-vllm/bin/python bench/vllm_stages.py [--model real|tiny] [--dtype bfloat16|float32] [--threads 1] [--runs 2] [--set KVCANARY_X=V ...]
        [--fine] [--compiled]

Each run is an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) in a fresh process, eager
(``--enforce-eager``) unless ``--compiled`` gives it vLLM's default (the model compiled by
torch.compile; the compile is part of the engine start, not timed), with the
connector's default configuration: the workload of ``bench/vllm_cpu.py`` (``real``: SmolLM2-135M-Instruct
in bf16, 16 chat requests, 64 new tokens each; a 4-request warm-up generate is left out). A stage's
time includes its callees; the worker-side hooks and the per-layer checks together are the canary's
time on the engine's thread (``canary_us``), the scheduler-side hooks run in the engine core
beside it. Each timed call adds about a microsecond of its own. The last lines give the generate
call's wall time and the canary's share of it (its own counter, ``canary_us``), and the bytes its
compiled loops fingerprinted per forward.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

OFF_PLAIN = "  layers off the plain path (the engine's attention excluded)"
COMPILED = "    compiled call (write check, fold)"
# (module, owner within it or "", attribute, stage name): each hook, then its parts
STAGES = [
    ("kvcanary.engines.vllm.entry", "KvCanaryConnector.before_forward", "__wrapped__", "before-forward hook"),
    ("kvcanary.engines.vllm.entry", "", "match_rows", "  rows matched to requests"),
    ("kvcanary.engines.vllm.entry", "", "build_step", "  steps built (per group)"),
    ("kvcanary.engines.vllm.entry", "KvCanaryConnector", "_verify_first_reads", "  first reads"),
    ("kvcanary.canary", "Canary", "before_forward", "  canary.before_forward (verify, content window)"),
    ("kvcanary.engines.vllm.audit", "VllmAudit", "begin", "  audit plan"),
    ("kvcanary.engines.vllm.audit", "VllmAudit", "check_layer", "per-layer checks (write check, read audit)"),
    ("kvcanary.engines.audit", "EngineAudit", "run_compiled", "  compiled call"),
    ("kvcanary.engines.vllm.entry", "KvCanaryConnector.model_positions", "__wrapped__", "position check"),
    # the layers' time is the canary's own clock less the hooks' (the plain path runs inside the attention
    # patch, where no stage can wrap it); the layers off it are timed through their two entries
    ("", "", "", "per-layer wrapper (the engine's attention excluded)"),
    ("kvcanary.engines.vllm.wide", "", "attend", OFF_PLAIN),
    ("kvcanary.engines.vllm.wide", "WideForward", "attend", OFF_PLAIN),
    ("kvcanary.engines.vllm.wide", "WideForward", "before", "    before attention (write check, fold)"),
    ("kvcanary.engines.vllm.wide", "WideForward", "keep_written", "  the written layers' calls (both paths)"),
    ("", "", "", COMPILED),
    ("kvcanary.engines.vllm.wide", "WideForward", "keep", "  after attention (audited rows copied)"),
    ("kvcanary.engines.vllm.entry", "KvCanaryConnector.after_forward", "__wrapped__", "after-forward hook"),
    ("kvcanary.engines.vllm.audit", "VllmAudit", "finish", "  read audit after the forward (one call)"),
    ("kvcanary.canary", "Canary", "after_forward", "  canary.after_forward (stamp, guard, patrol)"),
    ("kvcanary.engines.vllm.entry", "KvCanaryConnector", "report_and_heal", "  report and heal"),
    ("kvcanary.engines.vllm.entry", "KvCanaryConnector", "publish_metrics", "  metrics"),
    ("kvcanary.engines.vllm.scheduler", "SchedulerSide", "build_connector_meta", "scheduler: build_connector_meta"),
    ("kvcanary.engines.vllm.scheduler", "SchedulerSide", "update_state_after_alloc", "scheduler: after alloc"),
    ("kvcanary.engines.vllm.scheduler", "SchedulerSide", "request_finished", "scheduler: request finished"),
]
# --fine: the hooks' parts below the stages above (nested under the stage that calls them; the compiled
# loops' modules timed from the timed generate on, as numba must not load before vLLM's engine starts)
FINE = [
    ("kvcanary.engines.vllm.entry", "KvCanaryConnector", "_bookkeep", "  bookkeeping (harm rows, history, releases)"),
    ("kvcanary.engines.token_book", "TokenBook", "extend_all", "  token book extended"),
    ("kvcanary.canary", "Canary", "_described", "  step descriptors (verify and stamp)"),
    ("kvcanary.fused.forward", "ForwardArgs", "before", "  compiled verify"),
    ("kvcanary.engines.audit", "EngineAudit", "sample", "  audit: queries sampled"),
    ("kvcanary.engines.audit", "EngineAudit", "start", "  audit: forward's results allocated"),
    ("kvcanary.engines.vllm.wide", "WideForward", "plan", "  audit: one call planned"),
    ("kvcanary.engines.vllm.wide", "", "query_table", "    query table"),
    ("kvcanary.fused.keep", "", "keep_tables", "    per-layer tables' addresses"),
    ("kvcanary.engines.vllm.audit", "VllmAudit", "_deferred", "  audit: the forward's one call set up"),
    ("kvcanary.engines.vllm.wide", "WideForward", "finish", "  audit: the one call and its records"),
    ("kvcanary.fused.audit", "", "check_forward", "    the one call's compiled loop"),
    ("kvcanary.fused.forward", "ForwardArgs", "after", "  compiled stamp, guard, patrol"),
    ("kvcanary.engines.audit", "EngineAudit", "drain", "  audit results drained"),
    ("kvcanary.engines.audit", "EngineAudit", "end", "  audit forward ended (budget)"),
    ("kvcanary.canary", "Canary", "drain", "  canary violations drained"),
    ("kvcanary.engines.vllm.scheduler", "SchedulerSide", "_add", "  scheduler: a request's step added"),
    ("kvcanary.engines.vllm.compiled", "", "rows_of", "  rows: compiled matching and new tokens"),
    ("kvcanary.engines.vllm.compiled", "", "step_of", "  steps: compiled new-token fields"),
    ("kvcanary.engines.vllm.compiled", "", "written_from", "    reads of this step's writes (checks, descriptor)"),
    ("kvcanary.engines.vllm.compiled", "", "Step", "    the step made (kvcanary.step.Step)"),
    ("kvcanary.step", "Step", "validate_shapes", "  a step's shapes checked"),
    ("kvcanary.harm", "HarmCounter", "forward", "  harm ledger's rows"),
    ("kvcanary.engines.vllm.wide", "WideForward", "__init__", "  audit: the forward's plan made (buffers, tables)"),
    ("kvcanary.engines.vllm.fold", "Fold", "whole", "  fold: fully folded tokens counted"),
]
# modules whose import loads numba (timed from the timed generate on, like kvcanary.fused's)
LATE = ("kvcanary.fused", "kvcanary.engines.vllm.compiled")
WRAPPER = "per-layer wrapper (the engine's attention excluded)"
CANARY = ("before-forward hook", "position check", WRAPPER, "after-forward hook")
PER_CALL = ("per-layer checks (write check, read audit)", "  compiled call", WRAPPER, OFF_PLAIN,
            "    before attention (write check, fold)", "  the written layers' calls (both paths)",
            COMPILED,
            "  after attention (audited rows copied)")


def _install(spent: dict[str, float], calls: dict[str, int], stages: list[tuple[str, str, str, str]],
             late: bool = False) -> None:
    """Time each of ``stages`` (``late``: only those in kvcanary's compiled loops' modules, else only
    the others)."""
    import importlib

    def timed(fn: Any, stage: str) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[stage] += time.perf_counter() - t
                calls[stage] += 1

        return wrapper

    for module, owner, attr, stage in stages:
        if module.startswith(LATE) != late or stage == WRAPPER:
            continue
        if not module:  # the compiled keep: each forward's plan holds it (numba loads with the engine, not before)
            from kvcanary.engines.vllm import wide

            made = wide.WideBase.keep_layer

            def entry(self: Any, _made: Any = made, _stage: str = stage) -> Any:  # each forward's plan's entry
                return timed(_made(self), _stage)

            wide.WideBase.keep_layer = entry  # type: ignore[method-assign]
            continue
        obj: Any = importlib.import_module(module)
        for part in filter(None, owner.split(".")):
            obj = getattr(obj, part)
        fn = getattr(obj, attr)

        def wrapper(*a: Any, _fn: Any = fn, _stage: str = stage, _method: bool = bool(owner), **k: Any) -> Any:
            t = time.perf_counter()
            inner = [0.0]
            plan = None
            if _stage == OFF_PLAIN:  # the engine's attention left out: attend(audit, plan, got, t0, original, ...),
                # or the plan's own attend(got, t0, ...), which calls the plan's ``original``
                original = a[0].original if _method else a[4]

                def attention(*aa: Any, **kk: Any) -> Any:
                    t1 = time.perf_counter()
                    try:
                        return original(*aa, **kk)
                    finally:
                        inner[0] += time.perf_counter() - t1

                if _method:
                    plan = a[0]
                    plan.original = attention
                else:
                    a = (*a[:4], attention, *a[5:])
            try:
                return _fn(*a, **k)
            finally:
                if plan is not None:
                    plan.original = original
                spent[_stage] += time.perf_counter() - t - inner[0]
                calls[_stage] += 1

        setattr(obj, attr, wrapper)


def child(cfg: dict[str, Any]) -> None:
    """One engine run with every stage timed; prints one RESULT line."""
    from kvcanary.faults import vllm_runner

    spent: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    stages = STAGES + (FINE if os.environ.get("VLLM_STAGES_FINE") == "1" else [])
    _install(spent, calls, stages)
    found = vllm_runner.process_canary

    def timed_from_here() -> Any:  # called between the warm-up generate and the timed one
        _install(spent, calls, stages, late=True)
        spent.clear()
        calls.clear()
        return found()

    vllm_runner.process_canary = timed_from_here
    out = vllm_runner.run(cfg)
    st = out["stats"]
    # the layers: the canary's clock (its hooks' and layers' seconds) less the timed hooks'
    spent[WRAPPER] = st["canary_us"] / 1e6 - sum(spent[s] for s in CANARY if s != WRAPPER)
    calls[WRAPPER] = calls[COMPILED] or calls[OFF_PLAIN]  # a call for each written layer
    print("RESULT " + json.dumps({"spent": spent, "calls": calls, "wall_s": out["generate_s"], "stats": st}),
          flush=True)


def run(cfg: dict[str, Any], threads: int, config: list[str], script: str = __file__) -> dict[str, Any]:
    """``script --child CFG_JSON`` (this one's :func:`child` by default) in a fresh process, in-process
    engine, ``threads`` intra-op threads, ``config`` (``KVCANARY_X=V``) its only canary variables:
    its ``RESULT`` line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
    env.update(kv.split("=", 1) for kv in config)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(threads))
    p = subprocess.run([sys.executable, os.path.abspath(script), "--child", json.dumps(cfg)], capture_output=True,
                       text=True, timeout=1200, env=env)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"{os.path.basename(script)}: the engine run failed:\n{p.stderr[-3000:]}")
    return dict(json.loads(line[len("RESULT "):]))


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="real", choices=("real", "tiny"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the real model's dtype (bench/vllm_cpu.py --dtype)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KVCANARY_X=V",
                    help="a configuration variable of the runs (default: none, the default configuration)")
    ap.add_argument("--fine", action="store_true",
                    help="also time the hooks' parts (FINE), printed after the stages; each timed call adds its own")
    ap.add_argument("--compiled", action="store_true",
                    help="vLLM's default model execution (torch.compile) instead of --enforce-eager")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    sys.path.insert(0, HERE)
    import tempfile

    if args.fine:
        os.environ["VLLM_STAGES_FINE"] = "1"  # the runs' processes time FINE too

    from vllm_cpu import real_workload

    from kvcanary.faults.vllm_runner import save_tiny_llama

    with tempfile.TemporaryDirectory(prefix="kvcanary-stages-") as tmp:
        ns = argparse.Namespace(requests=16 if args.model == "real" else 32, dtype=args.dtype)
        if args.model == "real":
            model, extra, name = real_workload(ns)
        else:
            model, extra, name = save_tiny_llama(tmp, layers=4, hidden=256, heads=4, kv_heads=2,
                                                 intermediate=768), {}, "llama layers=4 hidden=256"
        cfg = {"model": model, "canary": True, "requests": ns.requests, "max_tokens": 64 if args.model == "real"
               else 96, "max_seqs": 16, "num_blocks": 256, "warmup": 4, "eager": not args.compiled, **extra}
        bad = [kv for kv in args.set if not kv.startswith("KVCANARY_") or "=" not in kv]
        if bad:
            ap.error(f"--set: expected KVCANARY_NAME=VALUE, got {', '.join(bad)}")
        runs = [run(cfg, args.threads, args.set) for _ in range(args.runs)]
    forwards = sum(r["stats"]["forwards"] for r in runs)  # the timed generates' forwards
    shown = STAGES + (FINE if args.fine else [])
    spent = {s: sum(r["spent"].get(s, 0.0) for r in runs) for _, _, _, s in shown}
    calls = {s: sum(r["calls"].get(s, 0) for r in runs) for _, _, _, s in shown}
    total = sum(spent[s] for s in CANARY)
    print(f"vLLM CPU, {name}, {ns.requests} requests, OMP_NUM_THREADS={args.threads}, {args.runs} runs, "
          f"{forwards} timed forwards, {'compiled (torch.compile)' if args.compiled else 'eager'}")
    printed: set[str] = set()
    for i, (_, _, _, stage) in enumerate(shown):
        if i == len(STAGES):
            print("the hooks' parts (--fine; each nested in the stage above that calls it):")
        if stage in printed:  # a stage timed at two entries (the per-layer wrapper's)
            continue
        printed.add(stage)
        per_call = f"  {spent[stage] / max(calls[stage], 1) * 1e6:7.1f} us/call" if stage in PER_CALL else ""
        print(f"{stage:52s} {spent[stage] / forwards * 1e6:8.1f} us/forward  {spent[stage] / total:6.1%} "
              f"of the canary{per_call}")
    wall = statistics.median(r["wall_s"] for r in runs)
    share = statistics.median(r["stats"]["canary_us"] / 1e6 / r["wall_s"] for r in runs)
    st = runs[0]["stats"]
    print(json.dumps({"model": args.model, "forwards": forwards, "canary_us_per_forward": round(total / forwards * 1e6, 1),
                      "generate_s": round(wall, 3), "canary_share_of_generate": round(share, 4),
                      "forward_ms": round(1e3 * wall / max(st["forwards"], 1), 2),
                      "content_MiB_per_forward": round((st["content_bytes_verified"] + st["content_bytes_stamped"])
                                                       / 2**20 / max(st["forwards"], 1), 3),
                      "steps_kept": st.get("steps_kept"), "threads": args.threads, "set": args.set,
                      "compiled": args.compiled}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
