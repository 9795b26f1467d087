"""Harm as answers changed: the selftest's transformers fault classes on the trained model's chat
questions.

Each fault class of :data:`kvcanary.faults.runner.CB_FAULTS` and :data:`KERNEL_FAULTS` is injected
into continuous batching of SmolLM2-135M-Instruct (:mod:`kvcanary.real_model`) answering
:data:`kvcanary.real_model.QUESTIONS` under the shared system prompt with greedy decoding, once in
``log`` mode (what a user is served) and once, at the same forward with the same seed, in ``repair``
mode. Each answer is compared with the clean run's (no canary, no fault) as text:

- ``log``: answers changed (a user read other text), and of those the ones no detection named;
- ``repair``: answers changed (other text served: ``repair`` must give none), and apart from them
  the requests that failed after ``repair_limit`` repairs (an error instead of text, which
  ``repair`` allows for a corruption recomputing does not fix).

The canary runs as the selftest runs it in transformers: every read byte verified, the write
check and the read audit on every forward (``audit_queries`` per forward, default
:data:`kvcanary.faults.runner.FULL_AUDIT`). ``window_off_by_one`` needs a sliding-window layer,
which the real model has not: it is reported as not applicable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from kvcanary.config import CanaryConfig, Mode
from kvcanary.faults.catalog import BY_NAME
from kvcanary.faults.runner import CB_FAULTS, FULL_AUDIT, KERNEL_FAULTS, SLIDING_FAULTS

# the selftest's transformers classes, in its order, but those it runs at the default configuration at
# their own forwards (kvcanary.faults.runner.INJECT_AT), whose answers this module does not measure
CLASSES = tuple(n for n in (*CB_FAULTS, *KERNEL_FAULTS) if not BY_NAME[n].at_default)
MAX_NEW_TOKENS = 48  # the demo's
NUM_BLOCKS = 128  # the demo's pool


@dataclass
class Chat:
    """The trained model, its tokenizer, the questions' prompts and the clean answers."""

    model: Any
    tokenizer: Any
    questions: list[str]
    prompts: list[list[int]]
    gen: Any
    cb: Any
    clean: list[str]

    def generate(self, config: CanaryConfig | None = None, hooks: Sequence[Any] = ()) -> tuple[list[Any], Any]:
        """One run of every question (under ``config`` with ``hooks`` when given): the outputs in the
        questions' order, and the protection (``None`` without the canary)."""
        import torch

        from kvcanary.engines.transformers.entry import protect

        guard = protect(self.model, config) if config is not None else None
        with torch.inference_mode():
            if guard is None:
                out = self.model.generate_batch(self.prompts, generation_config=self.gen,
                                                continuous_batching_config=self.cb, progress_bar=False)
            else:
                guard.hooks.extend(hooks)
                with guard:
                    out = self.model.generate_batch(self.prompts, generation_config=self.gen,
                                                    continuous_batching_config=self.cb, progress_bar=False)
        return list(out.values()), guard

    def text(self, o: Any) -> str:
        return self.tokenizer.decode(o.generated_tokens, skip_special_tokens=True).strip()


def chat(dtype: str = "bfloat16", max_new_tokens: int = MAX_NEW_TOKENS) -> Chat:
    """The trained model in ``dtype`` with the questions' prompts and its clean answers."""
    from kvcanary import real_model
    from kvcanary.engines.transformers.models import cb_configs

    model, tok = real_model.load(dtype, say=None)
    questions = list(real_model.QUESTIONS)
    prompts = [real_model.chat_prompt(tok, q) for q in questions]
    gen, cb = cb_configs(max_new_tokens=max_new_tokens, num_blocks=NUM_BLOCKS)
    gen.eos_token_id = tok.eos_token_id  # answers end at the chat template's end of turn
    gen.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    c = Chat(model, tok, questions, prompts, gen, cb, [])
    c.generate()  # the first run warms the allocator and kernels
    c.clean = [c.text(o) for o in c.generate()[0]]
    return c


def config(mode: Mode, audit_queries: int | None = FULL_AUDIT) -> CanaryConfig:
    """The selftest's transformers configuration in ``mode``: ``audit_queries`` on every forward, or
    (``None``) the default write check and read audit (every forward, within the time budget)."""
    if audit_queries is None:
        return CanaryConfig(mode=mode, content_budget_bytes=None)
    return CanaryConfig(mode=mode, content_budget_bytes=None, write_check=True, audit_queries=audit_queries,
                        audit_every=1, audit_budget=None)


def run_class(c: Chat, name: str, seed: int = 0, at: int = 3, audit_queries: int | None = FULL_AUDIT) -> dict[str, Any]:
    """Fault class ``name`` injected at forward ``at`` with ``seed`` into a ``log`` run and a
    ``repair`` run of the questions; the answers each changed (see the module docstring)."""
    from kvcanary.faults.transformers_cb import CbFault
    from kvcanary.violations import Check

    row: dict[str, Any] = {"fault": name, "seed": seed, "at": at, "audit_queries": audit_queries}
    if name in SLIDING_FAULTS:
        return {**row, "applicable": False, "why": "the real model has no sliding-window layer"}
    injector = {**CB_FAULTS, **KERNEL_FAULTS}[name]
    checks = BY_NAME[name].checks
    kv = logging.getLogger("kvcanary")
    level = kv.level
    kv.setLevel(logging.CRITICAL)  # the rows below say what was found
    try:
        runs = {}
        modes: tuple[Mode, ...] = ("log", "repair")
        for mode in modes:
            fault = CbFault(injector, at=at, seed=seed)
            out, guard = c.generate(config(mode, audit_queries), [fault])
            st = guard.stats()
            hits = [v for v in guard.violations if fault.landed_at is not None and v.step >= fault.landed_at
                    and v.checks & checks]
            named = {guard.request_of(v) for v in guard.violations}
            texts = [c.text(o) if o.error is None else None for o in out]
            changed = [i for i, t in enumerate(texts) if t is not None and t != c.clean[i]]
            runs[mode] = {
                "injected_at": fault.injected_at, "detail": {k: v for k, v in fault.detail.items() if k != "watch_block"},
                "detected": bool(hits), "first_detection": guard.describe(hits[0]) if hits else None,
                "violations": len(guard.violations), "internal_errors": st["internal_errors"],
                "harmful_tokens": int(st.get("harmful_tokens", 0)), "repairs": int(st.get("repairs", 0)),
                "answers_changed": len(changed), "failed": sum(o.error is not None for o in out),
                "changed_undetected": [c.questions[i] for i in changed if out[i].request_id not in named],
                "changed": [{"question": c.questions[i], "clean": c.clean[i], "served": texts[i]} for i in changed],
                "failed_questions": [c.questions[i] for i, o in enumerate(out) if o.error is not None],
            }
    finally:
        kv.setLevel(level)
    log, rep = runs["log"], runs["repair"]
    same = log["injected_at"] == rep["injected_at"] and log["detail"] == rep["detail"]
    ok = (log["injected_at"] is not None and log["detected"] and rep["answers_changed"] == 0
          and log["internal_errors"] == rep["internal_errors"] == 0 and not log["changed_undetected"])
    return {**row, "applicable": True, "injector": injector, "injected_same": same, "ok": ok,
            "log": log, "repair": rep}
