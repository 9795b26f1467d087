"""vLLM's GPU backends' cache layouts under the Triton kernels: parity with the torch reference, then
verify and stamp timings, on torch tensors laid out as vLLM 0.32 allocates them (no vLLM needed).

Per backend and layout (:mod:`kvcanary.geometry.vllm_gpu`; FlashAttention, FlashInfer NHD and HND,
Triton attention, FlexAttention, and a cross-layer ``BL..`` layout), one JSON line each:

- ``parity``: a prefill stamped by the Triton kernels and by the torch reference on the same cache
  (stamps equal bit for bit), the next step verified clean, one flipped byte found at its slot;
- ``timing``: decode verify (every read slot's content, no budget) and prefill stamping of every
  layer-half, microseconds per call and the achieved GB/s of the KV bytes read.

    python bench/vllm_gpu_layouts.py                      # a CUDA GPU: Llama-8B-shaped layers
    python bench/vllm_gpu_layouts.py --device cpu         # tiny cases under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CASES = [("FLASH_ATTN", "LBNHC"), ("FLASHINFER", "LBNHC"), ("FLASHINFER", "LBHNC"), ("TRITON_ATTN", "BLNHC"),
         ("FLEX_ATTENTION", "LBNHC")]
# layers, blocks, heads, block size, head dim, (decode rows, context), prefill tokens, timed calls
SIZES = {"cuda": (32, 4200, 8, 16, 128, (64, 1024), 8192, 20), "cpu": (2, 12, 2, 16, 8, (3, 40), 48, 1)}


def us_per_call(fn, iters: int, dev: torch.device) -> float:  # type: ignore[no-untyped-def]
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / iters


def cache(backend: str, layout: str, size: tuple, dev: torch.device):  # type: ignore[no-untyped-def]
    """The layers' views in vLLM's allocation of ``layout``, random K/V written through the backends'
    split, and the layout of their byte sources."""
    from kvcanary.geometry.vllm_gpu import vllm_gpu
    from kvcanary.layout import KvLayout
    from vllm_layouts import allocate, write_kv

    layers, nb, h, bs, d = size[:5]
    views, strides = allocate(layout, layers, nb, h, bs, d, torch.bfloat16, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    for t in views:
        write_kv(t, *(torch.randn(nb * bs, h, d, generator=g, device=dev).to(torch.bfloat16) for _ in range(2)))
    geoms = [vllm_gpu(t, backend, layout, bs, h, d, layer=i) for i, t in enumerate(views)]
    return views, strides, KvLayout(tuple(s for i, x in enumerate(geoms) for s in x.sources(f"layer{i}")))


def steps(rows: int, ctx: int, bs: int, nb: int, dev: torch.device):  # type: ignore[no-untyped-def]
    """A prefill of ``rows`` requests of ``ctx`` tokens in random distinct blocks, and the decode step after it."""
    from kvcanary.step import Step

    per = -(-(ctx + 1) // bs)
    g = torch.Generator().manual_seed(1)
    table = (torch.randperm(nb - 1, generator=g)[: rows * per] + 1).view(rows, per).to(dev)
    toks = torch.randint(0, 128000, (rows, ctx + 1), generator=g).to(dev)

    def step(start: int, n: int) -> Step:
        pos = torch.arange(start, start + n, device=dev).repeat(rows)
        row = torch.arange(rows, device=dev).repeat_interleave(n)
        return Step(cached_lens=torch.full((rows,), start, dtype=torch.int64, device=dev),
                    new_offsets=torch.arange(rows + 1, device=dev) * n, new_tokens=toks[:, start:start + n].reshape(-1),
                    new_positions=pos, new_slots=table[row, pos // bs] * bs + pos % bs, block_table=table,
                    block_size=bs, expected_tokens=toks)

    return step(0, ctx), step(ctx, 1)


def canary(layout, num_slots: int, backend: str, dev: torch.device):  # type: ignore[no-untyped-def]
    from kvcanary import Canary, CanaryConfig

    cfg = CanaryConfig(mode="log", backend=backend, content_budget_bytes=None, patrol_budget_bytes=0, validate=False)
    return Canary(num_slots, layout, cfg, device=dev)


def parity(backend: str, layout: str, size: tuple, dev: torch.device) -> dict:
    views, strides, lay = cache(backend, layout, size, dev)
    layers, nb, h, bs, d, (rows, ctx) = size[:6]
    rows, ctx = min(rows, 4), min(ctx, 64)
    pre, dec = steps(rows, ctx, bs, nb, dev)
    tri, ref = canary(lay, nb * bs, "triton", dev), canary(lay, nb * bs, "torch", dev)
    tri.after_forward(pre)
    ref.after_forward(pre)
    equal = bool(torch.equal(tri.stamps, ref.stamps))
    tri.before_forward(dec)
    clean = tri.poll() == []
    from vllm_layouts import element

    slot = int(pre.new_slots[ctx // 2])
    at = element(strides, bs, d, layers - 1, "v", slot, h - 1, d - 1)
    flat = views[0].view(torch.int16).as_strided((views[0].untyped_storage().nbytes() // 2,), (1,), 0)
    flat[at] ^= 0x100
    tri.before_forward(dec)
    found = [(v.slot, v.position) for v in tri.poll()]
    return dict(stage="parity", backend=backend, layout=layout, stamps_equal_torch=equal, clean=clean,
                flip_found=found == [(slot, ctx // 2)], violations=0 if clean else 1)


def timing(backend: str, layout: str, size: tuple, dev: torch.device) -> dict:
    views, _, lay = cache(backend, layout, size, dev)
    layers, nb, h, bs, d, (rows, ctx), pre_n, iters = size
    pre, dec = steps(rows, ctx, bs, nb, dev)
    c = canary(lay, nb * bs, "triton", dev)
    c.after_forward(pre)
    row_bytes = 2 * layers * h * d * 2  # K and V of every layer, bf16
    verify = us_per_call(lambda: c.before_forward(dec), iters, dev)
    stamp_pre, _ = steps(1, min(pre_n, (nb - 1) * bs - 1), bs, nb, dev)
    stamp = us_per_call(lambda: c.after_forward(stamp_pre), max(1, iters // 4), dev)
    c.forget_all()
    n_pre = int(stamp_pre.new_slots.numel())
    return dict(stage="timing", backend=backend, layout=layout, layers=layers, kv_token_bytes=row_bytes,
                decode_rows=rows, context=ctx, verify_us=round(verify, 1),
                verify_GBps=round(rows * ctx * row_bytes / verify / 1e3, 1), prefill_tokens=n_pre,
                stamp_us=round(stamp, 1), stamp_GBps=round(n_pre * row_bytes / stamp / 1e3, 1),
                device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu-interpreter",
                violations=len(c.poll()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    size = SIZES[dev.type]
    failed = []
    for backend, layout in CASES:
        rec = parity(backend, layout, size, dev)
        print(json.dumps(rec), flush=True)
        if not (rec["stamps_equal_torch"] and rec["clean"] and rec["flip_found"]):
            failed.append(f"{backend} {layout}")
    for backend, layout in CASES:
        print(json.dumps(timing(backend, layout, size, dev)), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if failed:
        sys.exit(f"parity failed on {', '.join(failed)}")


if __name__ == "__main__":
    main()
