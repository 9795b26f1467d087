"""What the canary costs SGLang's CPU engine: generation wall time with the canary off and on, in
the same run, and the canary's own host time.

Each run is a fresh ``sgl.Engine`` (torch-native attention, no CUDA graph, overlap scheduler off, as
the adapter's tests run it) started with ``KVCANARY_MODE`` unset (``off``) or set to ``log``
(``on``: every default; ``on_noaudit``: without the write check and read audit). Every round runs
each mode once, in that order in even rounds and the reverse in odd ones, so a machine slowing down
or speeding up weighs on every mode alike. Only the generate call is timed: engine start and a
warm-up generate on other prompts are not. The canary's host time over the timed call comes from
its counters in the scheduler process (``canary_us``, read through the tests' control plugin,
tests_sglang/control/, which also says the forwards and what was verified).

Workloads (``--model``): ``real`` (default), SmolLM2-135M-Instruct (:mod:`kvcanary.real_model`, 30
layers, 3 KV heads of 64) in bf16: the demo's 8 chat questions under its system prompt, twice over
(16 requests; the second ask of each hits the radix cache), 64 new tokens each; ``tiny``, the tests'
random 2-layer Llama (fp16), 16 prompts on 2 shared 32-token prefixes, 96 new tokens. Greedy,
``ignore_eos``. ``real`` needs the converted model: ``kvcanary demo`` (or
``kvcanary.real_model.model_dir``) in the main environment converts it once.

Threads: the scheduler process is started with ``OMP_NUM_THREADS=--threads`` (default 1), which its
torch reads at start; the canary runs on the scheduler's thread.

One JSON line per round and mode, then medians: ``x_off`` the mode's median wall over off's,
``x_off_pairs`` the median over rounds of the mode's wall over off's in the same round, and
``canary_share`` the canary's host time over the timed generate call's wall. Exit status 1 if any
run reported a violation or an internal error, or generated other tokens than the first off run.

    .venv-sglang/bin/python bench/sglang_cost.py [--model real|tiny] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests_sglang")
MODES: dict[str, dict[str, str] | None] = {
    "off": None,
    "on": {"KVCANARY_MODE": "log"},
    "on_noaudit": {"KVCANARY_MODE": "log", "KVCANARY_WRITE_CHECK": "0", "KVCANARY_AUDIT_QUERIES": "0"},
}
ENGINE = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True, disable_overlap_schedule=True,
              random_seed=0, log_level="error")


def workload(args: argparse.Namespace, where: str) -> tuple[str, dict[str, Any], list[list[int]], list[list[int]]]:
    """The model's path, its engine arguments, the timed prompts and the warm-up prompts."""
    if args.model == "tiny":
        from tiny_model import make_tiny_llama

        path = make_tiny_llama(os.path.join(where, "tiny-llama"))
        heads = [list(range(100 + 40 * k, 132 + 40 * k)) for k in range(2)]
        prompts = [heads[i % 2] + [300 + i, 400 + i, 500 + i] for i in range(16)]
        warm = [[7 + i, 8, 9] for i in range(4)]
        return path, {"max_total_tokens": 4096}, prompts, warm
    from transformers import AutoTokenizer

    from kvcanary import real_model
    from kvcanary.real_model import QUESTIONS

    path = real_model.target_dir("bfloat16")
    if not real_model.is_converted(path):
        raise SystemExit(f"sglang_cost.py --model real: expected the converted model at {path}; convert it once in "
                         f"the main environment: .venv/bin/kvcanary demo (or kvcanary.real_model.model_dir('bfloat16'))")
    tok = AutoTokenizer.from_pretrained(path)
    asks = (QUESTIONS * 2)[:16]
    prompts = [real_model.chat_prompt(tok, q) for q in asks]
    warm = [real_model.chat_prompt(tok, q, system="You are terse.") for q in QUESTIONS[:4]]
    return path, {"dtype": "bfloat16", "max_total_tokens": 8192}, prompts, warm


def run(mode: str, path: str, extra: dict[str, Any], prompts: list[list[int]], warm: list[list[int]],
        args: argparse.Namespace, where: str) -> dict[str, Any]:
    from engine_env import start

    control = os.path.join(where, f"control-{mode}-{time.monotonic_ns()}")
    os.makedirs(control)
    env = {"OMP_NUM_THREADS": str(args.threads), "SGLANG_USE_CPU_ENGINE": "1"}
    if MODES[mode] is not None:
        env.update(MODES[mode] or {})
        env.update({"KVCANARY_TEST_CONTROL": control, "KVCANARY_VIOLATIONS_LOG": os.path.join(control, "v.jsonl"),
                    "PYTHONPATH": os.path.join(TESTS, "control") + os.pathsep + os.environ.get("PYTHONPATH", "")})
    eng = start(path, env, "KVCANARY_", **ENGINE, **extra)  # only this mode's KVCANARY_* variables
    params = {"temperature": 0, "max_new_tokens": args.max_tokens, "ignore_eos": True}
    try:
        eng.generate(input_ids=warm, sampling_params={**params, "max_new_tokens": 4})
        before = _state(control)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        time.sleep(0.05)
        eng.generate(input_ids=[[5, 6]], sampling_params={**params, "max_new_tokens": 1})  # the state after it
        after = _state(control)
    finally:
        eng.shutdown()
    line: dict[str, Any] = {"mode": mode, "wall_s": round(wall, 4), "tokens": [o["output_ids"] for o in outs]}
    if after is not None and before is not None:
        d = {k: after["stats"].get(k, 0) - before["stats"].get(k, 0) for k in after["stats"]}
        line.update(canary_s=round(d["canary_us"] / 1e6, 4), forwards=d["forwards"],
                    slots_verified=d["slots_verified"], write_slots_checked=d.get("write_slots_checked", 0),
                    audit_queries=d.get("audit_queries", 0), violations=after["stats"]["violations"],
                    internal_errors=after["stats"]["internal_errors"])
        line["canary_share"] = round(line["canary_s"] / wall, 4)
    return line


def _state(control: str) -> dict[str, Any] | None:
    f = os.path.join(control, "state.json")
    if not os.path.exists(f):
        return None
    with open(f) as fh:
        return json.load(fh)  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="real", choices=("real", "tiny"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, help="default 64 (real), 96 (tiny)")
    ap.add_argument("--modes", default="off,on,on_noaudit")
    args = ap.parse_args()
    args.max_tokens = args.max_tokens or (64 if args.model == "real" else 96)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r}; expected some of {', '.join(MODES)}")
    if "off" not in modes:
        modes.insert(0, "off")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    sys.path.insert(0, os.path.join(TESTS, "control"))  # spawned schedulers find plugins on this path
    sys.path.insert(0, TESTS)  # engine_env, tiny_model
    where = tempfile.mkdtemp(prefix="kvcanary-sglang-cost-")
    path, extra, prompts, warm = workload(args, where)
    print(f"# sglang_cost: {args.model} ({path}), {len(prompts)} requests x {args.max_tokens} tokens, "
          f"{args.rounds} rounds, OMP_NUM_THREADS={args.threads}", file=sys.stderr)
    lines: list[dict[str, Any]] = []
    ok = True
    ref: list[list[int]] | None = None
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            print(f"# round {r + 1}/{args.rounds}: {mode} ...", file=sys.stderr, flush=True)
            line = run(mode, path, extra, prompts, warm, args, where)
            line["round"] = r
            tokens = line.pop("tokens")
            if mode == "off" and ref is None:
                ref = tokens
            line["same_tokens"] = tokens == ref
            ok &= line["same_tokens"] and not line.get("violations") and not line.get("internal_errors")
            lines.append(line)
            print(json.dumps(line), flush=True)
    off = [x["wall_s"] for x in lines if x["mode"] == "off"]
    print(f"\n{'mode':<12} {'wall_s':>8} {'x_off':>7} {'x_off_pairs':>11} {'canary_share':>12}")
    for mode in modes:
        mine = [x for x in lines if x["mode"] == mode]
        wall = statistics.median(x["wall_s"] for x in mine)
        pairs = statistics.median(x["wall_s"] / o for x, o in zip(mine, off))
        share = statistics.median(x["canary_share"] for x in mine) if "canary_share" in mine[0] else 0.0
        print(f"{mode:<12} {wall:>8.3f} {wall / statistics.median(off):>7.3f} {pairs:>11.3f} {share:>12.4f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
