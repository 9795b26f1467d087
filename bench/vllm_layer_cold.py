"""What one layer's canary call costs when the caches are cold, part by part: the attention patch's
plain path (the write check and fold of a decode layer, :mod:`kvcanary.engines.vllm.patch`) and what
it is made of, timed after reading other memory, as the engine's matrix products between two layers
leave the core's caches.

    OMP_NUM_THREADS=1 taskset -c 1 .venv-vllm/bin/python bench/vllm_layer_cold.py [--dtype bfloat16|float32]
        [--thrash-mb 0,6,96] [--iters 200]

An in-process engine (eager) runs the trained model (SmolLM2-135M-Instruct, 16 chat requests, the read
audit at its least: ``KVCANARY_AUDIT_BUDGET=0.001``) until a decode forward of 16 tokens; the
arguments of one of its layers' attention (layer 5) and that forward's plan
(:class:`kvcanary.engines.vllm.wide.WideForward`) are kept. Then, for each ``--thrash-mb`` (0: the
caches hot, the call made once before; else a read of that many MiB of other memory before each
call: 6 MiB leaves the L2 cold, 96 MiB the L3 and the address translations too), the median of
``--iters`` calls of:

- ``plain path``: the patched attention forward as the engine calls it, the engine's attention
  replaced by a no-op (what the canary adds to a layer);
- ``empty patch``: a patched forward that reads the plan and calls the no-op (the floor of a patch);
- ``compiled, write checked`` / ``compiled, fold only``: the layer's compiled call
  (:func:`kvcanary.fused.keep.keep_layer_at` through its compiled entry) with and without the write
  check (a layer the budget leaves unchecked folds its new tokens from the rows it computed);
- ``compiled, empty``: a compiled function of five integers doing nothing, through the same entry;
- ``key and value strides``, ``key and value addresses``: the tensor calls the plain path makes.

The computed K and V are held from the captured forward (eager: their memory is not reused), so the
write check compares them with the cache as the layer wrote it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--thrash-mb", default="0,6,96", help="comma-separated MiB read before each call (0: hot)")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    try:
        sizes = [float(x) for x in args.thrash_mb.split(",")]
    except ValueError:
        ap.error(f"--thrash-mb: expected comma-separated numbers of MiB, got {args.thrash_mb!r}")
    if any(s < 0 for s in sizes):
        ap.error(f"--thrash-mb: expected sizes >= 0, got {args.thrash_mb!r}")
    for k in [k for k in os.environ if k.startswith("KVCANARY_")]:
        del os.environ[k]
    os.environ["KVCANARY_AUDIT_BUDGET"] = "0.001"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, HERE)
    import numpy as np
    from vllm_cpu import real_workload

    from kvcanary.faults import vllm_runner

    for k, v in vllm_runner.ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from kvcanary.engines.vllm import patch, wide

    layer_no, tokens = 5, 16
    plans: list[Any] = []
    calls: list[tuple[Any, ...]] = []
    keep_written = wide.WideForward.keep_written

    def noting(self: Any, li: int, key: Any, value: Any) -> None:  # the first decode plan of 16 tokens
        if not plans and len(self.toks) == tokens:
            plans.append(self)
        keep_written(self, li, key, value)

    path, extra, name = real_workload(argparse.Namespace(requests=tokens, dtype=args.dtype))
    print(f"[vllm_layer_cold] {name}, eager engine start ...", file=sys.stderr, flush=True)
    llm = vllm_runner._engine({"model": path, "max_seqs": 16, "num_blocks": 256, "eager": True, **extra},
                              {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both"})
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ps = [TokensPrompt(prompt_token_ids=p) for p in extra["prompt_ids"]]
    llm.generate(ps[:4], sp, use_tqdm=False)  # warm-up: every layer seen, plans made from here on
    engine_attention = patch.ORIGINAL["forward"]

    def recording(impl: Any, layer: Any, *a: Any, **kw: Any) -> Any:
        if plans and not calls and layer.layer_name.startswith(f"model.layers.{layer_no}."):
            calls.append((impl, layer, *a))
        return engine_attention(impl, layer, *a, **kw)

    wide.WideForward.keep_written = noting  # type: ignore[method-assign]
    patch.ORIGINAL["forward"] = recording
    try:
        llm.generate(ps, sp, use_tqdm=False)
    finally:
        wide.WideForward.keep_written = keep_written  # type: ignore[method-assign]
        patch.ORIGINAL["forward"] = engine_attention
    if not plans or not calls:
        raise SystemExit("vllm_layer_cold.py: no decode forward of 16 tokens with a plan was seen")
    plan = plans[0]
    impl, layer, q, k, v, kv, md, out = calls[0][:8]
    li = plan.plain_by_layer[layer]
    noop = lambda *a, **kw: None  # noqa: E731 - the engine's attention, left out of the timing

    def plain() -> Any:  # the patched forward as vLLM calls it, the plan reset to the layer unseen
        plan.open[li], plan.live, plan.md_plain, plan.original = 1, True, md, noop
        patch.ACTIVE[0] = plan
        return CPUAttentionBackendImpl.forward(impl, layer, q, k, v, kv, md, output=out)

    def empty_patch(impl: Any, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any,
                    output: Any = None) -> Any:
        t0 = time.perf_counter()
        got = patch.ACTIVE[0]
        got.clock[0] += time.perf_counter() - t0
        return noop(impl, layer, query, key, value, kv_cache, attn_metadata, output)

    from numba import njit, types  # (numba loaded only once the engine runs: vLLM's start scans loaded modules)

    from kvcanary.fused.keep import direct

    @njit(nogil=True)
    def nothing(a, b, c, d, e):  # type: ignore[no-untyped-def]
        return a

    empty = direct(nothing, (types.int64,) * 5)
    call = plan.keep_layer
    ka, va = k.data_ptr(), v.data_ptr()
    parts: list[tuple[str, Callable[[], Any]]] = [
        ("plain path", plain),
        ("empty patch", lambda: empty_patch(impl, layer, q, k, v, kv, md, output=out)),
        ("compiled, write checked", lambda: call(plan.at_address, li, ka, va, 1)),
        ("compiled, fold only", lambda: call(plan.at_address, li, ka, va, 0)),
        ("compiled, empty", lambda: empty(1, 2, 3, 4, 5)),
        ("key and value strides", lambda: (k.stride(), v.stride())),
        ("key and value addresses", lambda: (k.data_ptr(), v.data_ptr())),
    ]
    checked = bool(plan.write and plan.checks[li])
    print(f"vLLM CPU, {name}, eager, layer {layer_no} of a decode forward of {tokens} tokens "
          f"(its write {'checked' if checked else 'not checked'} in that forward's plan) "
          f"(K strides {tuple(k.stride())}), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')}; "
          f"medians of {args.iters} calls, microseconds")
    for mb in sizes:
        junk = np.ones(max(1, int(mb * 2**20) // 8))
        row: dict[str, Any] = {"thrash_MiB": mb}
        for label, fn in parts:
            ts = []
            for _ in range(args.iters):
                if mb:
                    junk.sum()
                else:
                    fn()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            row[label] = round(statistics.median(ts) * 1e6, 2)
        print(json.dumps(row), flush=True)
    patch.ACTIVE[0] = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
