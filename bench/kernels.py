"""GPU cost of kvcanary's Triton kernels on the cases of design.md §5, beside SGLang's anchor.

Prints one JSON line per case with the fields of ``shared/bench/sglang_anchor.py`` (case, bs,
prefix, extend, real_kv, sources, kv_row_bytes, verify_entries, write_entries, plan_us, verify_us,
write_us, violations_on_clean_run, device) plus bytes moved, achieved GB/s and the share of the
measured copy bandwidth. Clean chains, random slot placement, 2,048-byte rows per layer-half.

    python bench/kernels.py                       # every case (a CUDA GPU)
    CASES=decode_bs256_ctx4k python bench/kernels.py
    python bench/kernels.py --smoke               # tiny cases; on a CPU through TRITON_INTERPRET=1
    python bench/kernels.py --sweep               # decode verify's block and warps, metadata only

``real_kv``: none (metadata only), all with ``sources`` 1 or 4, and ``all64`` (every layer-half of a
Llama-3-8B-shaped cache: 32 layers x K and V). Verify checks content of every read slot (no budget).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

KV_ROW = 2048


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, iters: int, dev: torch.device) -> float:  # type: ignore[no-untyped-def]
    fn()
    _sync(dev)
    if dev.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        _sync(dev)
        return s.elapsed_time(e) * 1e3 / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e6 / iters


def graph_us(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    """Microseconds per replay of ``fn`` captured in a CUDA graph (launch cost gone, as in a
    graph-captured engine step)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return timeit(g.replay, iters, torch.device("cuda"))


def copy_roofline(dev: torch.device) -> float:
    """Measured device copy bandwidth in GB/s, read + write counted (as the SGLang anchor counts it)."""
    n = (2 << 30) if dev.type == "cuda" else (64 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    us = timeit(lambda: b.copy_(a), 10 if dev.type == "cuda" else 2, dev)
    gbps = 2 * n / us / 1e3
    print(json.dumps({"case": "copy_roofline", "bytes_moved": 2 * n, "us": round(us, 1), "GBps": round(gbps, 1)}),
          flush=True)
    del a, b
    return gbps


def run_case(name: str, bs: int, prefix: int, extend: int, mode: str, nsrc: int, iters: int, dev: torch.device,
             peak: float, meta: tuple[int, int] | None = None) -> None:
    from kvcanary import ByteSource, Canary, CanaryConfig, KvLayout, Step
    from kvcanary.kernels import verify as kverify

    if meta is not None:  # positions and warps per program of metadata-only verify
        kverify.META_BLOCK, kverify.META_WARPS = meta

    g = torch.Generator().manual_seed(0)
    total = prefix + extend
    num_slots = bs * total + 1
    # an int32 token-to-slot table, as SGLang's req_to_token (slot 0 reserved, as there)
    table = (torch.randperm(num_slots - 1, generator=g) + 1).view(bs, total).to(torch.int32).to(dev)
    tokens = torch.randint(0, 128000, (bs, total), generator=g).to(dev)
    srcs = ()
    if mode != "none":
        # one pool tensor per source; all64 shares one allocation as 64 evenly spaced layer-halves
        if nsrc > 4:
            pool = torch.empty(num_slots, nsrc, KV_ROW, dtype=torch.uint8, device=dev).random_(0, 255)
            srcs = tuple(ByteSource.from_tensor(f"h{i}", pool[:, i]) for i in range(nsrc))
        else:
            srcs = tuple(ByteSource.from_tensor(f"h{i}", torch.empty(num_slots, KV_ROW, dtype=torch.uint8,
                                                                     device=dev).random_(0, 255))
                         for i in range(nsrc))
    canary = Canary(num_slots, KvLayout(srcs), CanaryConfig(mode="log", content_budget_bytes=None, validate=False, backend="triton"),
                    device=dev)

    def step(start: int, n: int) -> Step:
        return Step(slot_table=table, cached_lens=torch.full((bs,), start, dtype=torch.int64, device=dev),
                    new_offsets=torch.arange(bs + 1, dtype=torch.int64, device=dev) * n,
                    new_tokens=tokens[:, start:start + n].reshape(-1).contiguous(),
                    new_positions=torch.arange(start, start + n, device=dev).repeat(bs),
                    new_slots=table[:, start:start + n].reshape(-1).long())

    if prefix:
        canary.after_forward(step(0, prefix))
    s = step(prefix, extend)
    graphed = dev.type == "cuda"
    start = canary.stats()
    verify_us = timeit(lambda: canary.before_forward(s), iters, dev) if prefix else 0.0
    write_us = timeit(lambda: canary.after_forward(s), iters, dev)
    verify_g = graph_us(lambda: canary.before_forward(s), iters) if graphed and prefix else None
    write_g = graph_us(lambda: canary.after_forward(s), iters) if graphed else None
    _sync(dev)
    violations = len(canary.poll())
    # a fast kernel only counts if it checked every entry: every eager call and graph replay is counted
    end = canary.stats()
    calls = (iters + 1) * (2 if graphed else 1)  # a warm-up and the timed calls, eager and replayed
    done = {k: (end[k] - start[k]) // calls for k in ("slots_verified", "content_bytes_verified", "slots_stamped",
                                                        "content_bytes_stamped")}
    exact = all((end[k] - start[k]) % calls == 0 for k in done) and end["internal_errors"] == 0
    ve, we = bs * prefix, bs * extend
    content_row = KV_ROW * len(srcs)
    te = table.element_size()
    v_bytes = ve * (32 + te + 8) + ve * content_row  # stamp, table entry, pred link; the KV rows read
    w_bytes = we * (32 + 8 + 8 + 8 + te) + we * content_row  # stamp; token, position, slot; table entry
    rec = dict(
        case=name, bs=bs, prefix=prefix, extend=extend, real_kv="all" if mode != "none" else "none",
        sources=len(srcs), kv_row_bytes=KV_ROW, verify_entries=ve, write_entries=we, plan_us=0.0,
        verify_us=round(verify_us, 2), write_us=round(write_us, 2), violations_on_clean_run=violations,
        checked_per_call=done,
        coverage_ok=exact and done == dict(slots_verified=bs * prefix, content_bytes_verified=bs * prefix * KV_ROW * len(srcs),
                                 slots_stamped=bs * extend, content_bytes_stamped=bs * extend * KV_ROW * len(srcs)),
        verify_graph_us=None if verify_g is None else round(verify_g, 2),
        write_graph_us=None if write_g is None else round(write_g, 2),
        meta_block=kverify.META_BLOCK, meta_warps=kverify.META_WARPS,
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu-interpreter",
        verify_bytes=v_bytes, write_bytes=w_bytes,
        verify_GBps=round(v_bytes / verify_us / 1e3, 1) if verify_us else None,
        write_GBps=round(w_bytes / write_us / 1e3, 1),
        verify_vs_read_time=round(verify_us / (ve * content_row / peak / 1e3), 2) if ve and content_row else None,
        write_vs_read_time=round(write_us / (we * content_row / peak / 1e3), 2) if content_row else None,
    )
    print(json.dumps(rec), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny cases (CPU: Triton interpreter)")
    ap.add_argument("--sweep", action="store_true",
                    help="metadata-only decode verify under each (positions, warps) per program")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not args.smoke:
            sys.exit("bench/kernels.py needs a CUDA GPU; use --smoke for a CPU interpreter check")
    peak = copy_roofline(dev)  # the read-time yardstick of design.md §5: bytes / measured copy bandwidth
    cases = [
        ("decode_bs256_ctx4k", 256, 4095, 1, 20),
        ("decode_bs32_ctx32k", 32, 32767, 1, 20),
        ("chunk_prefill_8k_after_24k", 1, 24576, 8192, 5),
        ("prefill_1x32k", 1, 0, 32768, 5),
        ("prefill_8x4k", 8, 0, 4096, 5),
    ]
    modes = [("none", 0), ("all", 1), ("all", 4), ("all64", 64)]
    if args.smoke:
        cases = [("smoke_decode", 4, 63, 1, 1), ("smoke_prefill", 1, 0, 300, 1)]
        modes = [("none", 0), ("all", 1)]
    if args.sweep:
        name, bs, p, e, it = cases[0]
        for meta in ((256, 4), (512, 4), (512, 8), (1024, 4), (1024, 8)):
            run_case(name, bs, p, e, "none", 0, it, dev, peak, meta)
        return
    only = os.environ.get("CASES")
    for name, bs, p, e, it in cases:
        if only and name not in only.split(","):
            continue
        for mode, ns in modes:
            if mode == "all64" and bs * (p + e) * 64 * KV_ROW > (100 << 30):
                continue  # does not fit one GPU's memory
            run_case(name, bs, p, e, mode, ns, it, dev, peak)
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
