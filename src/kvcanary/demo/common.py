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


def pool_fits(args: argparse.Namespace, slot_bytes: int, what: str) -> str | None:
    """Why the demo's KV pool (``--blocks`` x block size slots of ``slot_bytes`` each, ``what`` says of
    what) cannot be allocated here ("expected X, got Y"), or ``None``: said before anything is allocated."""
    block = args.block_size if args.engine == "scripted" else 8  # the transformers demo's page size
    need, have = args.blocks * block * slot_bytes, memory()
    if have is None or 2 * need <= have:
        return None
    return (f"--blocks: expected a KV pool within half of this machine's {have / 2**30:.1f} GiB, got {args.blocks} "
            f"blocks x {block} slots x {slot_bytes} bytes ({what}) = {need / 2**30:.1f} GiB")

