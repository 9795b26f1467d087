"""The read audit's compiled loop (:func:`kvcanary.fused.audit.check_forward`) on a trained model's
forwards: SmolLM2-135M-Instruct in bf16 (:mod:`kvcanary.real_model`) under transformers continuous
batching, 16 chat requests. The forwards 4 to 6 of a protected run (the read audit's full counts of
its first forwards) are each called again ``--repeat`` times with the same tables: the first call as
the engine makes it (after the model's forward: caches cold), then the mean of the repeats (caches
warm), with and without the queries (without: the write check alone), and each query's share.

    python bench/audit_loop.py [--threads 1] [--repeat 100]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--repeat", type=int, default=100)
ARGS = ap.parse_args()
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvcanary import CanaryConfig, real_model  # noqa: E402
from kvcanary.audit.tables import Q_POSITION, Q_START  # noqa: E402
from kvcanary.engines.transformers import cb_configs, protect  # noqa: E402
from kvcanary.fused import audit as fused_audit  # noqa: E402

CALLS = (4, 5, 6)


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    model, tok = real_model.load("bfloat16")
    ps = [real_model.chat_prompt(tok, real_model.QUESTIONS[i % len(real_model.QUESTIONS)]) for i in range(16)]
    gen, cbc = cb_configs(max_new_tokens=8, num_blocks=256, max_batch_tokens=256)
    original = fused_audit.check_forward
    calls = [0]
    rows: list[dict[str, Any]] = []

    def timed(*args: Any) -> Any:
        calls[0] += 1
        t = time.perf_counter()
        out = original(*args)
        cold = time.perf_counter() - t
        if calls[0] in CALLS:
            qt = args[5]
            took = []
            for queries in (qt, qt[:0]):
                call = (*args[:5], queries, *args[6:])
                t = time.perf_counter()
                for _ in range(ARGS.repeat):
                    original(*call)
                took.append((time.perf_counter() - t) / ARGS.repeat)
            n = len(qt)
            rows.append({"call": calls[0], "queries": n, "mean_positions": round(float(np.mean(
                qt[:, Q_POSITION] - qt[:, Q_START] + 1)), 1) if n else 0, "cold_ms": round(cold * 1e3, 3),
                "warm_ms": round(took[0] * 1e3, 3), "warm_writes_only_ms": round(took[1] * 1e3, 3),
                "warm_us_per_query": round((took[0] - took[1]) / max(n, 1) * 1e6, 2)})
        return out

    fused_audit.check_forward = timed
    try:
        with torch.inference_mode(), protect(model, CanaryConfig(mode="log")) as guard:
            model.generate_batch(ps, generation_config=gen, continuous_batching_config=cbc)
    finally:
        fused_audit.check_forward = original
    assert guard.stats()["violations"] == 0
    for r in rows:
        print(json.dumps({**r, "threads": ARGS.threads}))


if __name__ == "__main__":
    main()
