"""What the demo's runs share: the summary's coverage figures, the one-time set-up timed apart,
the printed summary, the pool checked against this machine's memory, and whether a violation is the
injected fault showing."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from kvcanary.config import CanaryConfig


def coverage(st: dict) -> dict[str, float]:
    """The coverage figures of a summary: shares of read slots content-verified and unknown, the
    patrol scrub's passes over the pool and the bound on how long stamped bytes go unverified."""
    from kvcanary.reporting import coverage_of

    c = coverage_of(st)
    return {"content_verified_share": round(c["content_verified"], 4), "unverifiable_share": round(c["unverifiable"], 4),
            "scrub_passes": round(c["scrub_passes"], 2), "unverified_age_max_forwards": int(c["unverified_age_max_steps"])}


def setup_time(config: CanaryConfig) -> float:
    """Seconds the one-time set-up took: loading the fused CPU loops from their cache (compiling
    them, the first time on a machine; ``kvcanary warmup`` does it ahead of time). Timed apart so
    that the demo's overhead is the per-forward cost."""
    if config.backend not in ("auto", "fused") or config.mode == "off":
        return 0.0
    from kvcanary.fused import available

    t0 = time.perf_counter()
    available()
    return time.perf_counter() - t0



def print_summary(summary: dict[str, object], unit: str, as_json: bool) -> None:
    """Print a demo summary: one JSON line, or a table then each injected fault and its detection."""
    if as_json:
        print(json.dumps(summary))
        return
    table([(k, v) for k, v in summary.items() if k not in ("injected", "report")])
    for f in summary.get("injected", []):  # type: ignore[attr-defined]
        print(f"\n  fault {f['fault']} at {unit} {f[f'injected_at_{unit}']}: {f['detail']}")
        n = f.get("forwards_to_detect")
        after = "" if n is None else f" (within {n} forward{'s' * (n != 1)}, deadline {f['deadline_forwards']})"
        print(f"    detected: {f['first_detection'] or 'NO'}{after}")
    rep = summary.get("report")
    if isinstance(rep, dict):
        print(f"\n  violation log of the injected run: {rep['headline']}\n  report: {rep['command']} "
              f"(page written: {rep['html']})")



def table(rows: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")



def caused_by(fault: Any, v: Any, guard: Any) -> bool:
    """Whether violation ``v`` is the injected ``fault`` showing (not another fault's)."""
    from kvcanary.faults.catalog import META
    from kvcanary.faults.transformers_cb import full_group

    d = fault.detail
    if fault.name == "flip_shared_byte":
        return bool(v.slot == d["slot"])
    if fault.name == "redirect_table_entry":
        return guard.request_of(v) == d["request"]
    g = full_group(guard)  # a reused block shows as another sequence's stamps
    return bool(v.checks & META) and (g.block_of(v.slot) == d["block"] or guard.request_of(v) in d["readers"])



def memory() -> int | None:
    """This machine's memory in bytes (``None`` where it cannot be told)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def pool_fits(args: argparse.Namespace, slot_bytes: int, what: str, block: int | None = None) -> str | None:
    """Why the demo's KV pool (``--blocks`` x ``block`` slots of ``slot_bytes`` each, ``what`` says of
    what) cannot be allocated here ("expected X, got Y"), or ``None``: said before anything is allocated.
    ``block`` defaults to the scripted engine's ``--block-size`` and the transformers demo's page size, 8."""
    if block is None:
        block = args.block_size if args.engine == "scripted" else 8
    need, have = args.blocks * block * slot_bytes, memory()
    if have is None or 2 * need <= have:
        return None
    return (f"--blocks: expected a KV pool within half of this machine's {have / 2**30:.1f} GiB, got {args.blocks} "
            f"blocks x {block} slots x {slot_bytes} bytes ({what}) = {need / 2**30:.1f} GiB")



def violation_report(logfile: str) -> dict[str, str]:
    """The injected runs' violation log read back: its headline, an HTML page written beside it and
    the command that writes the page again."""
    from kvcanary import report

    page = os.path.splitext(logfile)[0] + ".html"
    rs = report.summarize(report.read(logfile)) if os.path.exists(logfile) else report.summarize([])
    with open(page, "w", encoding="utf-8") as fh:
        fh.write(report.html_page(rs, logfile))
    return {"log": logfile, "html": page, "headline": report.headline(rs),
            "command": f"kvcanary report {logfile} --html {page}"}


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def print_chat(summary: dict[str, Any]) -> None:
    """The chat demos' text (transformers and vLLM): each question with its answers, the cost, the
    table of figures, then each fault with its detection and the clean, served and repaired answers
    of the requests it hurt. A question asked several times with the same answers is shown once."""
    answers = summary["answers"]
    asked: dict[str, list[dict[str, Any]]] = {}
    for a in answers:
        asked.setdefault(a["question"], []).append(a)
    times = {len(v) for v in asked.values()}
    each = f"each asked {max(times)} times" if len(times) == 1 else f"asked 1 to {max(times)} times each"
    what = (f"{summary['requests']} questions" if times == {1} else
            f"{summary['requests']} requests ({len(asked)} questions, {each})")
    print(f"{summary['model']} ({summary['dtype']}): {what} sharing the system prompt {summary['system_prompt']!r}, "
          f"greedy decoding, {summary['engine']}\n")
    for question, group in asked.items():
        same = all((a["without_canary"], a["with_canary"]) == (group[0]["without_canary"], group[0]["with_canary"])
                   for a in group)
        for a in group[:1] if same else group:
            print(f"  Q: {question}" + (f"   (asked {len(group)} times, the same answers)" if same and len(group) > 1
                                        else ""))
            print(f"     without the canary: {a['without_canary']}")
            print(f"     with the canary:    {a['with_canary']}" + ("" if a["identical"] else "   <-- DIFFERS"))
    n, same_n = len(answers), sum(a["identical"] for a in answers)
    print(f"\nanswers with the canary identical to those without it: {'yes' if same_n == n else 'NO'} "
          f"({same_n} of {n})")
    print(f"canary cost: {summary['canary_ms_per_forward']} ms of host time per forward of {summary['forward_ms']} ms "
          f"({summary['canary_share_pct']}% of the run; {summary['forwards']} forwards), "
          f"{summary['violations']} violations\n")
    table([(k, v) for k, v in summary.items()
           if not isinstance(v, (dict, list)) and k not in ("system_prompt", "engine")])
    for f in summary.get("injected", []):
        _print_fault(f)
    rr = summary.get("repair_run")
    if rr:
        said = "yes" if rr["served_only_clean_answers"] else "NO"
        head = (f"\n  repair mode, all faults: {_n(rr['repairs'], 'repair')}, {_n(rr['requests_failed'], 'request')} "
                "failed; ")
        if "untouched_changed" in rr:  # vLLM: the requests no detection named are counted apart
            print(f"{head}every request a detection named got its clean answer or an error: {said}; "
                  f"{_n(rr['untouched_changed'], 'request')} no detection named answered otherwise than in the clean "
                  "run (every byte it read verified)")
        else:
            print(f"{head}every answer served was the clean one: {said}")
    rep = summary.get("report")
    if isinstance(rep, dict):
        print(f"\n  violation log of the injected run: {rep['headline']}\n  report: {rep['command']} "
              f"(page written: {rep['html']})")


def finish_chat(summary: dict[str, Any], st: dict[str, Any], same: list[bool], good: bool, as_json: bool) -> int:
    """Print a chat demo's summary (JSON or the side-by-side text) and return its exit status: 0 when
    every answer was identical with the canary on, nothing was reported, the canary had no internal
    error and the fault runs (if any) went as expected (``good``)."""
    ok = all(same) and st["violations"] == 0 and st["internal_errors"] == 0 and good
    if as_json:
        print(json.dumps(summary))
    else:
        print_chat(summary)
    return 0 if ok else 1


def _print_fault(f: dict[str, Any]) -> None:
    print(f"\n  fault {f['fault']} at forward {f['injected_at_forward']}: {f['detail']}")
    if f.get("repair_detail"):  # vLLM: the repair engine's run found its target elsewhere
        print(f"    in the repair run at forward {f['repair_injected_at_forward']}: {f['repair_detail']}")
    records = f" ({f['detections']} records)" if f["detections"] else ""
    print(f"    detected: {f['first_detection'] or 'NO'}{records}")
    r = f["repair"]
    print(f"    log mode: {_n(f['harmful_tokens_served'], 'token')} sampled from corrupted KV served; repair mode: "
          f"{_n(r['repairs'], 'repair')}, {_n(r['requests_failed'], 'request')} failed")
    for row in f["requests"]:
        mark = ("   (= clean)" if row["repair_equals_clean"] else "   (failed: no wrong text served)"
                if row["repair_failed"] else "   <-- NOT the clean answer")
        print(f"    {row['request']}  Q: {row['question']}")
        print(f"      clean:         {row['clean']}")
        cut = f"   (cut at the {row['log_cut_at']}-token limit)" if row.get("log_cut_at") else ""
        print(f"      log (served):  {row['log']}" + (cut if row["log_changed"] else "   (unchanged)"))
        print(f"      repair:        {_short(row['repair'])}{mark}")
    for q in f["changed_undetected"]:
        print(f"    answer changed without a detection: {q}   <-- MISSED")
    for q in r["served_other_text"]:
        print(f"    repair served another answer to: {q}   <-- NOT the clean answer")
    for row in r.get("untouched_changed", []):  # vLLM: see kvcanary.demo.vllm
        print(f"    repair run, a request no detection named: {row['request']}  Q: {row['question']}\n"
              f"      clean: {row['clean']}\n      repair run: {row['repair']}   (no detection named it, with every "
              f"byte it read verified: recomputing the hurt requests changed the batches it was computed in, and CPU "
              f"matrix products are not batch-invariant)")
