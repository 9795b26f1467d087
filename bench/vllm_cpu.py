"""Generation throughput of vLLM's CPU build with the canary off and on, in the same run.

Modes: ``off`` (no connector); ``null`` (a connector that does nothing,
:mod:`kvcanary.faults.null_connector`: what vLLM's connector path costs by itself, so ``on`` over
``null`` is the canary's share); ``on`` (the connector, default content budget:
KVCANARY_CONTENT_BUDGET_BYTES unset); ``on_noaudit`` (as ``on``, without the write check and read
audit: KVCANARY_WRITE_CHECK=0 KVCANARY_AUDIT_QUERIES=0, so ``x_off`` of ``on`` minus that of
``on_noaudit`` is the audit's added wall time); ``on_before`` (the write check and read audit as
they were before they ran on every forward: every fourth forward, 4 queries, no time budget); ``on_full`` (every read byte verified:
KVCANARY_CONTENT_BUDGET_BYTES=none); ``on_meta`` (metadata only: KVCANARY_CONTENT=none); ``on_noscan``
(no content window and no patrol: KVCANARY_CONTENT_BUDGET_BYTES=0 KVCANARY_PATROL_BUDGET_BYTES=0). ``--modes``
picks some (``off`` always runs). Engines run eager (``--enforce-eager``, as the tests do) unless
``--compiled`` gives them vLLM's default, the model compiled by torch.compile (its compile time
is part of the engine start, not timed). Every round runs each mode once, in that order in even rounds and
the reverse in odd ones (so a machine slowing down or speeding up over the bench weighs on every mode
alike), over ``--rounds`` rounds; each run is
a fresh vLLM engine in its own process (:func:`kvcanary.faults.vllm_runner.run_in_subprocess`: vLLM
keeps per-process globals). Only the generate call is timed: engine start and a 4-request warm-up
generate on other prompts are not (the canary's counters leave the warm-up out too).

Threads: the runs are in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0), where vLLM's own binding
(VLLM_CPU_OMP_THREADS_BIND, applied by its multiprocess executor to the worker it spawns) does not
apply and its CPU worker turns ``torch.set_num_threads`` into a no-op, so torch keeps the thread count
it started with. Each run gets ``OMP_NUM_THREADS=--threads``, and with ``--bind`` also
``OMP_PROC_BIND=true OMP_PLACES=cores`` (one OpenMP thread per core); ``threads`` in each line is what
torch reported after the run. The canary runs on the engine's thread, inside the connector's hooks.

Workloads (``--model``): ``tiny`` (default), a random Llama saved to a temporary folder (``--layers`` 4,
``--hidden`` 256, 4 heads of 64, 2 KV heads, MLP 3 x hidden, vocab 512, fp32); ``--requests`` 32
prompts on 3 shared 64-token prefixes plus 3 to 30 own tokens, ``--max-tokens`` 96 new tokens each.
``real``: SmolLM2-135M-Instruct (:mod:`kvcanary.real_model`; 30 layers, 3 KV heads of 64) in bf16 (``--dtype
float32``: in fp32, for a machine without AVX-512, whose emulated bf16 products make forwards ten times longer),
the demo's 8 chat questions under its system prompt, twice over (16 requests; the second ask of each
hits the prefix cache), 64 new tokens each (``--requests`` and ``--max-tokens`` override). Greedy, at
most 16 running, block size 32, prefix caching on. ``real`` needs the converted model: ``kvcanary
demo`` (or ``kvcanary.real_model.model_dir``) in the main environment converts it once. One JSON line per round and mode, then a summary table (medians; ``x_off`` is
the mode's median wall time over off's, from this run; ``x_off_pairs`` the median over rounds of the
mode's wall time over off's in the same round; ``cpu_x_off`` the same for the generate call's CPU
seconds, which another tenant's load on a shared machine does not add to). Exit status 1 if any run reported a
violation or an internal error, or generated other tokens than the first run.

    .venv-vllm/bin/python bench/vllm_cpu.py [--model tiny|real] [--dtype bfloat16|float32] [--rounds 3] [--threads 1] [--bind] [--modes off,on,on_noaudit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

from kvcanary.faults.vllm_runner import run_in_subprocess, save_tiny_llama

# mode -> KVCANARY_* variables of its run (None: no canary); every other KVCANARY_* variable is unset
MODES: dict[str, dict[str, str] | None] = {
    "off": None,
    "null": {},  # a connector that does nothing (kvcanary.faults.null_connector): vLLM's connector path alone
    "on": {},
    "on_noaudit": {"KVCANARY_WRITE_CHECK": "0", "KVCANARY_AUDIT_QUERIES": "0"},
    "on_before": {"KVCANARY_AUDIT_EVERY": "4", "KVCANARY_AUDIT_QUERIES": "4", "KVCANARY_AUDIT_BUDGET": "none"},
    "on_full": {"KVCANARY_CONTENT_BUDGET_BYTES": "none"},
    "on_meta": {"KVCANARY_CONTENT": "none"},
    # the stamps' fingerprints and the guard kept, no content window and no patrol (what reading cold cache costs)
    "on_noscan": {"KVCANARY_CONTENT_BUDGET_BYTES": "0", "KVCANARY_PATROL_BUDGET_BYTES": "0"},
}


SHORT = {"bfloat16": "bf16", "float32": "fp32"}  # the real model's dtypes (--dtype), as the lines name them


def run_mode(mode: str, model: str, args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    """One engine run of ``mode`` in its own process: the generate call's time and the canary's counters."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCANARY_")}
    env.update(MODES[mode] or {})
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(args.threads))
    if args.bind:
        env.update(OMP_PROC_BIND="true", OMP_PLACES="cores")
    cfg = {"model": model, "canary": MODES[mode] is not None, "requests": args.requests,
           "max_tokens": args.max_tokens, "max_seqs": 16, "num_blocks": 256, "warmup": 4, **extra}
    if mode == "null":
        from kvcanary.faults.null_connector import CONFIG

        cfg["kv_transfer_config"] = CONFIG
    return run_in_subprocess(cfg, env=env, timeout=1200)


def real_workload(args: argparse.Namespace) -> tuple[str, dict[str, Any], str]:
    """The trained model's directory, its runs' extra keys (dtype, chat prompts) and its name, for
    ``args.requests`` requests in ``args.dtype`` (bf16 where ``args`` has no ``dtype``: the scripts that
    take none run the model as the issue's figures do)."""
    from transformers import AutoTokenizer

    from kvcanary import real_model
    from kvcanary.real_model import QUESTIONS

    dtype = getattr(args, "dtype", "bfloat16")
    path = real_model.target_dir(dtype)
    if not real_model.is_converted(path):
        raise SystemExit(f"vllm_cpu.py --model real: expected the converted model at {path}; convert it once in "
                         f"the main environment: .venv/bin/python -m kvcanary demo (or "
                         f"kvcanary.real_model.model_dir('{dtype}'))")
    tok = AutoTokenizer.from_pretrained(path)
    asks = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
    return path, {"dtype": dtype, "prompt_ids": [real_model.chat_prompt(tok, q) for q in asks]}, \
        f"{real_model.NAME} {SHORT[dtype]}"


def line(rnd: int, mode: str, out: dict[str, Any]) -> dict[str, Any]:
    st = out.get("stats", {})
    wall = out["generate_s"]
    return {
        "round": rnd, "mode": mode, "wall_s": round(wall, 4), "cpu_s": round(out["generate_cpu_s"], 4),
        "tokens": out["tokens_generated"],
        "tok_per_s": round(out["tokens_generated"] / wall, 1), "threads": out["threads"],
        "forwards": st.get("forwards"), "canary_s": round(st.get("canary_us", 0) / 1e6, 4),
        "canary_share": round(st.get("canary_us", 0) / 1e6 / wall, 4),
        # the scheduler side's hooks (engine core, same process): outside canary_s
        "scheduler_s": round(st.get("scheduler_us", 0) / 1e6, 4),
        "slots_verified": st.get("slots_verified", 0), "content_bytes_verified": st.get("content_bytes_verified", 0),
        "content_slots_skipped": st.get("content_slots_skipped", 0), "violations": st.get("violations", 0),
        "internal_errors": st.get("internal_errors", 0), "audit_queries": st.get("audit_queries", 0),
        "write_slots_checked": st.get("write_slots_checked", 0),
    }


def summary(rows: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    """Per mode: medians over the rounds, and the median wall time over off's."""
    med = {m: statistics.median(r["wall_s"] for r in rows if r["mode"] == m) for m in modes}
    by = {(r["round"], r["mode"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows})

    def paired(m: str, key: str) -> float:
        return statistics.median(by[(k, m)][key] / by[(k, "off")][key] for k in rounds if by[(k, "off")][key] > 0)

    out = []
    for m in modes:
        mine = [r for r in rows if r["mode"] == m]
        out.append({
            "mode": m, "wall_s": round(med[m], 3), "x_off": round(med[m] / med["off"], 3),
            "x_off_pairs": round(paired(m, "wall_s"), 3),
            "cpu_s": round(statistics.median(r["cpu_s"] for r in mine), 3), "cpu_x_off": round(paired(m, "cpu_s"), 3),
            "tok_per_s": round(statistics.median(r["tok_per_s"] for r in mine), 1),
            "canary_s": round(statistics.median(r["canary_s"] for r in mine), 3),
            "canary_share": round(statistics.median(r["canary_share"] for r in mine), 3),
            "scheduler_s": round(statistics.median(r["scheduler_s"] for r in mine), 3),
            "added_s": round(med[m] - med["off"], 3),
            "slots_verified": int(statistics.median(r["slots_verified"] for r in mine)),
            "content_MiB_verified": round(statistics.median(r["content_bytes_verified"] for r in mine) / 2**20, 1),
            "violations": sum(r["violations"] + r["internal_errors"] for r in mine),
        })
    return out


def table(rows: list[dict[str, Any]]) -> None:
    cols = list(rows[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.rjust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).rjust(width[c]) for c in cols))


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each engine process")
    ap.add_argument("--bind", action="store_true", help="also OMP_PROC_BIND=true OMP_PLACES=cores")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--model", default="tiny", choices=("tiny", "real"))
    ap.add_argument("--requests", type=int, help="default 32 (tiny), 16 (real)")
    ap.add_argument("--max-tokens", type=int, help="default 96 (tiny), 64 (real)")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(SHORT),
                    help="the real model's dtype (default bfloat16; float32 where bf16 products are emulated)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--compiled", action="store_true",
                    help="vLLM's default model execution (torch.compile) instead of --enforce-eager")
    args = ap.parse_args()
    modes = ["off"] + [m for m in args.modes.split(",") if m != "off"]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: expected names of {', '.join(MODES)}, got {', '.join(bad)}")
    rows: list[dict[str, Any]] = []
    first: list[list[int]] | None = None  # the first run's tokens: every run must generate the same
    same = True
    real = args.model == "real"
    args.requests = args.requests or (16 if real else 32)
    args.max_tokens = args.max_tokens or (64 if real else 96)
    with tempfile.TemporaryDirectory(prefix="kvcanary-bench-vllm-") as tmp:
        if real:
            model, extra, name = real_workload(args)
        else:
            model, extra, name = tmp, {}, f"llama layers={args.layers} hidden={args.hidden}"
            save_tiny_llama(model, layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2,
                            intermediate=3 * args.hidden)
        extra["eager"] = not args.compiled
        for rnd in range(args.rounds):
            for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                out = run_mode(mode, model, args, extra)
                rows.append({**line(rnd, mode, out), "model": args.model})
                print(json.dumps(rows[-1]), flush=True)
                tokens = sorted(out["tokens"].values())
                first = first or tokens
                same = same and tokens == first
    print(f"\nvLLM CPU, {name}, {args.requests} requests x "
          f"{args.max_tokens} new tokens, OMP_NUM_THREADS={args.threads}{' bound' if args.bind else ''}, "
          f"{args.rounds} rounds, {'compiled (torch.compile)' if args.compiled else 'eager'}; medians; tokens "
          f"identical in every run: {same}")
    sums = summary(rows, modes)
    table(sums)
    return 0 if same and all(s["violations"] == 0 for s in sums) else 1


if __name__ == "__main__":
    sys.exit(main())
