"""``kvcanary selftest``: every fault class injected (into vLLM too where it is installed), the
detection matrix printed, then a clean soak."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from kvcanary.config import CanaryConfig
from kvcanary.demo.common import coverage


def run(args: argparse.Namespace) -> int:
    CanaryConfig.from_env()  # the vLLM rows' workers read KVCANARY_*: a bad value is a usage error, up front
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    engines = _selftest_engines(args, say)
    rows = _catalog_rows(engines, args.seeds, say)
    if "vllm" in engines:  # vLLM's faults are its own injectors: their rows follow the catalog's
        from kvcanary.faults import vllm_runner

        for spec, results in vllm_runner.selftest(args.seeds, say):
            rows.append({**_row(spec.name, spec.zoo, "detect", "vllm", spec.max_forwards, results),
                         "reproduces": spec.reproduces or None})
    ok = all(r["status"] != "FAIL" for r in rows)
    soak = _soak(args.soak, say)
    ok = ok and soak["false_positives"] == 0
    if args.json:
        print(json.dumps({"ok": ok, "matrix": rows, "soak": soak}))
        return 0 if ok else 1
    head = (f"{'fault':<30} {'zoo':<15} {'expected':<16} {'engine':<13} {'detected':<9} {'fwd':<5} {'harm':<5} "
            f"checks fired")
    print(head)
    print("-" * len(head))
    for r in rows:
        det = f"{r['detected']}/{r['runs']}" if r["runs"] else "-"
        fwd_s = "-" if r["forwards_max"] is None else str(r["forwards_max"])
        harm = ("-" if r.get("harmful_reads_max") is None else str(r["harmful_reads_max"])) if r.get(
            "harmful_tokens_max") is None else f"{r['harmful_tokens_max']}t"  # engine rows: tokens
        fired = ",".join(r["checks_fired"]) or (  # type: ignore[arg-type]
            str(r.get("why", "")) if r["status"] in ("miss", "not run") else "")
        zoo = ",".join(r["zoo"])  # type: ignore[arg-type]
        if r.get("missed_without_audit") is not None:
            fired += f" (without the audit: missed {r['missed_without_audit']}/{r['runs']})"
        mark = "" if r["status"] in ("ok", "miss", "not run") else "   <-- FAIL"
        print(f"{r['fault']:<30} {zoo:<15} {r['expected']:<16} {r['engine']:<13} {det:<9} {fwd_s:<5} {harm:<5} "
              f"{fired}{mark}")
    if soak["ran"]:
        print(f"\nclean soak: {soak['steps']} steps, {soak['slots_verified']} slots verified, "
              f"{soak['false_positives']} false positives; content re-verified on "
              f"{100 * soak['content_verified_share']:.1f}% of reads, {100 * soak['unverifiable_share']:.2f}% "
              f"unknown, {soak['scrub_passes']} scrub passes; every stamped slot's bytes re-fingerprinted at most "
              f"{soak['unverified_age_max_forwards']} forwards ago")
    else:
        print("\nclean soak: not run (--soak 0)")
    print("selftest " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def _selftest_engines(args: argparse.Namespace, say: Callable[..., None]) -> list[str]:
    """The engines the selftest runs: the scripted one; transformers and vLLM where they are installed
    (transformers in the tested range) and not turned off."""
    engines = ["scripted"]
    if not args.no_transformers:
        try:
            import transformers

            from kvcanary.engines.transformers.entry import check_version
            from kvcanary.errors import UnsupportedError

            try:
                check_version(transformers.__version__)
                engines.append("transformers")
            except UnsupportedError as e:
                say(f"{e}: its rows are skipped")
        except ImportError:
            say("transformers is not installed: its rows are skipped (pip install 'kvcanary[transformers]')")
    if not args.no_vllm:
        try:
            import vllm  # noqa: F401

            engines.append("vllm")
        except ImportError:
            say("vLLM is not installed: its rows are skipped (scripts/setup-vllm builds .venv-vllm with it)")
        except Exception as e:  # installed but broken: the rows could prove nothing
            say(f"vLLM does not import ({type(e).__name__}: {e}): its rows are skipped")
    return engines


def _catalog_rows(engines: list[str], seeds: int, say: Callable[..., None]) -> list[dict[str, object]]:
    """The catalog's rows: each fault class on the scripted engine, and on transformers where it applies;
    documented misses as one row each."""
    from kvcanary.faults import runner
    from kvcanary.faults.catalog import CATALOG, Outcome, Point

    model = None
    rows: list[dict[str, object]] = []
    for fc in CATALOG:
        if fc.outcome == Outcome.MISS:
            rows.append({"fault": fc.name, "zoo": list(fc.zoo), "expected": fc.outcome.value, "engine": "-",
                         "runs": 0, "detected": 0, "checks_fired": [], "forwards_max": None, "status": "miss",
                         "why": fc.why_missed})
            continue
        ran = False
        for eng in engines:
            if eng == "vllm" or (eng == "scripted" and fc.point == Point.KERNEL) or (
                    eng == "transformers" and fc.name not in runner.CB_FAULTS and fc.name not in runner.KERNEL_FAULTS):
                continue
            results = []
            for seed in range(seeds):
                say(f"  {fc.name} on {eng}, seed {seed}{' (with and without the audit)' if fc.audit else ''} ...")
                if eng == "scripted":
                    results.append(runner.run_scripted(fc, seed, table=("block", "token")[seed % 2]))
                else:
                    if fc.name in runner.SLIDING_FAULTS:
                        results.append(runner.run_transformers(fc, seed))
                        continue
                    if model is None:
                        from kvcanary.engines.transformers.models import tiny_model

                        model = tiny_model(seed=0, layers=2)
                    results.append(runner.run_transformers(fc, seed, model))
            rows.append(_row(fc.name, fc.zoo, fc.outcome.value, eng, fc.max_forwards, results))
            ran = True
        if not ran:  # a kernel class where no engine with a kernel runs (transformers missing or turned off)
            rows.append({"fault": fc.name, "zoo": list(fc.zoo), "expected": fc.outcome.value, "engine": "-",
                         "runs": 0, "detected": 0, "checks_fired": [], "forwards_max": None, "status": "not run",
                         "why": "needs an engine's attention kernel: transformers is not installed or turned off"})
    return rows


def _row(fault: str, zoo: Sequence[str], expected: str, engine: str, deadline: int,
         results: list[Any]) -> dict[str, object]:
    """One matrix row: a fault's runs (``FaultResult``) on one engine."""
    fwd = [r.forwards_to_detect for r in results if r.forwards_to_detect is not None]
    harm = [r.harmful_reads for r in results if getattr(r, "harmful_reads", None) is not None]
    tokens = [r.harmful_tokens for r in results if getattr(r, "harmful_tokens", None) is not None]
    good = all(r.ok for r in results)
    return {
        "fault": fault, "zoo": list(zoo), "expected": expected, "engine": engine,
        "runs": len(results), "detected": sum(r.detected for r in results),
        "checks_fired": sorted({c for r in results for c in r.checks_fired}),
        "forwards_max": max(fwd) if fwd else None, "deadline": deadline,
        "harmful_reads_max": max(harm) if harm else None,
        "harmful_tokens_max": max(tokens) if tokens else None,
        "first_detections": [r.first for r in results],
        "missed_without_audit": (None if all(getattr(r, "missed_without_audit", None) is None for r in results)
                                 else sum(bool(r.missed_without_audit) for r in results)),
        "details": [r.detail for r in results],
        "status": "ok" if good else "FAIL",
        "failures": [r.to_dict() for r in results if not r.ok],
    }


def _soak(steps: int, say: Callable[..., None]) -> dict[str, Any]:
    """The clean soak's summary: steps run, false positives (violations plus internal errors)."""
    if steps == 0:
        return {"ran": False, "steps": 0, "false_positives": 0, "slots_verified": 0}
    from kvcanary.faults import runner

    say(f"  clean soak of {steps} randomized steps ...")
    st = runner.soak(steps, progress=lambda n: say(f"    {n}/{steps} steps"))
    return {"ran": True, "steps": st["soak_steps"], "false_positives": st["violations"] + st["internal_errors"],
            "slots_verified": st["slots_verified"], **coverage(st)}

