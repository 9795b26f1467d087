"""The canary's cost per decode forward of the demo model, inside a live continuous-batching run.

Times the adapter's before-forward hook (building the layer groups' steps from the batch metadata,
then verifying every read) and after-forward hook (stamping the writes, polling) of every forward
whose rows all decode one token, and prints the medians per backend, all in one run (the backends
alternate). The demo model: 4 layers, K and V of 512 B per token each (8 sources), 16 requests.

    python bench/decode_forward.py [--threads 1] [--repeats 3] [--backends torch,fused,fused:nopatrol]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--backends", default="torch,fused,fused:nopatrol",
                help="backends to compare; ':nopatrol' turns the patrol scrub off (its cost is the difference)")
ap.add_argument("--new-tokens", type=int, default=64)
ARGS = ap.parse_args()
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))

import torch  # noqa: E402

from kvcanary import CanaryConfig  # noqa: E402
from kvcanary.engines import transformers as cb  # noqa: E402
from kvcanary.engines.transformers import cb_configs, protect, tiny_model  # noqa: E402
from kvcanary.engines.transformers.hooks import host_io  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from transformers_cb import prompts  # noqa: E402


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    model = tiny_model(seed=0, layers=4, hidden=128)
    ps = prompts(16, 8, (1, 4))
    gen, cbc = cb_configs(max_new_tokens=ARGS.new_tokens, num_blocks=256, max_batch_tokens=256)
    times: dict[str, dict[str, list[float]]] = {b: {"before": [], "after": [], "reads": []}
                                                for b in ARGS.backends.split(",")}
    # the hooks' bodies (kvcanary.engines.base.hook calls each body through its __wrapped__)
    orig_before, orig_after = cb.Protection.before.__wrapped__, cb.Protection.after_forward.__wrapped__
    now: dict[str, object] = {}

    def before(self, runner, batch):  # type: ignore[no-untyped-def]
        reqs = list(host_io(runner.inputs_and_outputs).requests_in_batch)
        decode = bool(reqs) and all(fs.query_length == 1 for fs in reqs) and self.forwards > 0
        t = time.perf_counter()
        steps = orig_before(self, runner, batch)
        dt = time.perf_counter() - t
        now["decode"] = decode and steps is not None
        if now["decode"]:
            rec = times[str(now["backend"])]
            rec["before"].append(dt)
            rec["reads"].append(sum(int((s.cached_lens - s.starts()).sum()) for s in steps.values()))
        return steps

    def after(self, steps):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        orig_after(self, steps)
        if now.get("decode"):
            times[str(now["backend"])]["after"].append(time.perf_counter() - t)

    cb.Protection.before.__wrapped__, cb.Protection.after_forward.__wrapped__ = before, after
    try:
        for rep in range(ARGS.repeats + 1):  # the first round warms up (compilation, caches)
            for b in times:
                now["backend"] = b
                n = {k: len(v) for k, v in times[b].items()}
                name, _, opt = b.partition(":")
                cfg = CanaryConfig(mode="log", backend=name, patrol_budget_bytes=0 if opt == "nopatrol" else "auto")
                with torch.inference_mode(), protect(model, cfg) as guard:
                    model.generate_batch(ps, generation_config=gen, continuous_batching_config=cbc)
                assert guard.stats()["violations"] == 0 and guard.stats()["internal_errors"] == 0
                if rep == 0:
                    for k in times[b]:
                        del times[b][k][n[k]:]
    finally:
        cb.Protection.before.__wrapped__, cb.Protection.after_forward.__wrapped__ = orig_before, orig_after
    out = {}
    for b, rec in times.items():
        bef, aft = statistics.median(rec["before"]) * 1e6, statistics.median(rec["after"]) * 1e6
        both = statistics.median(x + y for x, y in zip(rec["before"], rec["after"])) * 1e6
        out[b] = both
        print(json.dumps({"backend": b, "decode_forwards": len(rec["before"]),
                          "read_slots_median": statistics.median(rec["reads"]), "before_us": round(bef, 1),
                          "after_us": round(aft, 1), "before_plus_after_us": round(both, 1),
                          "threads": ARGS.threads}), flush=True)
    if "torch" in out:
        print(json.dumps({"speedup_vs_torch": {b: round(out["torch"] / v, 2) for b, v in out.items()}}), flush=True)


if __name__ == "__main__":
    main()
