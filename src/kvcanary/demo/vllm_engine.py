"""One vLLM engine for ``kvcanary demo --engine vllm``, in this process: the chat prompts generated
greedily, once per run, with or without the canary and with one fault of :mod:`kvcanary.faults.vllm`
injected per run. Started by :mod:`kvcanary.demo.vllm` in a fresh interpreter, one per engine (vLLM
keeps per-process globals that a second engine would inherit)::

    python -m kvcanary.demo.vllm_engine '{"model": DIR, "dtype": "bfloat16", "prompts": [[...], ...], ...}'

which prints one line, ``RESULT {json}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

from kvcanary.faults.vllm_runner import ENGINE_ENV, RESULT, process_canary


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Start one engine and generate ``cfg["prompts"]`` once per entry of ``cfg["runs"]``.

    ``cfg`` keys: ``model`` (a local checkpoint directory), ``dtype``, ``prompts`` (token id lists),
    ``max_tokens``, ``stop`` (token ids that end an answer), ``blocks`` (the KV pool's blocks of 32
    slots); ``canary``: ``None`` (no connector) or the ``kv_connector_extra_config`` mapping (its
    ``mode`` picks the ``kv_load_failure_policy`` a healing mode needs); ``runs``: a list of
    ``{"fault": name or None, "at": forward, "seed": seed}``. The prefix cache is emptied before each
    run, so every run starts from the same cache contents.

    Returns ``engine_s`` (start-up), ``threads`` (torch's intra-op threads), ``vllm`` (its version)
    and ``runs``: per run ``tokens`` and ``finish`` (per prompt, in order), ``cached_tokens`` (prompt
    tokens each request took from the prefix cache), ``generate_s``, and under the canary ``stats``
    (counts of this run), ``violations`` (the first 200, ``request`` as the prompt's index, with
    ``text``) and, with a fault, ``fault`` (where it landed; ``step``: the canary step, ``None`` when
    no target appeared).
    """
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcanary.engines.vllm.heal import POLICY

    kvc = None
    if cfg.get("canary") is not None:
        extra = dict(cfg["canary"])
        kvc = {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        if extra.get("mode") in POLICY:
            kvc["kv_load_failure_policy"] = POLICY[extra["mode"]]
    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=cfg["dtype"], block_size=32,
              enable_prefix_caching=True, num_gpu_blocks_override=cfg["blocks"], max_model_len=512, seed=0,
              kv_transfer_config=kvc)
    engine_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0.0, stop_token_ids=list(cfg["stop"]))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm the kernels
    canary = process_canary() if kvc is not None else None
    runs = []
    for spec in cfg["runs"]:
        llm.reset_prefix_cache()
        before = canary.stats() if canary is not None else {}
        seen = len(canary.violations) if canary is not None else 0
        with _fault(spec) as fault:
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t
        index = {_short(o.request_id): i for i, o in enumerate(outs)}
        out: dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                               "finish": [o.outputs[0].finish_reason for o in outs],
                               "cached_tokens": [int(o.num_cached_tokens or 0) for o in outs], "generate_s": wall}
        if canary is not None:
            st = canary.stats()
            out["stats"] = {k: v - before.get(k, 0) for k, v in st.items()}
            out["violations"] = [{**v.to_dict(), "request": index.get(_short(v.request)) if v.request else None,
                                  "text": v.describe()} for v in canary.violations[seen:seen + 200]]
        if fault is not None:
            d = dict(fault.detail)
            for key in ("request", "readers"):  # engine request ids -> the prompts' indices
                if isinstance(d.get(key), str):
                    d[key] = index.get(_short(d[key]))
                elif isinstance(d.get(key), list):
                    d[key] = sorted({index[_short(r)] for r in d[key] if _short(r) in index})
            out["fault"] = {"injected_at_forward": fault.injected_at, "step": d.pop("step", None), "detail": d}
        runs.append(out)
    return {"engine_s": engine_s, "threads": torch.get_num_threads(), "vllm": vllm.__version__, "runs": runs}


def _short(rid: str) -> str:
    return rid.split("-")[0]  # vLLM's offline requests are "<index>-<random suffix>" inside the engine


def _fault(spec: dict[str, Any]) -> Any:
    from kvcanary.faults import vllm as faults_vllm

    if not spec.get("fault"):
        return contextlib.nullcontext()
    return faults_vllm.injected(spec["fault"], int(spec.get("at", 3)), int(spec.get("seed", 0)))


def main(argv: list[str] | None = None) -> None:
    """``python -m kvcanary.demo.vllm_engine CFG_JSON``: :func:`run`, then one ``RESULT`` line."""
    args = sys.argv[1:] if argv is None else argv
    print(RESULT + json.dumps(run(json.loads(args[0]))), flush=True)


if __name__ == "__main__":  # vLLM starts its helper processes by spawn
    main()
