"""Randomized clean fuzz of transformers continuous batching under the canary in raise mode.

Each configuration crosses a model (tiny random-weight Llama, Mistral, Qwen2/Gemma2/Gemma3/GPT-OSS/Cohere2
hybrids, or the trained SmolLM2-135M-Instruct, ``smollm2``, bfloat16 mostly, prompted with real
text) with forks, sampling, tight memory, CPU offloading, a warm persistent manager, shared
prefixes and chunked prefill (``kvcanary.faults.cb_soak``), and runs without and with the canary.
A clean engine must give zero violations, zero internal errors, no failed request, no exception and
the same tokens. Prints progress per configuration on stderr, one JSON line per configuration and
a final JSON summary on stdout; writes nothing else. Exit status 1 when any configuration failed.

    python bench/transformers_fuzz.py [--configs 50] [--seed 7]
    python bench/transformers_fuzz.py --models smollm2 --configs 12   # the trained model only
    python bench/transformers_fuzz.py --seed 7 --only 3            # rerun the 4th configuration alone
    python bench/transformers_fuzz.py --config '{"seed": 1, "arch": "gemma2", "forks": 2, "sample": true}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

from kvcanary.faults.cb_soak import MODELS, CbConfig, draw_configs, failure, soak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--only", type=int, help="run only the configuration of this index in the seed's draw")
    ap.add_argument("--config", help="run one configuration given as the JSON of CbConfig's fields")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated models to draw from (default all: {','.join(MODELS)})")
    args = ap.parse_args()
    models = args.models.split(",")
    if set(models) - set(MODELS):
        ap.error(f"--models: expected names of {list(MODELS)}, got {sorted(set(models) - set(MODELS))}")
    configs = draw_configs(args.configs, args.seed, models)
    if args.only is not None:
        configs = draw_configs(args.only + 1, args.seed, models)[args.only:]
    elif args.config is not None:
        configs = [CbConfig(**json.loads(args.config))]
    total = len(configs)
    t0 = time.perf_counter()
    out = sys.stdout

    def progress(k: int, res: dict[str, Any]) -> None:
        verdict = "ok" if res["ok"] else f"FAILED: {failure(res)}"
        print(f"[{k + 1}/{total}] {res['label']}: {res['forwards']} forwards, {verdict} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        print(json.dumps(res), file=out, flush=True)

    with contextlib.redirect_stdout(sys.stderr):  # what the engine prints (a failed generate_batch does)
        agg = soak(args.configs, args.seed, progress, configs)
    agg["seed"], agg["models"], agg["wall_s"] = args.seed, models, round(time.perf_counter() - t0, 1)
    print(json.dumps({"summary": agg}), file=out, flush=True)
    return 1 if agg["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
