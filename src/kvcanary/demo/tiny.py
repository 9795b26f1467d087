"""The demo on a tiny random-weight Llama in transformers continuous batching (``--model tiny``):
nothing downloaded; the answers are noise, the canary's work is the same."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

from kvcanary.config import CanaryConfig
from kvcanary.demo.common import caused_by, coverage, pool_fits, print_summary, setup_time


def _prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts drawn from a few shared prefixes plus a random tail."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(16, 40))] for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(2, 16))] for _ in range(n)]



def run(args: argparse.Namespace, config: CanaryConfig) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("kvcanary demo needs transformers: pip install 'kvcanary[transformers]' "
              "(or run `kvcanary demo --engine scripted`)", file=sys.stderr)
        return 2
    import logging

    import torch

    from kvcanary.engines.transformers.entry import protect
    from kvcanary.engines.transformers.models import cb_configs, tiny_model
    from kvcanary.faults.transformers_cb import CbFault

    # the tiny model: K and V of 4 heads of 32 fp32 channels a layer
    too_big = pool_fits(args, args.layers * 2 * 4 * 32 * 4 + 56,
                         f"K and V of {args.layers} layers and the canary's 56 bytes")
    if too_big:
        print(f"kvcanary demo: {too_big}", file=sys.stderr)
        return 2
    model = tiny_model(seed=args.seed, layers=args.layers)
    prompts = _prompts(args.requests, args.seed)
    gen, cb = cb_configs(max_new_tokens=args.max_new_tokens, num_blocks=args.blocks)

    def generate(progress: bool) -> tuple[dict, float]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=progress and not args.json)
        return out, time.perf_counter() - t0

    generate(False)  # warm the allocator and kernels so both timed runs start equal
    if not args.json:
        print("without the canary:", file=sys.stderr)
    base, t_off = generate(True)  # both timed runs draw the same progress bar
    setup = setup_time(config)
    if not args.json:
        print("with the canary:", file=sys.stderr)
    with protect(model, config) as guard:
        out, t_on = generate(True)
    same = all(base[k].generated_tokens == out[k].generated_tokens for k in base)
    st = guard.stats()
    summary: dict[str, object] = {
        "engine": f"transformers {transformers.__version__} continuous batching (CPU, tiny random Llama)",
        "requests": len(prompts),
        "tokens_generated": sum(len(o.generated_tokens) for o in out.values()),
        "forwards": st["forwards"],
        "slots_verified": st["slots_verified"],
        "slots_stamped": st["slots_stamped"],
        "content_bytes_checked": st["content_bytes_verified"] + st["content_bytes_stamped"],
        "slots_unverifiable": st["slots_unverifiable"],  # read but never seen written (counted, not checked)
        "write_slots_checked": st.get("write_slots_checked", 0),  # new tokens' K/V against the cache, per layer
        "attention_queries_audited": st.get("audit_queries", 0),  # recomputed from the verified KV
        **coverage(st),
        "violations": st["violations"],
        "internal_errors": st["internal_errors"],
        "outputs_identical": same,
        "wall_s_without_canary": round(t_off, 3),
        "wall_s_with_canary": round(t_on, 3),
        "canary_time_s": round(st["canary_us"] / 1e6, 3),  # host time inside the canary's hooks
        # the canary's own host time as a share of the run with it: one pair of runs' wall-time
        # difference swings by tens of percent between identical runs on a shared machine
        "canary_share_pct": round(100 * st["canary_us"] / 1e6 / t_on, 1),
        "canary_ms_per_forward": round(st["canary_us"] / 1e3 / max(st["forwards"], 1), 2),
        "setup_s": round(setup, 3),  # one-time: the canary's compiled loops loaded (compiled, the first time)
    }
    ok = same and st["violations"] == 0 and st["internal_errors"] == 0
    if args.inject:
        quiet, level = logging.getLogger("kvcanary"), logging.getLogger("kvcanary").level
        quiet.setLevel(logging.ERROR)  # the report below lists the detections
        faults = [CbFault("flip_shared_byte", at=3, seed=args.seed),
                  CbFault("redirect_table_entry", at=5, seed=args.seed + 1),
                  CbFault("free_shared_block", at=7, seed=args.seed + 2)]
        # every read slot's content is verified in this run, so a flipped byte is found on its next read
        import tempfile

        from kvcanary import report

        logfile = config.violations_log or os.path.join(tempfile.mkdtemp(prefix="kvcanary-demo-"), "violations.jsonl")
        try:
            with protect(model, replace(config, content_budget_bytes=None, violations_log=logfile)) as guard:
                guard.hooks.extend(faults)
                generate(False)
        finally:
            quiet.setLevel(level)
        page = os.path.splitext(logfile)[0] + ".html"
        rs = report.summarize(report.read(logfile)) if os.path.exists(logfile) else report.summarize([])
        with open(page, "w", encoding="utf-8") as fh:
            fh.write(report.html_page(rs, logfile))
        summary["report"] = {"log": logfile, "html": page, "headline": report.headline(rs),
                             "command": f"kvcanary report {logfile} --html {page}"}
        found = []
        for f in faults:
            hits = [v for v in guard.violations if f.landed_at is not None and v.step >= f.landed_at
                    and caused_by(f, v, guard)]
            first = hits[0] if hits else None
            found.append({"fault": f.name, "injected_at_forward": f.injected_at, "detail": f.detail,
                          "detected": first is not None,
                          "first_detection": guard.describe(first) if first else None})
            ok = ok and first is not None
        summary["injected"] = found
    print_summary(summary, "forward", args.json)
    return 0 if ok else 1

