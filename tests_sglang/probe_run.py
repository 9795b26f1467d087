"""Drive SGLang's CPU engine with the research probe (tests_sglang/probe/) loaded as an SGLang
plugin, and print where its records went. Usage, in .venv-sglang:

    python tests_sglang/probe_run.py LOG.jsonl [--small-pool] [--chunked] [--n2] [--abort] [--arch gemma2]
        [--sglang-canary log|raise [--sglang-canary-real-data none|partial|all]]

Each option adds a scenario: a pool small enough to retract decodes, chunked prefill, parallel
sampling (n=2), an aborted request; --sglang-canary turns on SGLang's own kv-canary."""

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--small-pool", action="store_true")
    ap.add_argument("--chunked", action="store_true")
    ap.add_argument("--n2", action="store_true")
    ap.add_argument("--abort", action="store_true")
    ap.add_argument("--limit", default="6")
    ap.add_argument("--arch", default="llama", help="llama, or gemma2 (a sliding window on its even layers)")
    ap.add_argument("--sglang-canary", metavar="MODE", help="SGLang's own kv-canary: log or raise")
    ap.add_argument("--torch-shims", action="store_true",
                    help="let torch's CPU stream take a device and ignore pin_memory (see how far SGLang's canary gets)")
    ap.add_argument("--sglang-canary-real-data", metavar="WHICH", default="none", help="none, partial or all")
    args = ap.parse_args()
    probe = os.path.join(HERE, "probe")
    os.environ["PYTHONPATH"] = probe + os.pathsep + os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, probe)
    sys.path.insert(0, HERE)
    os.environ["KVCSG_PROBE_LOG"] = os.path.abspath(args.log)
    os.environ["KVCSG_PROBE_LIMIT"] = args.limit
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if os.path.exists(args.log):
        os.remove(args.log)
    import sglang as sgl
    from tiny_model import make_tiny_model

    model = make_tiny_model(tempfile.mkdtemp(prefix="kvcanary-sglang-probe-"), args.arch)
    kw = dict(model_path=model, device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
              disable_overlap_schedule=True, log_level="warning", random_seed=0)
    if args.small_pool:
        # admit requests as if they would stop at once, so that decode runs out of slots and retracts
        os.environ["SGLANG_INIT_NEW_TOKEN_RATIO"] = "0.01"
        kw.update(max_total_tokens=160, max_running_requests=8)
    else:
        kw.update(max_total_tokens=4096)
    if args.torch_shims:
        os.environ["KVCSG_PROBE_TORCH_SHIMS"] = "1"
    if args.sglang_canary:
        kw.update(kv_canary=args.sglang_canary, kv_canary_real_data=args.sglang_canary_real_data, log_level="info")
    if args.chunked:
        kw.update(chunked_prefill_size=16)
    t = time.time()
    eng = sgl.Engine(**kw)
    print(f"engine started in {time.time() - t:.1f} s", flush=True)
    prefix = list(range(100, 120))
    prompts = [prefix + [300 + i, 301 + i, 302 + i] for i in range(3)]
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    try:
        for rnd in range(2):
            outs = eng.generate(input_ids=prompts, sampling_params=sp)
            print(rnd, [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs], flush=True)
        if args.n2:
            outs = eng.generate(input_ids=[prefix + [7, 8]], sampling_params={**sp, "n": 2, "temperature": 0.8})
            print("n=2", [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs], flush=True)
        if args.small_pool:
            many = [[400 + j] + list(range(500 + 7 * j, 520 + 7 * j)) for j in range(8)]
            # without ignore_eos: with it the scheduler reserves every request's max_new_tokens in full
            outs = eng.generate(input_ids=many, sampling_params={"temperature": 0, "max_new_tokens": 40})
            print("small pool: retractions", [o["meta_info"].get("num_retractions") for o in outs],
                  "tokens", [len(o["output_ids"]) for o in outs], flush=True)
        if args.abort:
            import asyncio

            async def go():
                gen = await eng.async_generate(input_ids=prefix + [9], sampling_params={**sp, "max_new_tokens": 200},
                                               stream=True)
                n = 0
                async for chunk in gen:
                    n += 1
                    if n == 3:
                        eng.tokenizer_manager.abort_request(rid=chunk["meta_info"]["id"])
                return n
            print("abort after chunks:", asyncio.get_event_loop().run_until_complete(go()), flush=True)
    finally:
        eng.shutdown()
    print("log:", args.log)


if __name__ == "__main__":
    main()
