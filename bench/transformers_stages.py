"""Where a protected transformers forward's canary time goes, stage by stage, inside a live
continuous-batching run: each stage's time per forward and its share of the canary's time, stages
nested as the adapter calls them. ``--model tiny`` (default): the demo's random model, 16 requests,
decode-heavy; ``--model real``: SmolLM2-135M-Instruct (:mod:`kvcanary.real_model`) in bf16, the demo's
8 chat questions twice over (16 requests), 64 new tokens each, greedy.

    python bench/transformers_stages.py [--model tiny|real] [--threads 1] [--runs 3] [--backend fused] [--fine]

A stage's time includes its callees (a canary hook includes its compiled call); the two hook totals
are the canary's time but for what it does inside each layer (taking references to its K and V in
the cache update, and passing the attention on or keeping its audited rows, twice a layer: the
direct paths of :mod:`kvcanary.engines.transformers.hooks`), which the line "inside the layers" gives (the
canary's own count of it, ``layer_seconds`` of its audit). The last line's ``canary_us_per_forward`` and
``canary_share_of_run`` are the canary's own counter (``canary_us`` of its stats: the hooks and the
per-layer work), ``hooks_us_per_forward`` the two hooks' sum as timed here; shares are of the
counter. ``first_run``: the same counter for the process's first protected run (the warm-up, left
out of the rest), where a lazily loaded or compiled loop would show. ``steady_share``: the canary's
share over each measured run's forwards from the 11th on (the wall time between those forwards' ends),
against ``first_10_forwards_ms``, the canary's milliseconds in each run's first 10 forwards (the new
pool's setup, the prefill, the read audit's full counts of its first forwards): what a long-running
engine pays, beside what this short run pays. Each wrapped call adds about a microsecond of its own. ``--fine`` also times the hooks' parts (each nested under the stage that
calls it; a part called from several stages is listed once, under the first). ``KVCANARY_*`` variables
set in the environment change the canary's configuration (the last line's ``config`` says which).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Any

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--backend", default="fused")
ap.add_argument("--model", default="tiny", choices=("tiny", "real"))
ap.add_argument("--fine", action="store_true", help="also time the hooks' parts")
ARGS = ap.parse_args()
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))

import torch  # noqa: E402

from kvcanary import CanaryConfig  # noqa: E402
from kvcanary.canary import Canary  # noqa: E402
from kvcanary.engines import transformers as cb  # noqa: E402
from kvcanary.engines.transformers import audit as cb_audit  # noqa: E402
from kvcanary.engines.transformers import entry as cb_entry  # noqa: E402
from kvcanary.engines.transformers import cb_configs, protect, tiny_model  # noqa: E402
from kvcanary.engines.audit import EngineAudit  # noqa: E402
from kvcanary.fused import _step as fused_step  # noqa: E402
from kvcanary.fused import audit as fused_audit  # noqa: E402
from kvcanary.fused.forward import ForwardArgs  # noqa: E402
from kvcanary.harm import HarmCounter  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from transformers_cb import prompts  # noqa: E402

spent: dict[str, float] = collections.defaultdict(float)
# (owner, attribute, stage name): the before hook and its parts, then the after hook and its parts
STAGES = [
    (cb.Protection.before, "__wrapped__", "before-forward hook"),
    (cb.Protection, "build_steps", "  step building"),
    (cb_entry, "padding_writes", "  padding writes"),
    (cb.Protection, "verify_first_reads", "  first reads"),
    (HarmCounter, "forward", "  harm counter"),
    (Canary, "before_forward", "  canary.before_forward (verify)"),
    (cb_audit.CbAudit, "begin", "  audit plan"),
    (cb.Protection.after_forward, "__wrapped__", "after-forward hook"),
    (cb_audit.CbAudit, "finish", "  audit checks"),
    (Canary, "after_forward", "  canary.after_forward (stamp, guard, patrol)"),
    (cb.Protection, "poll", "  poll (drain, report)"),
    (cb.Protection, "publish_metrics", "  metrics"),
]
# --fine: the hooks' parts (the compiled loops' entries called where the stages above call them)
FINE = [
    (EngineAudit, "sample", "  audit: queries sampled"),
    (EngineAudit, "start", "  audit: forward's results allocated"),
    (cb_audit.CbAudit, "_plan_fused", "  audit: query table and floats"),
    (cb_audit.CbAudit, "_run", "  audit: the one call's tables and records"),
    (fused_step, "describe", "    step descriptors for the one call"),
    (EngineAudit, "run_compiled", "    the one call and its records"),
    (fused_audit, "check_forward", "      the one call's compiled loop"),
    (EngineAudit, "drain", "  audit results drained"),
    (EngineAudit, "end", "  audit forward ended (budget)"),
    (Canary, "_described", "  step descriptors (verify and stamp)"),
    (ForwardArgs, "before", "  compiled verify"),
    (ForwardArgs, "after", "  compiled stamp, guard, patrol"),
    (Canary, "drain", "  canary violations drained"),
]


def timed(owner: Any, attr: str, stage: str) -> None:
    fn = getattr(owner, attr)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[stage] += time.perf_counter() - t

    setattr(owner, attr, wrapper)


ENDS: list[tuple[float, float]] = []  # (the canary's seconds, the wall clock) at each forward's end, this run


def _at_each_end() -> None:
    """Record the canary's seconds and the wall clock at the end of each forward (``ENDS``)."""
    after = cb.Protection.after

    def wrapper(self: Any, steps: Any) -> None:
        after(self, steps)
        ENDS.append((self.seconds, time.perf_counter()))

    cb.Protection.after = wrapper


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    _at_each_end()
    steady = [0.0, 0.0]  # the canary's seconds and the wall time from each run's 11th forward on
    first10 = 0.0
    stages = STAGES + (FINE if ARGS.fine else [])
    for owner, attr, stage in stages:
        timed(owner, attr, stage)
    if ARGS.model == "real":
        from kvcanary import real_model
        from kvcanary.real_model import QUESTIONS

        model, tok = real_model.load("bfloat16")
        ps = [real_model.chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(16)]
        gen, cbc = cb_configs(max_new_tokens=64, num_blocks=256, max_batch_tokens=256)
    else:
        model = tiny_model(seed=0, layers=4, hidden=128)
        ps = prompts(16, 8, (1, 4))
        gen, cbc = cb_configs(max_new_tokens=96, num_blocks=256, max_batch_tokens=256)
    cfg = CanaryConfig.from_env(CanaryConfig(mode="log", backend=ARGS.backend))  # KVCANARY_* variables apply
    forwards = 0
    wall = own = inside = 0.0
    first: dict[str, float] = {}
    for run in range(ARGS.runs + 1):  # the first run warms up
        if run == 1:
            spent.clear()
        ENDS.clear()
        with torch.inference_mode(), protect(model, cfg) as guard:
            t = time.perf_counter()
            model.generate_batch(ps, generation_config=gen, continuous_batching_config=cbc)
            took = time.perf_counter() - t
            if run:
                wall += took
                forwards += guard.forwards
                own += guard.stats()["canary_us"] / 1e6
                inside += guard.audit.layer_seconds
                if len(ENDS) > 11:
                    steady[0] += ENDS[-1][0] - ENDS[10][0]
                    steady[1] += ENDS[-1][1] - ENDS[10][1]
                    first10 += ENDS[9][0]
            else:  # the process's first protected run: what an engine's first requests pay
                mine = guard.stats()["canary_us"] / 1e6
                first = {"canary_us_per_forward": round(mine / max(guard.forwards, 1) * 1e6, 1),
                         "canary_share_of_run": round(mine / took, 4), "forward_ms": round(1e3 * took / max(guard.forwards, 1), 2)}
        assert guard.stats()["violations"] == 0 and guard.stats()["internal_errors"] == 0
    total = spent["before-forward hook"] + spent["after-forward hook"]
    for _, _, stage in stages:
        if ARGS.fine and stage == FINE[0][2]:
            print("the hooks' parts (--fine; each nested in the stage above that calls it):")
        print(f"{stage:48s} {spent[stage] / forwards * 1e6:8.1f} us/forward  {spent[stage] / own:6.1%} of the canary")
    print(f"{'inside the layers (the per-layer hooks)':48s} {inside / forwards * 1e6:8.1f} us/forward  "
          f"{inside / own:6.1%} of the canary")
    print(json.dumps({"forwards": forwards, "canary_us_per_forward": round(own / forwards * 1e6, 1),
                      "canary_share_of_run": round(own / wall, 4), "hooks_us_per_forward": round(total / forwards * 1e6, 1),
                      "forward_ms": round(1e3 * wall / forwards, 2), "first_run": first,
                      "steady_share": round(steady[0] / steady[1], 4) if steady[1] else None,
                      "first_10_forwards_ms": round(1e3 * first10 / ARGS.runs, 2),
                      "threads": ARGS.threads, "backend": ARGS.backend, "model": ARGS.model,
                      "config": sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("KVCANARY_"))}))


if __name__ == "__main__":
    main()
