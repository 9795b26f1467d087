"""Every op of :data:`kvcanary.ops.OPS` timed on each backend this machine runs, in one run.

One JSON line per (case, backend) with the median time, per-slot cost and bytes; then one line per
case with the ratios to the torch reference. The content case also prints this core's memory-read
bandwidth (torch int64 sum over the same bytes) and xxh3-64 over the same bytes (``xxhash``), so
the fingerprint's speed reads as a share of the hardware's.

    python bench/ops.py [--threads 1] [--repeats 9] [--quick]

Intra-op threads are pinned (``--threads``, also ``OMP_NUM_THREADS``): the fused loops run on the
calling thread, the torch ops on torch's pool of that size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--repeats", type=int, default=9)
ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
ap.add_argument("--memory", action="store_true",
                help="only the allocations of verify per read slot (torch profiler's memory view, tracemalloc)")
ap.add_argument("--backends", default=None, help="comma-separated (default: every backend this machine runs)")
ARGS = ap.parse_args() if __name__ == "__main__" else ap.parse_args([])
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))

import torch  # noqa: E402

from kvcanary import ByteSource, KvLayout, Step, checks, ops  # noqa: E402
from kvcanary.violations import NUM_COUNTERS, NUM_FIELDS, Site  # noqa: E402

ROW = 512  # bytes per layer-half per token: the demo model's (4 layers x K, V of 2 heads x 64 x fp16)
HALVES = 8


def _pool(num_blocks: int, block: int = 16, seed: int = 0) -> tuple[KvLayout, int]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-(1 << 62), 1 << 62, (num_blocks, HALVES, block, ROW // 8), generator=g)
    return KvLayout(tuple(ByteSource.from_tensor(f"h{i}", t[:, i], page_size=block) for i in range(HALVES))), \
        num_blocks * block


def _decode(rows: int, ctx: int, num_slots: int, block: int = 16, seed: int = 0) -> tuple[Step, Step]:
    """A prefill of ``rows`` x ``ctx`` tokens over random blocks, and the decode step that reads them all."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-(ctx + 1) // block)
    table = torch.randperm(num_slots // block, generator=g)[: rows * nb].view(rows, nb)
    toks = torch.randint(0, 128000, (rows, ctx + 1), generator=g)
    pos = torch.arange(ctx).repeat(rows)
    row = torch.arange(rows).repeat_interleave(ctx)
    pre = Step(cached_lens=torch.zeros(rows, dtype=torch.int64), new_offsets=torch.arange(rows + 1) * ctx,
               new_tokens=toks[:, :ctx].reshape(-1), new_positions=pos,
               new_slots=table[row, pos // block] * block + pos % block, block_table=table, block_size=block)
    r = torch.arange(rows)
    dec = Step(cached_lens=torch.full((rows,), ctx), new_offsets=torch.arange(rows + 1),
               new_tokens=toks[:, ctx].contiguous(), new_positions=torch.full((rows,), ctx),
               new_slots=table[r, ctx // block] * block + ctx % block, block_table=table, block_size=block,
               expected_tokens=toks)
    return pre, dec


class Env:
    """One backend's ops over one pool."""

    def __init__(self, backend: str, layout: KvLayout, num_slots: int) -> None:
        self.ops, self.table = ops.load(backend), ops.prepare(backend, layout, torch.device("cpu"))
        self.stamps = checks.new_stamps(num_slots)
        self.counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64)
        self.ring = torch.zeros(4096, NUM_FIELDS, dtype=torch.int64)
        self.cursor = torch.zeros(1, dtype=torch.int64)


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def case_verify(backend: str, quick: bool) -> dict:
    """16 x 4K decode: metadata only, then within the default 256 KiB content budget."""
    rows, ctx = (4, 256) if quick else (16, 4096)
    layout, n = _pool(rows * (ctx // 16 + 2) + 8)
    env = Env(backend, layout, n)
    pre, dec = _decode(rows, ctx, n)
    env.ops["stamp"](env.stamps, env.table, pre, env.counters, env.ring)
    meta = _time(lambda: env.ops["verify"](env.stamps, env.table, dec, env.counters, env.cursor, 0, env.ring, 0),
                 ARGS.repeats)
    budget = (256 << 10) // layout.content_bytes_per_slot
    full = _time(lambda: env.ops["verify"](env.stamps, env.table, dec, env.counters, env.cursor, budget, env.ring,
                                           0), ARGS.repeats)
    slots = rows * ctx
    return dict(read_slots=slots, meta_us=meta * 1e6, ns_per_slot_meta=meta * 1e9 / slots,
                budget_us=full * 1e6, content_bytes=budget * layout.content_bytes_per_slot,
                violations=int(env.counters[11]))


def case_stamp(backend: str, quick: bool) -> dict:
    """A 16-row decode step's writes (16 tokens, 4 KiB of KV each), and a 4K-token prefill's."""
    layout, n = _pool(600)
    env = Env(backend, layout, n)
    pre, dec = _decode(16, 255 if quick else 511, n)
    dec_t = _time(lambda: env.ops["stamp"](env.stamps, env.table, dec, env.counters, env.ring), ARGS.repeats)
    big, _ = _decode(1, 512 if quick else 4096, n, seed=1)
    pre_t = _time(lambda: env.ops["stamp"](env.stamps, env.table, big, env.counters, env.ring), ARGS.repeats)
    return dict(decode_us=dec_t * 1e6, prefill_tokens=big.num_new, prefill_us=pre_t * 1e6,
                prefill_ns_per_token=pre_t * 1e9 / big.num_new, violations=int(env.counters[11]))


def case_content(backend: str, quick: bool) -> dict:
    """The fingerprint of every slot of a 256 MiB pool, in pool order and in a random block order."""
    blocks = 256 if quick else 4096  # x 16 slots x 4 KiB
    layout, n = _pool(blocks)
    table = ops.prepare(backend, layout, torch.device("cpu"))
    fn = ops.load(backend)["content"]
    out = torch.empty(n, dtype=torch.int64)
    order = torch.arange(n)
    perm = (torch.randperm(blocks)[:, None] * 16 + torch.arange(16)).reshape(-1)
    nbytes = n * layout.content_bytes_per_slot
    seq = _time(lambda: fn(order, table, n, out), max(3, ARGS.repeats // 3))
    rnd = _time(lambda: fn(perm, table, n, out), max(3, ARGS.repeats // 3))
    return dict(bytes=nbytes, GBps_pool_order=nbytes / seq / 1e9, GBps_block_order=nbytes / rnd / 1e9)


def case_scrub(backend: str, quick: bool) -> dict:
    """A patrol pass of 4096 stamped slots."""
    layout, n = _pool(600)
    env = Env(backend, layout, n)
    pre, _ = _decode(8, 1000, n)
    env.ops["stamp"](env.stamps, env.table, pre, env.counters, env.ring)
    slots = torch.arange(1024 if quick else 4096)
    t = _time(lambda: env.ops["scrub"](env.stamps, env.table, slots, env.counters, env.ring, Site.SCRUB),
              ARGS.repeats)
    return dict(slots=slots.shape[0], us=t * 1e6, GBps=slots.shape[0] * layout.content_bytes_per_slot / t / 1e9,
                violations=int(env.counters[11]))


CASES = {"verify": case_verify, "stamp": case_stamp, "content": case_content, "scrub": case_scrub}
RATIO_KEYS = {"verify": ["meta_us", "budget_us"], "stamp": ["decode_us", "prefill_us"],
              "content": ["GBps_pool_order", "GBps_block_order"], "scrub": ["us"]}


def hardware(quick: bool) -> dict:
    """This core's memory-read bandwidth and xxh3-64 over a buffer the size of the content case's pool."""
    nbytes = (256 if quick else 4096) * 16 * HALVES * ROW
    buf = torch.randint(0, 1 << 62, (nbytes // 8,))
    bw = nbytes / _time(lambda: buf.sum(), 5) / 1e9
    out = dict(case="hardware", read_GBps_torch_sum=round(bw, 2), bytes=nbytes, threads=torch.get_num_threads())
    try:
        import xxhash

        mv = memoryview(buf.numpy()).cast("B")
        out["xxh3_64_GBps"] = round(nbytes / _time(lambda: xxhash.xxh3_64(mv), 5) / 1e9, 2)
    except ImportError:
        out["xxh3_64_GBps"] = "xxhash not installed (pip install xxhash)"
    return out


def verify_allocations(backend: str) -> dict:
    """Bytes verify allocates per call at two read-set sizes (16 x 256 and 16 x 4K decode, 256 KiB
    budget): torch tensors from the profiler's memory view, host arrays (numpy) from tracemalloc.
    The growth per added read slot is what scales with the read set."""
    import tracemalloc

    from torch.profiler import ProfilerActivity, profile

    out = {}
    for ctx in (256, 4096):
        layout, n = _pool(16 * (ctx // 16 + 2) + 8)
        env = Env(backend, layout, n)
        pre, dec = _decode(16, ctx, n)
        env.ops["stamp"](env.stamps, env.table, pre, env.counters, env.ring)
        budget = (256 << 10) // layout.content_bytes_per_slot

        def call() -> None:
            env.ops["verify"](env.stamps, env.table, dec, env.counters, env.cursor, budget, env.ring, 0)

        call()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            call()
        torch_bytes = sum(max(0, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0
                          and not e.cpu_children)  # leaf events: each allocation counted once
        tracemalloc.start()
        call()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[ctx] = (16 * ctx, torch_bytes, peak)
    (s0, t0, h0), (s1, t1, h1) = out[256], out[4096]
    return dict(case="verify_allocations", backend=backend, read_slots=[s0, s1], torch_alloc_bytes=[t0, t1],
                host_peak_bytes=[h0, h1], torch_bytes_per_added_read_slot=round((t1 - t0) / (s1 - s0), 2),
                host_bytes_per_added_read_slot=round((h1 - h0) / (s1 - s0), 2))


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    if ARGS.memory:
        for b in ARGS.backends.split(",") if ARGS.backends else ["torch", "fused"]:
            print(json.dumps(verify_allocations(b)), flush=True)
        return
    backends = ARGS.backends.split(",") if ARGS.backends else ["torch", "fused"]
    hw = hardware(ARGS.quick)
    print(json.dumps(hw), flush=True)
    for name, case in CASES.items():
        res = {}
        for b in backends:
            r = case(b, ARGS.quick)
            res[b] = r
            print(json.dumps({"case": name, "backend": b, **{k: (round(v, 3) if isinstance(v, float) else v)
                                                           for k, v in r.items()}, "threads": ARGS.threads}),
                  flush=True)
        if "torch" in res:
            ratio = {}
            for b in res:
                for k in RATIO_KEYS[name]:
                    x, ref = res[b][k], res["torch"][k]
                    ratio[f"{b}_{k}"] = round(x / ref if "GBps" in k else ref / x, 2)  # > 1: faster than torch
            if name == "content":
                for b in res:
                    ratio[f"{b}_share_of_read_bw"] = round(res[b]["GBps_pool_order"] / hw["read_GBps_torch_sum"], 3)
            print(json.dumps({"case": name, "speedup_vs_torch": ratio}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
