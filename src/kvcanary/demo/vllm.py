"""``kvcanary demo --engine vllm``: the chat demo through vLLM's engine, the canary turned on by its
one flag, ``kv_transfer_config={"kv_connector": "KvCanaryConnector", "kv_role": "kv_both"}``.

SmolLM2-135M-Instruct (or ``--model PATH``) answers the chat demo's questions
(:data:`kvcanary.demo.chat.QUESTIONS`, greedy) through ``vllm.LLM``, each question asked twice in one
batch (``--requests``, default 16): vLLM's blocks hold 32 tokens on a CPU, more than the shared system
prompt, so it is the second ask of a question that reads the first's prompt block from the prefix
cache, in the same forwards. Each engine runs in a process of its own (:mod:`kvcanary.demo.vllm_engine`):
one without the canary, one with it; under ``--inject`` one in ``log`` mode and one in ``repair`` mode
(``kv_load_failure_policy: "recompute"``), both verifying every read byte, each running the questions
clean and then once per fault of :data:`FAULTS`, the prefix cache emptied before each run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from typing import Any, Callable

from kvcanary import real_model
from kvcanary.config import CanaryConfig
from kvcanary.real_model import QUESTIONS
from kvcanary.demo.common import coverage, finish_chat, pool_fits, violation_report

BLOCK = 32  # the demo engine's block size (vLLM's CPU attention takes multiples of 32)
CONTEXT = 512  # the demo engine's max_model_len
# the faults --inject shows, each injected at the third forward of a run (or the first later one with a target)
FAULTS = ("flip_v", "reuse", "redirect")
AT = 3


def run(args: argparse.Namespace, config: CanaryConfig) -> int:
    """The demo through vLLM; the exit status (see :mod:`kvcanary.cli`)."""
    if importlib.util.find_spec("vllm") is None:
        print("kvcanary demo --engine vllm needs vLLM: run it in vLLM's environment (scripts/setup-vllm builds "
              ".venv-vllm; pip install 'kvcanary[vllm,real]' elsewhere)", file=sys.stderr)
        return 2
    if args.model == "tiny":
        print("kvcanary demo --engine vllm: --model: expected a trained chat model (the default, or a local "
              "checkpoint directory), got 'tiny' (a random tiny model runs through vLLM in `kvcanary selftest`)",
              file=sys.stderr)
        return 2
    if args.model is not None and not os.path.isdir(args.model):
        print(f"kvcanary demo: --model: {args.model!r} is not a directory (expected a local checkpoint directory "
              "with a tokenizer and chat template)", file=sys.stderr)
        return 2
    say = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    loaded = _load(args)
    if isinstance(loaded, str):
        print(f"kvcanary demo: {loaded}", file=sys.stderr)
        return 2
    path, tok, per_slot, load_s, converted = loaded
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
    prompts = [real_model.chat_prompt(tok, q) for q in questions]
    refused = _sizes(args, prompts, per_slot)
    if refused:
        print(f"kvcanary demo: {refused}", file=sys.stderr)
        return 2
    base = {"model": path, "dtype": args.dtype, "prompts": prompts, "max_tokens": args.max_new_tokens,
            "stop": [tok.eos_token_id], "blocks": args.blocks}
    name = real_model.NAME if args.model is None else os.path.basename(os.path.normpath(args.model))
    n = len(prompts)
    try:
        say(f"{n} requests through {name} ({args.dtype}) on vLLM, without the canary (an engine process, ~30 s) ...")
        off = _engine({**base, "canary": None, "runs": [{}]})
        say("with the canary (the KvCanaryConnector flag; another engine process) ...")
        on = _engine({**base, "canary": {"mode": config.mode}, "runs": [{}]})
        faults = _faults(args, config, base, say) if args.inject else None
    except RuntimeError as e:
        print(f"kvcanary demo: {e}", file=sys.stderr)
        return 1

    def text(tokens: list[int]) -> str:
        return str(tok.decode(tokens, skip_special_tokens=True)).strip()

    clean = [text(t) for t in off["runs"][0]["tokens"]]
    r = on["runs"][0]
    st = r["stats"]
    same = [a == b for a, b in zip(off["runs"][0]["tokens"], r["tokens"])]
    t_off, t_on = off["runs"][0]["generate_s"], r["generate_s"]
    summary: dict[str, Any] = {
        "engine": f"vLLM {on['vllm']} (CPU, one in-process engine per run, the KvCanaryConnector flag)",
        "model": name, "dtype": args.dtype, "requests": n,
        "tokens_generated": sum(len(t) for t in r["tokens"]),
        "prefix_cache_hit_tokens": sum(r["cached_tokens"]),
        "forwards": st["forwards"], "slots_verified": st["slots_verified"], "slots_stamped": st["slots_stamped"],
        "content_bytes_checked": st["content_bytes_verified"] + st["content_bytes_stamped"],
        "slots_unverifiable": st["slots_unverifiable"], "write_slots_checked": st.get("write_slots_checked", 0),
        "attention_queries_audited": st.get("audit_queries", 0), **coverage(st),
        "violations": st["violations"], "internal_errors": st["internal_errors"], "outputs_identical": all(same),
        "wall_s_without_canary": round(t_off, 3), "wall_s_with_canary": round(t_on, 3),
        "canary_time_s": round(st["canary_us"] / 1e6, 3),  # host time inside the connector's worker hooks
        "canary_share_pct": round(100 * st["canary_us"] / 1e6 / t_on, 1),
        "canary_ms_per_forward": round(st["canary_us"] / 1e3 / max(st["forwards"], 1), 2),
        "forward_ms": round(1e3 * t_on / max(st["forwards"], 1), 1),
        "scheduler_side_ms": round(st.get("scheduler_us", 0) / 1e3, 1),
        "threads": on["threads"],
        "engine_start_s_without_canary": round(off["engine_s"], 2),
        "engine_start_s_with_canary": round(on["engine_s"], 2),  # the canary's compiled loops loaded, included
        "model_load_s": round(load_s, 2), "model_converted": converted,
        "system_prompt": real_model.SYSTEM_PROMPT,
        "answers": [{"request": f"req_{i}", "question": q, "without_canary": c, "with_canary": text(t),
                     "identical": s, "prefix_cached_tokens": k}
                    for i, (q, c, t, s, k) in enumerate(zip(questions, clean, r["tokens"], same, r["cached_tokens"]))],
    }
    good = faults is None or _judge(summary, faults, off, clean, questions, text)
    return finish_chat(summary, st, same, good, args.json)


def _load(args: argparse.Namespace) -> tuple[str, Any, int, float, bool] | str:
    """The checkpoint directory (converted first on a dtype's first run), its tokenizer, the KV bytes
    of one slot with the canary's, the seconds it took and whether it was converted; or why not."""
    try:
        import transformers
    except ImportError:
        return "kvcanary demo --engine vllm needs transformers (vLLM's own install brings it)"
    from kvcanary.errors import UnsupportedError

    t0 = time.perf_counter()
    converted = args.model is None and not real_model.is_converted(real_model.target_dir(args.dtype))
    try:
        path = real_model.vllm_path(args.dtype) if args.model is None else args.model
    except UnsupportedError as e:
        return str(e)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        c = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        return (f"--model: {path!r} does not load as a checkpoint: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
    if not getattr(tok, "chat_template", None):
        return f"--model: {path}: the tokenizer has no chat template"
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_slot = c.num_hidden_layers * 2 * kv_heads * head_dim * (2 if args.dtype == "bfloat16" else 4) + 56
    return path, tok, per_slot, time.perf_counter() - t0, converted


def _sizes(args: argparse.Namespace, prompts: list[list[int]], per_slot: int) -> str | None:
    """Why the run's sizes do not fit the demo engine ("expected X, got Y"), or ``None``."""
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > CONTEXT:
        return (f"--max-new-tokens: expected at most {CONTEXT - longest} (the vLLM demo's {CONTEXT}-token context "
                f"less the longest prompt, {longest} tokens), got {args.max_new_tokens}")
    need = -(-(longest + args.max_new_tokens) // BLOCK)
    if args.blocks < need:
        return (f"--blocks: expected at least {need} blocks of {BLOCK} slots (the longest prompt and its answer), "
                f"got {args.blocks}")
    return pool_fits(args, per_slot, "K and V of every layer and the canary's 56 bytes", block=BLOCK)


def _engine(cfg: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    """:func:`kvcanary.demo.vllm_engine.run` in a fresh interpreter; ``RuntimeError`` with the end of its
    output when it fails."""
    from kvcanary.faults.vllm_runner import run_in_subprocess

    return run_in_subprocess(cfg, timeout=timeout, module="kvcanary.demo.vllm_engine")


def _faults(args: argparse.Namespace, config: CanaryConfig, base: dict[str, Any],
            say: Callable[[str], None]) -> dict[str, Any]:
    """The ``log`` and ``repair`` engines' runs: a clean run, then each fault of :data:`FAULTS`."""
    logfile = config.violations_log or os.path.join(tempfile.mkdtemp(prefix="kvcanary-demo-"), "violations.jsonl")
    runs: list[dict[str, Any]] = [{}] + [{"fault": f, "at": AT, "seed": args.seed} for f in FAULTS]
    every = {"content_budget_bytes": "none"}  # every read byte verified: a flipped byte is found on its next read
    say(f"injecting {', '.join(FAULTS)}, one per run: log mode (what a user is served), every read byte verified ...")
    log = _engine({**base, "canary": {"mode": "log", "violations_log": logfile, **every}, "runs": runs})
    say("the same faults in repair mode (kv_load_failure_policy: recompute) ...")
    fix = _engine({**base, "canary": {"mode": "repair", **every}, "runs": runs})
    return {"log": log, "repair": fix, "logfile": logfile}


def _judge(summary: dict[str, Any], faults: dict[str, Any], off: dict[str, Any], clean: list[str],
           questions: list[str], text: Callable[[list[int]], str]) -> bool:
    """Add each fault's detection and answers to ``summary``; whether every fault was detected, no
    answer changed without a detection, and repair served every hurt request its clean answer or an error."""
    log, fix = faults["log"]["runs"], faults["repair"]["runs"]
    ok = all(r["tokens"] == off["runs"][0]["tokens"] and not r["violations"] for r in (log[0], fix[0]))
    st = log[0]["stats"]  # the clean run with every read byte verified: what the canary costs at its most
    summary["every_byte_canary_share_pct"] = round(100 * st["canary_us"] / 1e6 / log[0]["generate_s"], 1)
    summary["every_byte_canary_ms_per_forward"] = round(st["canary_us"] / 1e3 / max(st["forwards"], 1), 2)
    summary["every_byte_clean"] = ok
    found, totals = [], {"repairs": 0, "requests_failed": 0, "violations": 0, "internal_errors": 0}
    for name, lr, rr in zip(FAULTS, log[1:], fix[1:]):
        f, good = _one_fault(name, lr, rr, clean, questions, text)
        found.append(f)
        for k in totals:
            totals[k] += f["repair"][k]
        ok = ok and good
    summary["injected"] = found
    summary["repair_run"] = {**totals, "served_only_clean_answers": not any(f["repair"]["served_other_text"]
                                                                            for f in found),
                             "untouched_changed": sum(len(f["repair"]["untouched_changed"]) for f in found)}
    summary["report"] = violation_report(faults["logfile"])
    return ok


def _one_fault(name: str, lr: dict[str, Any], rr: dict[str, Any], clean: list[str], questions: list[str],
               text: Callable[[list[int]], str]) -> tuple[dict[str, Any], bool]:
    """One fault's ``log`` run ``lr`` and ``repair`` run ``rr`` judged against the clean answers: its
    summary entry, and whether it was detected, with no report before it, no answer changed without a
    detection and every request a detection names served its clean answer or an error."""
    at = lr["fault"]["step"]
    early = [v for v in lr["violations"] if at is None or v["step"] < at]  # before the fault: false reports
    hits = [v for v in lr["violations"] if at is not None and v["step"] >= at]
    named = {v["request"] for v in hits + rr["violations"] if v["request"] is not None}
    served, fixed = [text(t) for t in lr["tokens"]], [_answer(rr, i, text) for i in range(len(clean))]
    failed = [f == "error" for f in rr["finish"]]
    rows = [{"request": f"req_{i}", "question": questions[i], "clean": clean[i], "log": served[i], "repair": fixed[i],
             "log_changed": served[i] != clean[i], "repair_equals_clean": fixed[i] == clean[i],
             "repair_failed": failed[i], "log_cut_at": len(lr["tokens"][i]) if lr["finish"][i] == "length" else None}
            for i in sorted(named)]
    changed = [questions[i] for i in range(len(clean)) if i not in named and served[i] != clean[i]]
    wrong = [questions[i] for i in sorted(named) if not failed[i] and fixed[i] != clean[i]]
    # a request no detection named, every byte it read verified, answering otherwise: the batch's arithmetic
    untouched = [{"request": f"req_{i}", "question": questions[i], "clean": clean[i], "repair": fixed[i]}
                 for i in range(len(clean)) if i not in named and not failed[i] and fixed[i] != clean[i]]
    s = rr["stats"]
    rep = {"repairs": s.get("repairs", 0), "requests_failed": s.get("requests_failed", 0),
           "violations": s["violations"], "internal_errors": s["internal_errors"], "served_other_text": wrong,
           "untouched_changed": untouched}
    first = hits[0] if hits else None
    same = lr["fault"] == rr["fault"]
    f = {"fault": name, "injected_at_forward": lr["fault"]["injected_at_forward"], "detail": lr["fault"]["detail"],
         "detected": bool(hits), "first_detection": f"{first['text']} (req_{first['request']})" if first else None,
         "detections": len(hits), "false_reports_before": len(early), "requests": rows,
         "harmful_tokens_served": lr["stats"].get("harmful_tokens", 0), "changed_undetected": changed,
         "repair_injected_same": same, "repair": rep}
    if not same:  # the repair engine found the pool's free blocks in another order: its target is shown too
        f.update(repair_detail=rr["fault"]["detail"], repair_injected_at_forward=rr["fault"]["injected_at_forward"])
    good = (bool(hits) and not early and not changed and not wrong and s["violations"] > 0
            and s["internal_errors"] == 0 and lr["stats"]["internal_errors"] == 0)
    return f, good


def _answer(run: dict[str, Any], i: int, text: Callable[[list[int]], str]) -> str:
    """Request ``i``'s answer in ``run``, or for a failed one the canary's last evidence against it."""
    if run["finish"][i] != "error":
        return text(run["tokens"][i])
    why = [v["text"] for v in run["violations"] if v["request"] == i]
    return f"(failed: {why[-1] if why else 'an error, no text'})"
