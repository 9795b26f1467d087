"""The write check and read audit's cost at the default configuration (every forward, within the
time budget) against the former one (every fourth forward, 4 queries), in one run, on transformers
continuous batching: the decode-heavy tiny model and the trained model.

Configurations, alternated within each round (a fresh protection per run, the same prompts):

- ``default``: ``CanaryConfig(mode="log")``: the write check and read audit on every forward, the
  read audit within ``audit_budget`` (1 % of the forward) with the full 64 queries in new situations;
- ``before``: the former defaults: ``audit_every=4, audit_queries=4, audit_budget=None``;
- ``noaudit``: ``write_check=False, audit_queries=0``: the canary without either.

Reported per configuration (medians over ``--rounds``): the canary's host time as a share of the run,
its time per forward, the queries audited per forward, and, from ``default`` minus ``noaudit``, the
audit's own share. Workloads: ``tiny`` is the demo's random model (4 layers, hidden 128), 16 requests,
96 new tokens; ``real`` is SmolLM2-135M-Instruct in bf16 (:mod:`kvcanary.real_model`), the demo's 8
questions twice over, 64 new tokens. One intra-op thread unless ``--threads``.

    python bench/audit_cost.py [--models tiny,real] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--models", default="tiny,real")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--requests", type=int, default=16)
ap.add_argument("--tokens", type=int, default=0, help="new tokens per request (0: 96 tiny, 64 real)")
ARGS = ap.parse_args()
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))

import torch  # noqa: E402

from kvcanary import CanaryConfig  # noqa: E402
from kvcanary.engines.transformers import cb_configs, protect, tiny_model  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from transformers_cb import prompts  # noqa: E402

CONFIGS = {
    "default": CanaryConfig(mode="log"),
    "before": CanaryConfig(mode="log", audit_every=4, audit_queries=4, audit_budget=None),
    "noaudit": CanaryConfig(mode="log", write_check=False, audit_queries=0),
}


def workload(name: str) -> tuple[Any, list[Any], Any, Any]:
    if name == "real":
        from kvcanary import real_model
        from kvcanary.real_model import QUESTIONS

        model, tok = real_model.load("bfloat16")
        ps = [real_model.chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(ARGS.requests)]
        gen, cbc = cb_configs(max_new_tokens=ARGS.tokens or 64, num_blocks=256, max_batch_tokens=256)
    else:
        model = tiny_model(seed=0, layers=4, hidden=128)
        ps = prompts(ARGS.requests, 8, (1, 4))
        gen, cbc = cb_configs(max_new_tokens=ARGS.tokens or 96, num_blocks=256, max_batch_tokens=256)
    return model, ps, gen, cbc


def run(model: Any, ps: list[Any], gen: Any, cbc: Any, cfg: CanaryConfig) -> dict[str, Any]:
    with torch.inference_mode(), protect(model, cfg) as guard:
        t = time.perf_counter()
        out = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cbc)
        wall = time.perf_counter() - t
    st = guard.stats()
    if st["violations"] or st["internal_errors"]:
        raise SystemExit(f"a {cfg} run reported {st['violations']} violations, {st['internal_errors']} internal errors")
    return {"wall_s": wall, "canary_s": guard.seconds, "forwards": guard.forwards,
            "queries": st.get("audit_queries", 0), "tokens": {k: o.generated_tokens for k, o in out.items()}}


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    for name in ARGS.models.split(","):
        model, ps, gen, cbc = workload(name)
        run(model, ps, gen, cbc, CONFIGS["default"])  # warm-up
        rows: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
        first = None
        for r in range(ARGS.rounds):
            for c, cfg in CONFIGS.items():
                got = run(model, ps, gen, cbc, cfg)
                first = first or got["tokens"]
                if got["tokens"] != first:
                    raise SystemExit(f"{name} {c}: other tokens than the first run")
                rows[c].append(got)
                print(json.dumps({"model": name, "round": r, "config": c,
                                  **{k: v for k, v in got.items() if k != "tokens"}}), flush=True)
        med = {c: {"share": statistics.median(x["canary_s"] / x["wall_s"] for x in xs),
                   "us_per_forward": statistics.median(1e6 * x["canary_s"] / x["forwards"] for x in xs),
                   "queries_per_forward": statistics.median(x["queries"] / x["forwards"] for x in xs),
                   "forward_ms": statistics.median(1e3 * x["wall_s"] / x["forwards"] for x in xs)}
               for c, xs in rows.items()}
        print(f"{name}: {ARGS.requests} requests, {ARGS.threads} thread(s), medians of {ARGS.rounds} rounds")
        for c, m in med.items():
            print(f"  {c:8s} canary {100 * m['share']:5.2f} % of the run  {m['us_per_forward']:8.1f} us/forward  "
                  f"{m['queries_per_forward']:6.2f} queries/forward  forward {m['forward_ms']:7.2f} ms")
        print(f"  the write check and read audit at the default: {100 * (med['default']['share'] - med['noaudit']['share']):.2f} "
              f"% of the run (before: {100 * (med['before']['share'] - med['noaudit']['share']):.2f} %)")
        print(json.dumps({"model": name, "summary": med}), flush=True)


if __name__ == "__main__":
    main()
