"""Calibration of the read audit's tolerances (:data:`kvcanary.audit.TOLERANCE`): clean errors
against injected kernel faults' errors, per compute dtype.

The read audit recomputes sampled attention queries from the KV cache (fp32 torch ops; fp64 in the
compiled CPU loops) and compares them with the engine's output; a query's error is
max|engine - ref| / max|V read|, and an error above the dtype's tolerance is an ``ATTENTION``
violation. A tolerance must sit above every clean error
(no false positive) and below the errors a kernel fault gives (no missed fault). This measures both:

- **clean**: randomized transformers continuous-batching configurations
  (:func:`kvcanary.faults.cb_soak.draw_configs`: every architecture of
  :data:`kvcanary.engines.hf_models.ARCHS`, eager and sdpa attention, GQA, sinks, forks, sampling,
  tight memory, CPU offload, warm managers, shared prefixes, chunked prefill), each also drawing a
  compute dtype (float32, bfloat16, float16; the model is converted with ``model.to(dtype)``), run
  once under ``CanaryConfig(mode="log", content_budget_bytes=None, audit_queries=64)``. Every
  audited query's error is recorded; violations and internal errors must be 0.
- **faulty**: each attention-kernel fault class of :data:`kvcanary.faults.runner.KERNEL_FAULTS`
  (``write_lands_zeros`` aside: the write check finds it, not the audit) injected as
  :func:`kvcanary.faults.runner.run_transformers` does, on the class's tiny model converted to
  each dtype, for a few seeds. The errors of the queries the fault affects (from the injection's
  forward on, on the faulty layer; on the faulty request where the fault has one; where it reaches
  a query at all: cached positions for a page or prefix fault, queries whose window is full for
  the window fault) and the ``ATTENTION`` violations reported are recorded.

Prints one progress line per configuration and per faulty run, then the per-dtype summary: clean
queries audited, p50 / p99 / p99.9 / max clean error and each architecture's and attention
implementation's maximum; per fault class and dtype whether it was detected, the errors of its
violations and affected queries, and the loosest tolerance that still detects every run (the
smallest run's largest affected error); the ratios of the smallest faulty errors to the largest
clean error; the current tolerances. Writes everything as one JSON file,
``bench/results/audit_calibration_<commit>.json`` (``--out`` another), ``<commit>`` being the
checkout of the kvcanary package imported (a worktree on ``PYTHONPATH`` measures another commit;
``src_changes`` lists its uncommitted src files).

Each audited query's logit size is recorded too (the largest |scaled logit| it reads and the
probability-weighted mean |logit|, recomputed from the same cache bytes by a wrapper of the torch
reference and of the compiled audit), and a tolerance that scales with it,
``c * u(dtype) * (1 + |s|)`` (``u`` the dtype's unit roundoff), is evaluated against both
distributions, ``c`` per dtype set to 5x the largest clean error in those units.

The tiny models have random weights and attend almost uniformly (|logit| below ~0.3); trained
models' logits reach ~10-30, where a kernel that rounds the logits to the compute dtype errs more,
and where a wrong scale or a missing position moves the output more. ``--sharpen F`` multiplies
every attention module's softmax scale by ``F`` (the engine and the audit both read it, so runs
stay clean) to measure both at that size: ``--sharpen 100`` gives logits of about 2 on average and
13 at most; its file is ``audit_calibration_sharpen<F>_<commit>.json``.

    python bench/audit_calibration.py [--configs 24] [--seed 1] [--fault-seeds 2] [--quick] [--sharpen 100]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import random
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUDIT_QUERIES = 64
ROOT = Path(__file__).resolve().parent.parent


# ---- recording --------------------------------------------------------------------------------


class Recorder:
    """A protection hook that turns on the auditor's error list (``Auditor.errors``) and records every
    drained query with its metadata (the drain decodes the pending forwards' device results)."""

    def __init__(self) -> None:
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
                n = len(fa.queries)
                smax: list[Any] = [None] * n
                pmean: list[Any] = [None] * n
                if hasattr(fa, "_smax"):  # the torch reference
                    smax, pmean = fa._smax.tolist(), fa._pmean.tolist()
                got = _FUSED_STATS.pop(id(fa.err), None)
                if got is not None and got[0] is fa.err:  # the compiled audit
                    smax, pmean = got[1].tolist(), got[2].tolist()
                smax = [None if x is not None and x < 0 else x for x in smax]
                pmean = [None if x is not None and x < 0 else x for x in pmean]
                for q, e, t, sm, pm in zip(fa.queries, fa.err.tolist(), fa.tol.tolist(), smax, pmean):
                    if e >= 0:
                        self.queries.append(dict(step=fa.step, layer=q.layer, row=q.row, head=q.head,
                                                 position=q.position, cached=q.cached, group=q.group,
                                                 request=prot.request_at(fa.step, q.row), err=e, tol=t,
                                                 smax=sm, pmean=pm))
            return drain()

        auditor.drain = recording_drain


# unit roundoff of each compute dtype (half the gap between 1 and the next number)
UNIT = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


_FUSED_STATS: dict[int, tuple[Any, Any, Any]] = {}  # id(err array) -> (err, smax, pmean), until drained
_fused_loop: Any = None


def _fused_stats_loop() -> Any:
    """A compiled loop over the compiled audit's own arguments (:func:`kvcanary.fused.audit.audit_queries`)
    that computes each query's ``smax`` and ``pmean`` the way its reference reads the logits (shift 0)."""
    global _fused_loop
    if _fused_loop is None:
        import numpy as np
        from numba import njit

        from kvcanary.fused._step import lookup
        from kvcanary.fused.audit import load_row

        @njit(cache=False)
        def loop(descs, steps, qt, fl, smax, pmean):  # type: ignore[no-untyped-def]
            width, nd_max = 1, 1
            for s in range(qt.shape[0]):
                width = max(width, qt[s, 6] - qt[s, 7] + 1)
                nd_max = max(nd_max, descs[qt[s, 1], 22])
            logits = np.empty(width)
            qv = np.empty(nd_max)
            row = np.empty(nd_max)
            for s in range(qt.shape[0]):
                k, lay, r, hd, kvh, p, lo = qt[s, 0], qt[s, 1], qt[s, 2], qt[s, 4], qt[s, 5], qt[s, 6], qt[s, 7]
                desc = descs[lay]
                ck, q = desc[0:6], desc[12:16]
                dt, dq, nd, limit, step = desc[20], desc[21], desc[22], desc[23], steps[desc[24]]
                tq, hq = (qt[s, 10], 0) if desc[25] else (qt[s, 3], hd)
                scale, softcap = fl[3 * lay], fl[3 * lay + 1]
                qs, rw = qv[:nd], row[:nd]
                load_row(q[0] + tq * q[1] + hq * q[2], q[3], dq, qs)
                bs = ck[1]
                n = p - lo + 1
                mx = -math.inf
                ok = True
                for j in range(n):
                    sl = lookup(step, r, lo + j)
                    if sl < 0 or sl > limit:
                        ok = False
                        break
                    load_row(ck[0] + (sl // bs) * ck[2] + (sl % bs) * ck[3] + kvh * ck[4], ck[5], dt, rw)
                    x = 0.0
                    for d in range(nd):
                        x += qs[d] * rw[d]
                    x *= scale
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    logits[j] = x
                    mx = max(mx, x)
                if not ok:
                    continue
                sink = fl[qt[s, 9]] if qt[s, 9] >= 0 else -math.inf
                mx = max(mx, sink)
                den = math.exp(sink - mx) if qt[s, 9] >= 0 else 0.0
                big, acc = 0.0, 0.0
                for j in range(n):
                    w = math.exp(logits[j] - mx)
                    den += w
                    acc += w * abs(logits[j])
                    big = max(big, abs(logits[j]))
                smax[k] = big
                pmean[k] = acc / den

        _fused_loop = loop
    return _fused_loop


@contextlib.contextmanager
def logit_stats() -> Iterator[bool]:
    """Record each audited query's logit size beside its error: ``smax``, the largest |scaled logit| it
    reads, and ``pmean``, the probability-weighted mean |logit| (from the cache bytes the audit reads).
    Wraps the adapter's torch reference (``check_layer``) and the compiled audit (``audit_queries``,
    the CPU path); yields False where this version has neither."""
    import numpy as np

    from kvcanary.engines import transformers_audit as ta

    orig: Any = getattr(ta, "check_layer", None)
    fused: Any = None
    try:
        from kvcanary.fused import audit as fused
    except Exception:
        pass
    orig_fused: Any = getattr(fused, "audit_queries", None) if fused is not None else None
    if orig is None and orig_fused is None:
        yield False
        return

    def audit_queries(descs: Any, steps: Any, qt: Any, fl: Any, err: Any, shift: Any) -> None:
        orig_fused(descs, steps, qt, fl, err, shift)
        got = _FUSED_STATS.get(id(err))
        if got is None or got[0] is not err:
            got = (err, np.full(len(err), -1.0), np.full(len(err), -1.0))
            _FUSED_STATS[id(err)] = got
        _fused_stats_loop()(descs, steps, qt, fl, got[1], got[2])

    def check_layer(fa: Any, plan: Any, slots: torch.Tensor, q: torch.Tensor, engine_out: torch.Tensor, read: Any,
                    scale: float, softcap: Any, sink: Any, tol: float) -> None:
        orig(fa, plan, slots, q, engine_out, read, scale, softcap, sink, tol)
        k, _ = read(slots, 0)
        valid = plan.inside & (slots >= 0)
        logits = torch.einsum("sd,sld->sl", q.float(), k.float()) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~valid, float("-inf"))
        full = logits if sink is None else torch.cat([logits, sink.float()[:, None]], dim=1)
        p = torch.softmax(full, dim=1)[:, : logits.shape[1]]
        mag = logits.abs().masked_fill(~valid, 0)
        if not hasattr(fa, "_smax"):
            fa._smax = torch.full((len(fa.queries),), -1.0)
            fa._pmean = torch.full((len(fa.queries),), -1.0)
        fa._smax[plan.picked] = mag.amax(1).cpu()
        fa._pmean[plan.picked] = (p * mag).sum(1).cpu()

    if orig is not None:
        ta.check_layer = check_layer
    if orig_fused is not None:
        fused.audit_queries = audit_queries
    try:
        yield True
    finally:
        if orig is not None:
            ta.check_layer = orig
        if orig_fused is not None:
            fused.audit_queries = orig_fused
        _FUSED_STATS.clear()


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


def sharpen(model: Any, factor: float) -> Any:
    """Multiply every attention module's softmax scale by ``factor`` (the engine and the audit both read
    ``module.scaling``, so a run stays clean): random-weight tiny models attend almost uniformly
    (|logit| below ~0.3), trained ones with logits of ~10-30, where rounding the logits costs more."""
    if factor != 1:
        for m in model.modules():
            if hasattr(m, "layer_idx") and hasattr(m, "scaling"):
                m.scaling = float(m.scaling) * factor
    return model


# ---- clean -------------------------------------------------------------------------------------


def draw_dtypes(n: int, seed: int) -> list[str]:
    """Each configuration's dtype: a shuffled cycle of the three (balanced), from its own stream so the
    configurations themselves are :func:`draw_configs`'s."""
    names = [list(DTYPES)[k % len(DTYPES)] for k in range(n)]
    random.Random(seed * 7919 + 13).shuffle(names)
    return names


def run_clean(cfg: Any, dtype: str, factor: float = 1.0) -> dict[str, Any]:
    from kvcanary.config import CanaryConfig
    from kvcanary.engines.hf_models import tiny_arch
    from kvcanary.faults.cb_soak import session

    t0 = time.perf_counter()
    model = sharpen(tiny_arch(cfg.arch, seed=cfg.seed % 1000, layers=cfg.layers).to(DTYPES[dtype]), factor)
    rec = Recorder()
    with captured() as cap, logit_stats():
        run = session(model, cfg, CanaryConfig(mode="log", content_budget_bytes=None, audit_queries=AUDIT_QUERIES),
                      [rec])
    guard = run.guard
    st = guard.stats()
    errs = list(guard.audit.auditor.errors or [])
    violations = [guard.describe(v) for v in guard.violations]
    failed = {k: v.error for k, v in run.out.items() if v.error is not None}
    top = sorted(rec.queries, key=lambda q: -q["err"])[:5]
    by_group: dict[str, list[float]] = {}
    for q in rec.queries:
        by_group.setdefault(str(q["group"]), []).append(q["err"])
    return {
        "config": asdict(cfg), "label": cfg.label(), "dtype": dtype, "arch": cfg.arch,
        "attn_implementation": str(model.config._attn_implementation),
        "audit_path": "compiled" if getattr(guard.audit, "_fused", False) else "torch",
        "forwards": st["forwards"], "audit_queries": st.get("audit_queries", 0),
        "audit_forwards_skipped": st.get("audit_forwards_skipped", 0),
        "write_slots_checked": st.get("write_slots_checked", 0),
        "queries_audited": len(errs), "errors_recorded_with_metadata": len(rec.queries),
        "error": summary(errs), "max_by_group": {g: max(v) for g, v in by_group.items()},
        "top_queries": top,
        "violations": len(violations), "violation_text": violations[:10],
        "internal_errors": st.get("internal_errors", 0), "internal_error_text": cap.errors()[:5],
        "notes": cap.notes(), "request_errors": len(failed), "first_request_error": next(iter(failed.values()), None),
        "missing_requests": cfg.requests * cfg.forks - len(run.out), "exception": run.error,
        "events": run.events, "seconds": round(time.perf_counter() - t0, 2),
        "smax": max((q["smax"] for q in rec.queries if q["smax"] is not None), default=None),
        "normalized_max": max(normalized(rec.queries, dtype, "smax"), default=None),
        "normalized_pmean_max": max(normalized(rec.queries, dtype, "pmean"), default=None),
        "_errors": errs, "_norm": normalized(rec.queries, dtype, "smax"),
        "_norm_pm": normalized(rec.queries, dtype, "pmean"),
    }


def normalized(queries: list[dict[str, Any]], dtype: str, key: str) -> list[float]:
    """Each query's error in units of ``u * (1 + logit size)`` (``key``: "smax" or "pmean")."""
    return [q["err"] / (UNIT[dtype] * (1 + q[key])) for q in queries if q.get(key) is not None]


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


def run_faulty(fc: Any, dtype: str, seed: int, factor: float = 1.0) -> dict[str, Any]:
    """:func:`kvcanary.faults.runner._run_transformers` with the audit on, on the class's model in
    ``dtype``, recording every audited query."""
    from kvcanary.config import CanaryConfig
    from kvcanary.engines.transformers import cb_configs, protect
    from kvcanary.faults.runner import CB_FAULTS, FULL_AUDIT, KERNEL_FAULTS, transformers_model
    from kvcanary.faults.transformers_cb import CbFault
    from kvcanary.violations import Check

    t0 = time.perf_counter()
    model = sharpen(transformers_model(fc).to(DTYPES[dtype]), factor)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(24)] for _ in range(3)]
    prompts = [rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(2, 12))] for _ in range(20)]
    gen, cb = cb_configs(max_new_tokens=10)
    injector = {**CB_FAULTS, **KERNEL_FAULTS}[fc.name]
    fault = CbFault(injector, at=3, seed=seed)
    config = CanaryConfig(mode="log", content_budget_bytes=None, write_check=True, audit_queries=FULL_AUDIT)
    rec = Recorder()
    with captured() as cap, logit_stats(), torch.inference_mode(), protect(model, config) as guard:
        rec.attach(guard)
        guard.hooks.append(fault)
        model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    st = guard.stats()
    at = fault.injected_at
    early = [guard.describe(v) for v in guard.violations if at is None or v.step < at]
    hits = [v for v in guard.violations if v.checks & Check.ATTENTION and at is not None and v.step >= at]
    others = [guard.describe(v) for v in guard.violations
              if at is not None and v.step >= at and not v.checks & Check.ATTENTION]
    hit_err = [v.stored_link / 1e6 for v in hits]
    hit_tol = sorted({v.expected_link / 1e6 for v in hits})
    aff = [q for q in rec.queries if affected(injector, q, fault)]
    aff_err = [q["err"] for q in aff]
    before = [q["err"] for q in rec.queries if at is None or q["step"] < at]
    after_other = [q["err"] for q in rec.queries if at is not None and q["step"] >= at and q not in aff]
    tol = aff[0]["tol"] if aff else (rec.queries[0]["tol"] if rec.queries else None)
    return {
        "fault": fc.name, "injector": injector, "dtype": dtype, "seed": seed, "injected_at": at,
        "audit_path": "compiled" if getattr(guard.audit, "_fused", False) else "torch",
        "landed_at": fault.landed_at, "detail": {k: v for k, v in fault.detail.items() if k != "watch_block"},
        "detected": bool(hits), "tolerance": tol, "violation_tolerances": hit_tol,
        "violations": len(hits), "violation_error": summary(hit_err),
        "violation_median": quantile(sorted(hit_err), 0.5),
        "first_violation": guard.describe(hits[0]) if hits else None,
        "affected_queries": len(aff), "affected_error": summary(aff_err),
        "affected_median": quantile(sorted(aff_err), 0.5),
        "affected_p10": quantile(sorted(aff_err), 0.1),
        "affected_above_tolerance": sum(e > (tol or 0) for e in aff_err),
        "clean_queries_before_injection": summary(before),
        "unaffected_queries_after_injection": summary(after_other),
        "false_positives_before_injection": early[:5], "other_violations": others[:5],
        "forwards": st["forwards"], "audit_queries": st.get("audit_queries", 0),
        "internal_errors": st.get("internal_errors", 0), "internal_error_text": cap.errors()[:5],
        "seconds": round(time.perf_counter() - t0, 2),
        "affected_smax_max": max((q["smax"] for q in aff if q["smax"] is not None), default=None),
        "affected_normalized_max": max(normalized(aff, dtype, "smax"), default=None),
        "affected_normalized_pmean_max": max(normalized(aff, dtype, "pmean"), default=None),
        "_affected": aff_err, "_aff_q": [(q["err"], q["smax"], q["pmean"]) for q in aff],
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
    args = ap.parse_args()
    if args.quick:
        args.configs, args.fault_seeds = 4, 1
    torch.set_num_threads(1)

    from kvcanary.audit import TOLERANCE
    from kvcanary.faults.catalog import BY_NAME
    from kvcanary.faults.cb_soak import draw_configs
    from kvcanary.faults.runner import KERNEL_FAULTS

    rev = commit()
    dirty = src_changes()
    if dirty:
        print(f"note: src/ differs from {rev}: {', '.join(dirty)}", flush=True)
    t_start = time.perf_counter()
    tolerances = {name: TOLERANCE[dt] for name, dt in DTYPES.items()}
    print(f"audit calibration at {rev}: {args.configs} clean configurations (seed {args.seed}), "
          f"{args.fault_seeds} fault seed(s), sharpen {args.sharpen:g}; tolerances {tolerances}", flush=True)

    # clean
    configs = draw_configs(args.configs, args.seed)
    dtypes = draw_dtypes(args.configs, args.seed)
    clean: list[dict[str, Any]] = []
    errs_by_dtype: dict[str, list[float]] = {d: [] for d in DTYPES}
    norm_by_dtype: dict[str, list[float]] = {d: [] for d in DTYPES}
    normpm_by_dtype: dict[str, list[float]] = {d: [] for d in DTYPES}
    arch_max: dict[str, dict[str, float]] = {d: {} for d in DTYPES}
    impl_max: dict[str, dict[str, float]] = {d: {} for d in DTYPES}  # sdpa vs eager (rounds the logits)
    for k, (cfg, dtype) in enumerate(zip(configs, dtypes)):
        with contextlib.redirect_stdout(sys.stderr):
            res = run_clean(cfg, dtype, args.sharpen)
        errs = res.pop("_errors")
        errs_by_dtype[dtype] += errs
        norm_by_dtype[dtype] += res.pop("_norm")
        normpm_by_dtype[dtype] += res.pop("_norm_pm")
        if errs:
            arch_max[dtype][cfg.arch] = max(arch_max[dtype].get(cfg.arch, 0.0), max(errs))
            impl = res["attn_implementation"]
            impl_max[dtype][impl] = max(impl_max[dtype].get(impl, 0.0), max(errs))
        clean.append(res)
        bad = [f"{res['violations']} VIOLATION(S)" if res["violations"] else "",
               f"{res['internal_errors']} INTERNAL ERROR(S)" if res["internal_errors"] else "",
               f"{res['request_errors']} failed requests" if res["request_errors"] else "",
               f"exception {res['exception']}" if res["exception"] else ""]
        print(f"[clean {k + 1}/{len(configs)}] {dtype:8s} {res['label']} ({res['attn_implementation']}, "
              f"{res['audit_path']} audit): "
              f"{res['forwards']} forwards, {res['queries_audited']} queries, max error {fmt(res['error']['max'])} "
              f"(max |logit| {fmt(res['smax'])}, max err/(u(1+|s|max)) {fmt(res['normalized_max'])}) "
              f"(tol {tolerances[dtype]:g}) {' '.join(b for b in bad if b)} ({res['seconds']:.1f} s)", flush=True)
        for text in res["violation_text"][:3] + res["internal_error_text"][:2]:
            print(f"    {text.splitlines()[0] if text else text}", flush=True)

    # faulty
    faulty: list[dict[str, Any]] = []
    classes = [name for name in KERNEL_FAULTS if name != "write_lands_zeros"]
    if not args.no_faults:
        total = len(classes) * len(DTYPES) * args.fault_seeds
        n = 0
        for name in classes:
            for dtype in DTYPES:
                for seed in range(args.fault_seeds):
                    n += 1
                    with contextlib.redirect_stdout(sys.stderr):
                        res = run_faulty(BY_NAME[name], dtype, seed, args.sharpen)
                    faulty.append(res)
                    ierr_note = f"; {res['internal_errors']} INTERNAL ERROR(S)" if res["internal_errors"] else ""
                    print(f"[fault {n}/{total}] {dtype:8s} {name} seed={seed}: injected at forward "
                          f"{res['injected_at']}, {'detected' if res['detected'] else 'MISSED'} "
                          f"({res['violations']} violations, min error {fmt(res['violation_error']['min'])}); "
                          f"{res['affected_queries']} affected queries: min {fmt(res['affected_error']['min'])}, "
                          f"median {fmt(res['affected_median'])}, {res['affected_above_tolerance']} above tol "
                          f"{fmt(res['tolerance'])}"
                          f"{'; FALSE POSITIVE before injection' if res['false_positives_before_injection'] else ''}"
                          f"{ierr_note}"
                          f" ({res['seconds']:.1f} s)", flush=True)

    # summary
    report: dict[str, Any] = {"commit": rev, "src_changes": src_changes(), "seed": args.seed, "configs": args.configs,
                              "fault_seeds": args.fault_seeds, "sharpen": args.sharpen, "audit_queries": AUDIT_QUERIES,
                              "torch": torch.__version__, "tolerances": tolerances, "dtypes": {}}
    try:
        import transformers
        report["transformers"] = transformers.__version__
    except Exception:
        pass
    print("\n== clean (per dtype) ==")
    print(f"{'dtype':9s} {'configs':>7s} {'queries':>8s} {'p50':>9s} {'p99':>9s} {'p99.9':>9s} {'max':>9s} "
          f"{'tol':>7s} {'viol':>5s} {'int.err':>7s}  per-arch max; per-implementation max")
    for d in DTYPES:
        s = summary(errs_by_dtype[d])
        rows = [r for r in clean if r["dtype"] == d]
        viol = sum(r["violations"] for r in rows)
        ierr = sum(r["internal_errors"] for r in rows)
        arch = ", ".join(f"{a}={fmt(v)}" for a, v in sorted(arch_max[d].items()))
        arch += "; " + ", ".join(f"{a}={fmt(v)}" for a, v in sorted(impl_max[d].items()))
        print(f"{d:9s} {len(rows):7d} {s['n']:8d} {fmt(s['p50']):>9s} {fmt(s['p99']):>9s} {fmt(s['p999']):>9s} "
              f"{fmt(s['max']):>9s} {tolerances[d]:7.0e} {viol:5d} {ierr:7d}  {arch}")
        report["dtypes"][d] = {"clean": {**s, "configs": len(rows), "violations": viol, "internal_errors": ierr,
                                         "per_arch_max": arch_max[d], "per_implementation_max": impl_max[d],
                                         "max_abs_logit": max((r["smax"] for r in rows if r["smax"] is not None),
                                                              default=None),
                                         "normalized_smax": summary(norm_by_dtype[d]),
                                         "normalized_pmean": summary(normpm_by_dtype[d])}}
    if faulty:
        print("\n== faulty (per class and dtype; errors of ATTENTION violations / of the affected queries) ==")
        print(f"{'class':22s} {'dtype':9s} {'detected':>9s} {'viol':>5s} {'viol min':>9s} {'viol med':>9s} "
              f"{'aff':>5s} {'aff min':>9s} {'aff p10':>9s} {'aff med':>9s} {'aff>tol':>10s} {'detect<':>9s}")
        for name in classes:
            for d in DTYPES:
                runs = [r for r in faulty if r["fault"] == name and r["dtype"] == d]
                aff = sorted(e for r in runs for e in r["_affected"])
                vmins = [r["violation_error"]["min"] for r in runs if r["violation_error"]["min"] is not None]
                vmeds = [r["violation_median"] for r in runs if r["violation_median"] is not None]
                detected = f"{sum(r['detected'] for r in runs)}/{len(runs)}"
                above = sum(r["affected_above_tolerance"] for r in runs)
                row = {"runs": len(runs), "detected_runs": sum(r["detected"] for r in runs),
                       "violations": sum(r["violations"] for r in runs),
                       "violation_min": min(vmins) if vmins else None,
                       "violation_median_of_runs": sorted(vmeds)[len(vmeds) // 2] if vmeds else None,
                       "affected_queries": len(aff), "affected_min": aff[0] if aff else None,
                       "affected_p10": quantile(aff, 0.1), "affected_median": quantile(aff, 0.5),
                       "affected_above_tolerance": above,
                       # the loosest tolerance that still detects every run: the smallest run maximum
                       "detect_threshold": min((r["affected_error"]["max"] for r in runs
                                                if r["affected_error"]["max"] is not None), default=None)}
                report["dtypes"][d].setdefault("faulty", {})[name] = row
                print(f"{name:22s} {d:9s} {detected:>9s} {row['violations']:5d} {fmt(row['violation_min']):>9s} "
                      f"{fmt(row['violation_median_of_runs']):>9s} {len(aff):5d} {fmt(row['affected_min']):>9s} "
                      f"{fmt(row['affected_p10']):>9s} {fmt(row['affected_median']):>9s} {f'{above}/{len(aff)}':>10s} "
                      f"{fmt(row['detect_threshold']):>9s}")
        print("\n== margins (per dtype) ==")
        for d in DTYPES:
            cmax = report["dtypes"][d]["clean"]["max"]
            rows = report["dtypes"][d]["faulty"]
            vmin = min((r["violation_min"] for r in rows.values() if r["violation_min"] is not None), default=None)
            amin = min((r["affected_min"] for r in rows.values() if r["affected_min"] is not None), default=None)
            p10 = min((r["affected_p10"] for r in rows.values() if r["affected_p10"] is not None), default=None)
            missed = [n for n, r in rows.items() if r["detected_runs"] < r["runs"]]
            thr = {n: r["detect_threshold"] for n, r in rows.items() if r["detect_threshold"] is not None}
            tight = min(thr, key=lambda n: thr[n]) if thr else None
            ratio = (lambda x: None if x is None or not cmax else x / cmax)
            m = {"clean_max": cmax, "smallest_violation_error": vmin, "smallest_affected_error": amin,
                 "smallest_affected_p10": p10, "ratio_violation_min_to_clean_max": ratio(vmin),
                 "ratio_affected_min_to_clean_max": ratio(amin), "ratio_affected_p10_to_clean_max": ratio(p10),
                 "tolerance": tolerances[d], "tolerance_over_clean_max": ratio(tolerances[d]),
                 "classes_missed_in_some_run": missed, "tightest_class": tight,
                 "smallest_detect_threshold": thr.get(tight) if tight else None,
                 "ratio_detect_threshold_to_clean_max": ratio(thr.get(tight)) if tight else None}
            report["dtypes"][d]["margin"] = m
            print(f"{d:9s} clean max {fmt(cmax)}; tolerance {tolerances[d]:g} ({fmt(m['tolerance_over_clean_max'])}x "
                  f"the clean max); smallest violation error {fmt(vmin)} "
                  f"({fmt(m['ratio_violation_min_to_clean_max'])}x); "
                  f"smallest affected-query error {fmt(amin)} ({fmt(m['ratio_affected_min_to_clean_max'])}x), "
                  f"smallest class p10 {fmt(p10)} ({fmt(m['ratio_affected_p10_to_clean_max'])}x); "
                  f"every run detected below {fmt(m['smallest_detect_threshold'])} ({tight}; "
                  f"{fmt(m['ratio_detect_threshold_to_clean_max'])}x the clean max); "
                  f"missed: {', '.join(missed) or 'none'}")
    # a tolerance that scales with the logits: c * u * (1 + |s|), c per dtype = 5x its largest normalized clean error
    print("\n== scale-aware tolerance: c(dtype) * u(dtype) * (1 + |s|), |s| the max or the p-weighted mean |logit| "
          "a query reads; c = 5x the dtype's largest clean error in units of u * (1 + |s|) ==")
    for key, label in (("smax", "max |logit|"), ("pmean", "p-weighted mean |logit|")):
        by = norm_by_dtype if key == "smax" else normpm_by_dtype
        cmax = {d: max(v) if v else None for d, v in by.items()}
        cs = {d: 5 * v if v is not None else None for d, v in cmax.items()}
        print(f"{label}: clean maxima " + ", ".join(f"{d} {fmt(v)}" for d, v in cmax.items())
              + "; c " + ", ".join(f"{d} {fmt(v)}" for d, v in cs.items()))
        scaled: dict[str, Any] = {"clean_normalized_max": cmax, "c": cs, "faulty": {}}
        for name in classes:
            for d in DTYPES:
                runs = [r for r in faulty if r["fault"] == name and r["dtype"] == d]
                c = cs[d]
                if not runs or c is None:
                    continue
                idx = 1 if key == "smax" else 2  # (err, smax, pmean) of each affected query
                norm = [[q[0] / (UNIT[d] * (1 + q[idx])) for q in r["_aff_q"] if q[idx] is not None] for r in runs]
                run_max = [max(n, default=0.0) for n in norm]
                caught = sum(m > c for m in run_max)
                frac = [sum(x > c for x in n) for n in norm]
                scaled["faulty"].setdefault(name, {})[d] = {"runs": len(runs), "detected_runs": caught,
                                                            "run_max_min": min(run_max),
                                                            "queries_above": sum(frac),
                                                            "queries": sum(len(r["_aff_q"]) for r in runs)}
        report[f"scale_aware_{key}"] = scaled
        for name, per in scaled["faulty"].items():
            print(f"  {name:22s} " + "  ".join(
                f"{d} {v['detected_runs']}/{v['runs']} runs (min run max {fmt(v['run_max_min'])}, "
                f"{v['queries_above']}/{v['queries']} q)" for d, v in per.items()))
    for r in faulty:
        r.pop("_affected", None)
        r.pop("_aff_q", None)
    report["clean_runs"] = clean
    report["faulty_runs"] = faulty
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    tag = f"sharpen{args.sharpen:g}_" if args.sharpen != 1 else ""
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"audit_calibration_{tag}{rev}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\nwrote {out} ({report['wall_s']:.0f} s)", flush=True)
    bad = sum(r["violations"] + r["internal_errors"] for r in clean)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
