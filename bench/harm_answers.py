"""Harm as answers changed: every transformers fault class of the selftest on the trained model.

SmolLM2-135M-Instruct answers the demo's 8 chat questions (greedy, continuous batching on the CPU)
without the canary, then once per fault class in ``log`` mode (what a user is served) and once in
``repair`` mode, the fault injected at the same forward with the same seed
(:mod:`kvcanary.faults.answers`). For each class it counts the answers that differ from the clean
ones: in ``log`` mode, and in ``repair`` mode, where none may (a request ``repair`` fails after
``repair_limit`` repairs, with an error instead of text, is counted apart).

Prints one JSON line per class, seed and dtype on stdout, then a table on stderr. Exit status 1
when a class is not detected, a ``log`` answer changed without a detection, or ``repair`` served
another answer.

    python bench/harm_answers.py [--dtypes bfloat16,float32] [--seeds 1] [--classes bit_flip,...]
        [--audit-queries 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    from kvcanary.faults.answers import CLASSES, chat, run_class
    from kvcanary.faults.runner import FULL_AUDIT

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per class (default 1)")
    ap.add_argument("--classes", default=",".join(CLASSES), help=f"default: {','.join(CLASSES)}")
    ap.add_argument("--at", type=int, default=3, help="the forward each fault is injected at (default 3)")
    ap.add_argument("--audit-queries", type=int, default=FULL_AUDIT,
                    help=f"audited queries per forward (default {FULL_AUDIT}, the selftest's)")
    ap.add_argument("--default-audit", action="store_true",
                    help="the default write check and read audit instead (every forward, within the time budget)")
    args = ap.parse_args()
    if args.default_audit:
        args.audit_queries = None
    classes = args.classes.split(",")
    if set(classes) - set(CLASSES):
        ap.error(f"--classes: expected names of {list(CLASSES)}, got {sorted(set(classes) - set(CLASSES))}")
    rows = []
    t0 = time.perf_counter()
    for dtype in args.dtypes.split(","):
        c = chat(dtype)
        print(f"{dtype}: clean answers: {c.clean}", file=sys.stderr, flush=True)
        for name in classes:
            for seed in range(args.seeds):
                t = time.perf_counter()
                row = {"dtype": dtype, **run_class(c, name, seed, args.at, args.audit_queries),
                       "seconds": round(time.perf_counter() - t, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                print(f"  {name} seed {seed}: {brief(row)} ({row['seconds']} s)", file=sys.stderr, flush=True)
    print(f"\n{'dtype':9s} {'fault class':29s} {'seed':>4s} {'detected':>8s} {'log: changed':>12s} "
          f"{'undetected':>10s} {'harm':>5s} {'repair: changed':>15s} {'failed':>6s} {'repairs':>7s}", file=sys.stderr)
    for r in rows:
        if not r["applicable"]:
            print(f"{r['dtype']:9s} {r['fault']:29s} {r['seed']:4d} not applicable: {r['why']}", file=sys.stderr)
            continue
        lg, rp = r["log"], r["repair"]
        print(f"{r['dtype']:9s} {r['fault']:29s} {r['seed']:4d} {'yes' if lg['detected'] else 'NO':>8s} "
              f"{lg['answers_changed']:>10d}/8 {len(lg['changed_undetected']):>10d} {lg['harmful_tokens']:>5d} "
              f"{rp['answers_changed']:>13d}/8 {rp['failed']:>6d} {rp['repairs']:>7d}"
              + ("" if r["ok"] else "   <-- FAIL"), file=sys.stderr)
    bad = [r for r in rows if r["applicable"] and not r["ok"]]
    print(f"{len(rows)} runs in {time.perf_counter() - t0:.0f} s; "
          + (f"FAILED: {', '.join(r['dtype'] + ' ' + r['fault'] for r in bad)}" if bad else "all ok"), file=sys.stderr)
    return 1 if bad else 0


def brief(r: dict) -> str:
    if not r["applicable"]:
        return f"not applicable ({r['why']})"
    lg, rp = r["log"], r["repair"]
    return (f"{'detected' if lg['detected'] else 'NOT DETECTED'}; log {lg['answers_changed']} answer(s) changed "
            f"({len(lg['changed_undetected'])} undetected), repair {rp['answers_changed']} changed, "
            f"{rp['failed']} failed, {rp['repairs']} repairs")


if __name__ == "__main__":
    sys.exit(main())
