"""Calibration of the read audit's tolerances (:data:`kvcanary.audit.reference.TOLERANCE`): clean errors
against injected kernel faults' errors, per compute dtype, in units of each query's tolerance.

The read audit recomputes sampled attention queries from the KV cache (fp32 torch ops; fp64 in the
compiled CPU loops) and compares them with the engine's output; a query's error is
max|engine - ref| / max|V read|, and its tolerance is ``base + slope * m`` (:data:`TOLERANCE` of the
dtype, ``m`` the query's probability-weighted mean |logit|, which both references compute). An
error above its tolerance is an ``ATTENTION`` violation. The tolerance must sit above every clean
error (no false positive) and below the errors a kernel fault gives (no missed fault). This measures
both as the ratio error / tolerance of each audited query (``Auditor.ratios``; the ForwardAudit's
``err`` and ``tol`` arrays, recorded with each query's metadata when the adapter drains them):

- **clean**: randomized transformers continuous-batching configurations
  (:func:`kvcanary.faults.cb_soak.draw_configs`: every architecture of
  :data:`kvcanary.engines.transformers.models.ARCHS`, eager and sdpa attention, GQA, sinks, forks, sampling,
  tight memory, CPU offload, warm managers, shared prefixes, chunked prefill), each also drawing a
  compute dtype (float32, bfloat16, float16; the model is converted with ``model.to(dtype)``), run
  once under ``CanaryConfig(mode="log", content_budget_bytes=None, audit_queries=64)``. Every
  audited query's error, tolerance and ratio is recorded; violations and internal errors must be 0.
  The margin is 1 / the largest clean ratio.
- **faulty**: each attention-kernel fault class of :data:`kvcanary.faults.runner.KERNEL_FAULTS`
  (``write_lands_zeros`` aside: the write check finds it, not the audit) injected as
  :func:`kvcanary.faults.runner.run_transformers` does, on the class's tiny model converted to
  each dtype, for ``--fault-seeds`` seeds. A run is detected when it reports an ``ATTENTION``
  violation from the injection's forward on. The ratios of the queries the fault affects (from the
  injection's forward on, on the faulty layer; on the faulty request where the fault has one; where
  it reaches a query at all: cached positions for a page or prefix fault, queries whose window is
  full for the window fault) are recorded; each run's largest is how far above its tolerance the
  fault's most visible query lands, and the smallest of those over the runs is the class's margin
  (below 1: some run is missed).

``m`` is ``(tol - base) / slope`` where the dtype's tolerance has a slope (bf16, fp16); fp32's
tolerance is fixed and its queries' ``m`` is not recorded.

Prints one progress line per configuration and per faulty run, then the per-dtype summary: clean
queries audited, p50 / p99 / p99.9 / max clean error and ratio, the margin, each architecture's and
attention implementation's largest ratio and the query behind the largest; per fault class and
dtype the runs detected, the smallest per-run largest affected ratio and the affected queries above
their tolerance. Writes everything as one JSON file,
``bench/results/audit_calibration_<commit>.json`` (``--out`` another), ``<commit>`` being the
checkout of the kvcanary package imported (a worktree on ``PYTHONPATH`` measures another commit;
``src_changes`` lists its uncommitted src files).

The tiny models have random weights and attend almost uniformly (|logit| below ~0.3); trained
models' logits reach ~10-30, where a kernel that rounds the logits to the compute dtype errs more,
and where a wrong scale or a missing position moves the output more. ``--sharpen F`` multiplies
every attention module's softmax scale by ``F`` (the engine and the audit both read it, so runs
stay clean) to measure both at that size; its file is
``audit_calibration_sharpen<F>_<commit>.json``.

``--real`` measures the trained model's own logits instead: SmolLM2-135M-Instruct
(:mod:`kvcanary.real_model`, 30 layers, 9 query heads over 3 KV heads of 64) in float32 and
bfloat16, each with ``sdpa`` (fp32 logits on a CPU) and ``eager`` attention (transformers'
``paged|eager``, which computes the logits in the model's dtype), prompted with real text
(:func:`kvcanary.real_model.text_prompts`); the clean configurations are
:func:`kvcanary.faults.cb_soak.draw_configs` of the real model, the faulty runs ask 12 questions
under 3 shared system turns (``window_off_by_one`` needs a sliding window, which the model has
not). ``--audit-queries`` audits more queries per forward (up to 4096: with 2160, every layer, row
and head of an 8-request decode forward). Its file is ``audit_calibration_real_<commit>.json``.

    python bench/audit_calibration.py [--configs 24] [--seed 1] [--fault-seeds 2] [--quick] [--sharpen 100]
    python bench/audit_calibration.py --real --configs 16 --fault-seeds 1 --audit-queries 2160

Exit status 1 when a clean run has a violation or an internal error, or a fault run is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import random
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REAL_DTYPES = ("float32", "bfloat16")  # the dtypes kvcanary.real_model converts to
IMPLEMENTATIONS = ("sdpa", "eager")  # the real model's attention in the --real runs
AUDIT_QUERIES = 64
ROOT = Path(__file__).resolve().parent.parent


# ---- recording --------------------------------------------------------------------------------


class Recorder:
    """A protection hook that turns on the auditor's records (``Auditor.errors`` and ``ratios``) and
    keeps every drained query's error and tolerance with its metadata (the drain decodes the pending
    forwards' results; the tolerance is the one the audit itself computed, ``ForwardAudit.tol``)."""

    def __init__(self, dtype: str) -> None:
        from kvcanary.audit.reference import TOLERANCE

        self.base, self.slope = TOLERANCE[DTYPES[dtype]]
        self.guard: Any = None
        self.queries: list[dict[str, Any]] = []

    def __call__(self, prot: Any, runner: Any, batch: dict) -> None:
        if self.guard is None:
            self.attach(prot)

    def attach(self, prot: Any) -> None:
        self.guard = prot
        auditor = prot.audit.auditor
        if auditor.errors is None:
            auditor.errors = []
        drain = auditor.drain

        def recording_drain() -> list:
            for fa in auditor.pending:
                if not fa.queries:
                    continue
                for q, e, t in zip(fa.queries, fa.err.tolist(), fa.tol.tolist()):
                    if e >= 0:
                        self.queries.append(dict(
                            step=fa.step, layer=q.layer, row=q.row, head=q.head, position=q.position,
                            cached=q.cached, group=q.group, request=prot.request_at(fa.step, q.row), err=e, tol=t,
                            ratio=e / t if t > 0 else math.inf,
                            m=(t - self.base) / self.slope if self.slope > 0 else None))
            return drain()

        auditor.drain = recording_drain


class LogCapture(logging.Handler):
    """The kvcanary logger's records (violation warnings, notes, internal errors with their tracebacks),
    kept instead of printed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[str]:
        fmt = logging.Formatter("%(message)s")
        return [fmt.format(r) for r in self.records if r.levelno >= logging.ERROR]

    def notes(self) -> list[str]:
        return sorted({r.getMessage() for r in self.records if r.levelno == logging.WARNING
                       and r.getMessage().startswith("kvcanary: the ")})


@contextlib.contextmanager
def captured() -> Iterator[LogCapture]:
    """The engine's loggers down to critical; kvcanary's records captured (not printed)."""
    quiet = [logging.getLogger(n) for n in ("ContinuousBatchingLogger", "transformers")]
    kv = logging.getLogger("kvcanary")
    saved = [(lg, lg.level) for lg in quiet] + [(kv, kv.level)]
    prop = kv.propagate
    cap = LogCapture()
    for lg in quiet:
        lg.setLevel(logging.CRITICAL)
    kv.setLevel(logging.WARNING)
    kv.propagate = False
    kv.addHandler(cap)
    try:
        yield cap
    finally:
        kv.removeHandler(cap)
        kv.propagate = prop
        for lg, level in saved:
            lg.setLevel(level)


# ---- statistics --------------------------------------------------------------------------------


def quantile(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    i = min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[i]


def summary(vals: list[float]) -> dict[str, Any]:
    s = sorted(vals)
    return {"n": len(s), "p50": quantile(s, 0.5), "p99": quantile(s, 0.99), "p999": quantile(s, 0.999),
            "max": s[-1] if s else None, "min": s[0] if s else None}


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def inv(x: float | None) -> float | None:
    return None if not x else 1 / x


def brief(q: dict[str, Any] | None, **extra: Any) -> dict[str, Any] | None:
    """A recorded query as reported: where it is, its error, tolerance, ratio and ``m``."""
    return None if q is None else {**extra, **{k: q[k] for k in ("step", "layer", "row", "head", "position", "cached",
                                                                  "request", "err", "tol", "ratio", "m")}}


def sharpen(model: Any, factor: float) -> Any:
    """Multiply every attention module's softmax scale by ``factor`` (the engine and the audit both read
    ``module.scaling``, so a run stays clean): random-weight tiny models attend almost uniformly
    (|logit| below ~0.3), trained ones with logits of ~10-30, where rounding the logits costs more."""
    if factor != 1:
        for m in model.modules():
            if hasattr(m, "layer_idx") and hasattr(m, "scaling"):
                m.scaling = float(m.scaling) * factor
    return model


def audit_path(guard: Any) -> str:
    return "compiled" if getattr(guard.audit, "_fused", False) else "torch"


# ---- clean -------------------------------------------------------------------------------------


def draw_dtypes(n: int, seed: int, names: Sequence[str] = tuple(DTYPES)) -> list[str]:
    """Each configuration's dtype: a shuffled cycle of ``names`` (balanced), from its own stream so the
    configurations themselves are :func:`draw_configs`'s."""
    out = [names[k % len(names)] for k in range(n)]
    random.Random(seed * 7919 + 13).shuffle(out)
    return out


@contextlib.contextmanager
def real_model(dtype: str, impl: str) -> Iterator[tuple[Any, Any]]:
    """The trained model (loaded once per process and dtype) with attention ``impl`` while the context
    is open, and its tokenizer."""
    from kvcanary.faults.cb_soak import REAL, CbConfig, build_model

    model, tok = build_model(CbConfig(seed=0, arch=REAL, dtype=dtype))
    was = model.config._attn_implementation
    model.config._attn_implementation = impl
    try:
        yield model, tok
    finally:
        model.config._attn_implementation = was


def run_clean(cfg: Any, dtype: str, factor: float = 1.0, impl: str | None = None,
              audit_queries: int = AUDIT_QUERIES) -> dict[str, Any]:
    """One clean configuration in ``dtype``: a tiny model (softmax scales times ``factor``), or the
    real one (``cfg.arch`` the real model's) with attention ``impl``."""
    from kvcanary.config import CanaryConfig
    from kvcanary.engines.transformers.models import tiny_arch
    from kvcanary.faults.cb_soak import REAL, session

    t0 = time.perf_counter()
    rec = Recorder(dtype)
    config = CanaryConfig(mode="log", content_budget_bytes=None, audit_queries=audit_queries, audit_budget=None)
    if cfg.arch == REAL:
        cfg = dataclasses.replace(cfg, dtype=dtype)
        with real_model(dtype, impl or "sdpa") as (model, tok), captured() as cap:
            run = session(model, cfg, config, [rec], tok)
            impl = str(model.config._attn_implementation)
    else:
        model = sharpen(tiny_arch(cfg.arch, seed=cfg.seed % 1000, layers=cfg.layers).to(DTYPES[dtype]), factor)
        impl = str(model.config._attn_implementation)
        with captured() as cap:
            run = session(model, cfg, config, [rec])
    guard = run.guard
    st = guard.stats()
    auditor = guard.audit.auditor
    errs = list(auditor.errors or [])
    ratios = list(auditor.ratios)
    violations = [guard.describe(v) for v in guard.violations]
    failed = {k: v.error for k, v in run.out.items() if v.error is not None}
    qs = rec.queries
    top = sorted(qs, key=lambda q: -q["ratio"])[:5]
    ms = [q["m"] for q in qs if q["m"] is not None]
    over = [brief(q) for q in qs if q["err"] > q["tol"]]
    return {
        "config": asdict(cfg), "label": cfg.label(), "dtype": dtype, "arch": cfg.arch,
        "attn_implementation": impl, "audit_path": audit_path(guard),
        "forwards": st["forwards"], "audit_queries": st.get("audit_queries", 0),
        "audit_forwards_skipped": st.get("audit_forwards_skipped", 0),
        "write_slots_checked": st.get("write_slots_checked", 0),
        "queries_audited": len(errs), "queries_recorded": len(qs),
        "error": summary(errs), "ratio": summary(ratios), "m": summary(ms),
        "top_queries": [brief(q) for q in top], "over_tolerance": over[:20], "over_tolerance_count": len(over),
        "violations": len(violations), "violation_text": violations[:10],
        "internal_errors": st.get("internal_errors", 0), "internal_error_text": cap.errors()[:5],
        "notes": cap.notes(), "request_errors": len(failed), "first_request_error": next(iter(failed.values()), None),
        "missing_requests": cfg.requests * cfg.forks - len(run.out), "exception": run.error,
        "events": run.events, "seconds": round(time.perf_counter() - t0, 2),
        "_errors": errs, "_ratios": ratios, "_top": top[0] if top else None,
    }


# ---- faulty ------------------------------------------------------------------------------------


def affected(name: str, q: dict[str, Any], fault: Any) -> bool:
    """Whether the fault reaches query ``q`` (a drained query's record)."""
    d = fault.detail
    if fault.injected_at is None or q["step"] < fault.injected_at or q["layer"] != d.get("layer"):
        return False
    if name in ("read_next_page", "ignore_prefix"):  # one request's cached positions
        return q["request"] == d.get("request") and q["cached"] > 0
    if name == "window_one_short":  # the oldest position of a full window is left out
        return q["position"] + 1 - int(d["window"]) >= 0
    return True  # heads_reversed, v_rescaled, scale_of_one: every query of the layer


def run_faulty(fc: Any, dtype: str, seed: int, factor: float = 1.0, impl: str | None = None,
               audit_queries: int | None = None) -> dict[str, Any]:
    """:func:`kvcanary.faults.runner.run_transformers` with the audit on, on the class's model in
    ``dtype`` (``impl``: on the real model with that attention), recording every audited query."""
    from kvcanary.config import CanaryConfig
    from kvcanary.engines.transformers import cb_configs, protect
    from kvcanary.faults.runner import CB_FAULTS, FULL_AUDIT, KERNEL_FAULTS, transformers_model
    from kvcanary.faults.transformers_cb import CbFault
    from kvcanary.real_model import text_prompts
    from kvcanary.violations import Check

    t0 = time.perf_counter()
    rng = random.Random(seed)
    with contextlib.ExitStack() as stack:
        if impl is None:
            model = sharpen(transformers_model(fc).to(DTYPES[dtype]), factor)
            prefixes = [[rng.randrange(1000) for _ in range(24)] for _ in range(3)]
            prompts = [rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(2, 12))]
                       for _ in range(20)]
        else:
            model, tok = stack.enter_context(real_model(dtype, impl))
            prompts = text_prompts(tok, 12, seed, 40)
        gen, cb = cb_configs(max_new_tokens=10)
        injector = {**CB_FAULTS, **KERNEL_FAULTS}[fc.name]
        fault = CbFault(injector, at=3, seed=seed)
        config = CanaryConfig(mode="log", content_budget_bytes=None, write_check=True,
                              audit_queries=audit_queries or FULL_AUDIT, audit_every=1,
                              audit_budget=None)
        rec = Recorder(dtype)
        with captured() as cap, torch.inference_mode(), protect(model, config) as guard:
            rec.attach(guard)
            guard.hooks.append(fault)
            model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    st = guard.stats()
    at = fault.injected_at
    early = [guard.describe(v) for v in guard.violations if at is None or v.step < at]
    hits = [v for v in guard.violations if v.checks & Check.ATTENTION and at is not None and v.step >= at]
    others = [guard.describe(v) for v in guard.violations
              if at is not None and v.step >= at and not v.checks & Check.ATTENTION]
    hit_ratio = [v.stored_link / max(v.expected_link, 1) for v in hits]  # error and tolerance, in millionths
    aff = [q for q in rec.queries if affected(injector, q, fault)]
    aff_ratio = [q["ratio"] for q in aff]
    before = [q for q in rec.queries if at is None or q["step"] < at]
    after_other = [q for q in rec.queries if at is not None and q["step"] >= at and q not in aff]
    top = max(aff, key=lambda q: q["ratio"], default=None)
    ms = [q["m"] for q in aff if q["m"] is not None]
    return {
        "fault": fc.name, "injector": injector, "dtype": dtype, "attn_implementation": impl, "seed": seed,
        "injected_at": at,
        "audit_path": audit_path(guard),
        "landed_at": fault.landed_at, "detail": {k: v for k, v in fault.detail.items() if k != "watch_block"},
        "detected": bool(hits), "violations": len(hits), "violation_ratio": summary(hit_ratio),
        "first_violation": guard.describe(hits[0]) if hits else None,
        "affected_queries": len(aff), "affected_error": summary([q["err"] for q in aff]),
        "affected_ratio": summary(aff_ratio), "affected_m": summary(ms),
        "affected_above_tolerance": sum(r > 1 for r in aff_ratio),
        "most_visible_query": brief(top),
        "clean_ratio_before_injection": summary([q["ratio"] for q in before]),
        "unaffected_ratio_after_injection": summary([q["ratio"] for q in after_other]),
        "false_positives_before_injection": early[:5], "other_violations": others[:5],
        "forwards": st["forwards"], "audit_queries": st.get("audit_queries", 0),
        "internal_errors": st.get("internal_errors", 0), "internal_error_text": cap.errors()[:5],
        "seconds": round(time.perf_counter() - t0, 2),
    }


# ---- main ---------------------------------------------------------------------------------------


def src_root() -> Path:
    """The repository of the kvcanary package imported (a checkout on PYTHONPATH, or this one)."""
    import kvcanary

    return Path(kvcanary.__file__).resolve().parents[2]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=src_root(), capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def src_changes() -> list[str]:
    """Files under src/ that differ from the commit (the measurement is of the working tree)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=src_root(), capture_output=True,
                             text=True, check=True).stdout
        return [line[3:] for line in out.splitlines() if line.strip()]
    except Exception:
        return ["unknown"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=24, help="clean configurations (default 24)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the clean configurations' draw")
    ap.add_argument("--fault-seeds", type=int, default=2, help="seeds per fault class and dtype (default 2)")
    ap.add_argument("--quick", action="store_true", help="4 clean configurations, 1 fault seed")
    ap.add_argument("--out", help="the JSON file (default bench/results/audit_calibration_<commit>.json)")
    ap.add_argument("--no-faults", action="store_true", help="clean configurations only")
    ap.add_argument("--sharpen", type=float, default=1.0,
                    help="multiply every attention's softmax scale by this (logits of trained-model size: ~100)")
    ap.add_argument("--real", action="store_true", help="the trained model (SmolLM2-135M-Instruct), fp32 and bf16, "
                    "sdpa and eager attention, instead of the tiny random-weight ones")
    ap.add_argument("--audit-queries", type=int, default=AUDIT_QUERIES,
                    help=f"audited queries per forward (default {AUDIT_QUERIES}; at most 4096)")
    args = ap.parse_args()
    if args.quick:
        args.configs, args.fault_seeds = 4, 1
    if args.real and args.sharpen != 1:
        ap.error("--sharpen stands in for trained logits: not with --real")
    torch.set_num_threads(1)

    from kvcanary.audit.reference import TOLERANCE
    from kvcanary.faults.catalog import BY_NAME
    from kvcanary.faults.cb_soak import MODELS, REAL, draw_configs
    from kvcanary.faults.runner import KERNEL_FAULTS, SLIDING_FAULTS

    used = REAL_DTYPES if args.real else tuple(DTYPES)
    impls: tuple[str | None, ...] = IMPLEMENTATIONS if args.real else (None,)

    rev = commit()
    dirty = src_changes()
    if dirty:
        print(f"note: src/ differs from {rev}: {', '.join(dirty)}", flush=True)
    t_start = time.perf_counter()
    tolerances = {name: TOLERANCE[dt] for name, dt in DTYPES.items()}
    print(f"audit calibration at {rev}: {args.configs} clean configurations (seed {args.seed}) of "
          f"{'the real model' if args.real else 'the tiny models'}, {args.fault_seeds} fault seed(s), sharpen "
          f"{args.sharpen:g}, {args.audit_queries} audited queries per forward; tolerances (base, slope) {tolerances}",
          flush=True)

    # clean: the tiny models alone draw what they drew before the real model joined the soak's models
    configs = draw_configs(args.configs, args.seed, [REAL] if args.real else [m for m in MODELS if m != REAL])
    regimes = draw_dtypes(args.configs, args.seed, [f"{d}/{i}" for i in impls for d in used])
    dtypes = [r.split("/")[0] for r in regimes]
    impl_of = [None if r.endswith("/None") else r.split("/")[1] for r in regimes]
    clean: list[dict[str, Any]] = []
    errs_by: dict[str, list[float]] = {d: [] for d in DTYPES}
    ratios_by: dict[str, list[float]] = {d: [] for d in DTYPES}
    top_by: dict[str, Any] = {d: None for d in DTYPES}
    arch_max: dict[str, dict[str, float]] = {d: {} for d in DTYPES}
    impl_max: dict[str, dict[str, float]] = {d: {} for d in DTYPES}  # sdpa vs eager (rounds the logits)
    m_max: dict[str, float | None] = {d: None for d in DTYPES}
    for k, (cfg, dtype) in enumerate(zip(configs, dtypes)):
        with contextlib.redirect_stdout(sys.stderr):
            res = run_clean(cfg, dtype, args.sharpen, impl_of[k], args.audit_queries)
        errs, ratios, top = res.pop("_errors"), res.pop("_ratios"), res.pop("_top")
        errs_by[dtype] += errs
        ratios_by[dtype] += ratios
        if res["m"]["max"] is not None:
            m_max[dtype] = max(m_max[dtype] or 0.0, res["m"]["max"])
        if ratios:
            arch_max[dtype][cfg.arch] = max(arch_max[dtype].get(cfg.arch, 0.0), max(ratios))
            impl = res["attn_implementation"]
            impl_max[dtype][impl] = max(impl_max[dtype].get(impl, 0.0), max(ratios))
        if top is not None and (top_by[dtype] is None or top["ratio"] > top_by[dtype]["ratio"]):
            top_by[dtype] = brief(top, arch=cfg.arch, attn_implementation=res["attn_implementation"],
                                  label=res["label"], config=k)
        clean.append(res)
        bad = [f"{res['violations']} VIOLATION(S)" if res["violations"] else "",
               f"{res['over_tolerance_count']} QUERIES OVER TOLERANCE" if res["over_tolerance_count"] else "",
               f"{res['internal_errors']} INTERNAL ERROR(S)" if res["internal_errors"] else "",
               f"{res['request_errors']} failed requests" if res["request_errors"] else "",
               f"exception {res['exception']}" if res["exception"] else ""]
        print(f"[clean {k + 1}/{len(configs)}] {dtype:8s} {res['label']} ({res['attn_implementation']}, "
              f"{res['audit_path']} audit): {res['forwards']} forwards, {res['queries_audited']} queries, "
              f"max error {fmt(res['error']['max'])}, max error/tol {fmt(res['ratio']['max'])}, max m "
              f"{fmt(res['m']['max'])} {' '.join(b for b in bad if b)} ({res['seconds']:.1f} s)", flush=True)
        for text in res["violation_text"][:3] + res["internal_error_text"][:2]:
            print(f"    {text.splitlines()[0] if text else text}", flush=True)
        for q in res["over_tolerance"][:3]:
            print(f"    over tolerance: {q}", flush=True)

    # faulty
    faulty: list[dict[str, Any]] = []
    classes = [name for name in KERNEL_FAULTS if name != "write_lands_zeros"
               and not (args.real and name in SLIDING_FAULTS)]  # the real model has no window
    if not args.no_faults:
        total = len(classes) * len(used) * len(impls) * args.fault_seeds
        n = 0
        for name in classes:
            for dtype, impl, seed in ((d, i, s) for d in used for i in impls for s in range(args.fault_seeds)):
                n += 1
                with contextlib.redirect_stdout(sys.stderr):
                    res = run_faulty(BY_NAME[name], dtype, seed, args.sharpen, impl,
                                     args.audit_queries if args.real else None)
                faulty.append(res)
                notes = ("; FALSE POSITIVE before injection" if res["false_positives_before_injection"] else "") \
                    + (f"; {res['internal_errors']} INTERNAL ERROR(S)" if res["internal_errors"] else "")
                print(f"[fault {n}/{total}] {dtype:8s} {impl or ''} {name} seed={seed}: injected at forward "
                      f"{res['injected_at']}, {'detected' if res['detected'] else 'MISSED'} "
                      f"({res['violations']} violations, min error/tol {fmt(res['violation_ratio']['min'])}); "
                      f"{res['affected_queries']} affected queries: error/tol max "
                      f"{fmt(res['affected_ratio']['max'])}, median {fmt(res['affected_ratio']['p50'])}, "
                      f"{res['affected_above_tolerance']} above 1{notes} ({res['seconds']:.1f} s)", flush=True)

    # summary
    report: dict[str, Any] = {"commit": rev, "src_changes": src_changes(), "seed": args.seed, "configs": args.configs,
                              "fault_seeds": args.fault_seeds, "sharpen": args.sharpen,
                              "audit_queries": args.audit_queries, "real": args.real,
                              "torch": torch.__version__, "tolerances_base_slope": tolerances, "dtypes": {}}
    try:
        import transformers
        report["transformers"] = transformers.__version__
    except Exception:
        pass
    print("\n== clean (per dtype; ratio = error / the query's tolerance, margin = 1 / max ratio) ==")
    print(f"{'dtype':9s} {'configs':>7s} {'queries':>8s} {'err p99.9':>9s} {'err max':>9s} {'ratio p99.9':>11s} "
          f"{'ratio max':>9s} {'margin':>7s} {'m max':>7s} {'viol':>5s} {'int.err':>7s}  per-arch max ratio; "
          "per-implementation max ratio")
    failures: list[str] = []
    for d in used:
        s, r = summary(errs_by[d]), summary(ratios_by[d])
        rows = [x for x in clean if x["dtype"] == d]
        viol = sum(x["violations"] for x in rows)
        over = sum(x["over_tolerance_count"] for x in rows)
        ierr = sum(x["internal_errors"] for x in rows)
        rerr = sum(x["request_errors"] for x in rows)
        exc = sum(bool(x["exception"]) for x in rows)
        if viol or over or ierr:
            failures.append(f"clean {d}: {viol} violations, {over} queries over tolerance, {ierr} internal errors")
        per = ", ".join(f"{a}={fmt(v)}" for a, v in sorted(arch_max[d].items()))
        per += "; " + ", ".join(f"{a}={fmt(v)}" for a, v in sorted(impl_max[d].items()))
        print(f"{d:9s} {len(rows):7d} {s['n']:8d} {fmt(s['p999']):>9s} {fmt(s['max']):>9s} {fmt(r['p999']):>11s} "
              f"{fmt(r['max']):>9s} {fmt(inv(r['max'])):>7s} {fmt(m_max[d]):>7s} {viol:5d} {ierr:7d}  {per}")
        print(f"{'':9s} largest: {top_by[d]}")
        report["dtypes"][d] = {"clean": {
            "configs": len(rows), "queries": s["n"], "error": s, "ratio": r, "margin": inv(r["max"]),
            "m_max": m_max[d], "violations": viol, "queries_over_tolerance": over, "internal_errors": ierr,
            "request_errors": rerr, "exceptions": exc, "per_arch_max_ratio": arch_max[d],
            "per_implementation_max_ratio": impl_max[d], "largest_ratio_query": top_by[d]}}
    if faulty:
        print("\n== faulty (per class and dtype; ratio = error / tolerance of the affected queries) ==")
        print(f"{'class':22s} {'dtype':9s} {'detected':>9s} {'viol':>5s} {'min run max':>11s} {'aff':>5s} "
              f"{'aff min':>9s} {'aff med':>9s} {'aff>tol':>10s}  weakest run's most visible query")
        for name in classes:
            for d in used:
                runs = [x for x in faulty if x["fault"] == name and x["dtype"] == d]
                if not runs:
                    continue
                weakest = min(runs, key=lambda x: -1.0 if x["affected_ratio"]["max"] is None
                              else x["affected_ratio"]["max"])
                aff = sum(x["affected_queries"] for x in runs)
                above = sum(x["affected_above_tolerance"] for x in runs)
                det = sum(x["detected"] for x in runs)
                row = {"runs": len(runs), "detected_runs": det, "detected_every_run": det == len(runs),
                       "violations": sum(x["violations"] for x in runs),
                       "min_run_max_ratio": weakest["affected_ratio"]["max"],
                       "affected_queries": aff, "affected_above_tolerance": above,
                       "affected_min_ratio": min((x["affected_ratio"]["min"] for x in runs
                                                  if x["affected_ratio"]["min"] is not None), default=None),
                       "affected_median_ratio_of_runs": sorted(x["affected_ratio"]["p50"] or 0 for x in runs)[
                           len(runs) // 2],
                       "weakest_run": {"seed": weakest["seed"], "query": weakest["most_visible_query"]},
                       "false_positives_before_injection": sum(bool(x["false_positives_before_injection"])
                                                               for x in runs),
                       "internal_errors": sum(x["internal_errors"] for x in runs)}
                if args.real:  # the weakest run's most visible query per attention implementation
                    row["per_implementation_min_run_max_ratio"] = {
                        i: min((x["affected_ratio"]["max"] or 0.0 for x in runs if x["attn_implementation"] == i),
                               default=None) for i in IMPLEMENTATIONS}
                if det < len(runs):
                    missed = [x["seed"] for x in runs if not x["detected"]]
                    failures.append(f"{name} {d}: missed in seed(s) {missed}")
                if row["false_positives_before_injection"] or row["internal_errors"]:
                    failures.append(f"{name} {d}: {row['false_positives_before_injection']} runs with a false "
                                    f"positive before the injection, {row['internal_errors']} internal errors")
                report["dtypes"][d].setdefault("faulty", {})[name] = row
                print(f"{name:22s} {d:9s} {f'{det}/{len(runs)}':>9s} {row['violations']:5d} "
                      f"{fmt(row['min_run_max_ratio']):>11s} {aff:5d} {fmt(row['affected_min_ratio']):>9s} "
                      f"{fmt(row['affected_median_ratio_of_runs']):>9s} {f'{above}/{aff}':>10s}  "
                      f"{weakest['most_visible_query']}")
        print("\n== margins (per dtype) ==")
        for d in used:
            c = report["dtypes"][d]["clean"]
            rows = report["dtypes"][d].get("faulty", {})
            thr = {n: x["min_run_max_ratio"] for n, x in rows.items() if x["min_run_max_ratio"] is not None}
            tight = min(thr, key=lambda n: thr[n]) if thr else None
            missed = [n for n, x in rows.items() if not x["detected_every_run"]]
            m = {"clean_max_ratio": c["ratio"]["max"], "clean_margin": c["margin"], "tightest_class": tight,
                 "tightest_class_min_run_max_ratio": thr.get(tight) if tight else None,
                 "fault_clean_separation": (thr[tight] / c["ratio"]["max"]) if tight and c["ratio"]["max"] else None,
                 "classes_missed_in_some_run": missed}
            report["dtypes"][d]["margin"] = m
            print(f"{d:9s} clean max error/tol {fmt(m['clean_max_ratio'])} (margin {fmt(m['clean_margin'])}x); "
                  f"every fault run's most visible query at >= {fmt(m['tightest_class_min_run_max_ratio'])}x its "
                  f"tolerance ({tight}); {fmt(m['fault_clean_separation'])}x the clean max; "
                  f"missed: {', '.join(missed) or 'none'}")
    report["failures"] = failures
    report["clean_runs"] = clean
    report["faulty_runs"] = faulty
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    tag = "real_" if args.real else f"sharpen{args.sharpen:g}_" if args.sharpen != 1 else ""
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"audit_calibration_{tag}{rev}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\n{'FAILURES: ' + '; '.join(failures) if failures else 'no failures'}")
    print(f"wrote {out} ({report['wall_s']:.0f} s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
