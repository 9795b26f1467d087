"""The per-layer keep's speed on vLLM's CPU cache layouts: one layer's write check and fold of a decode batch.

Inside each layer of a vLLM CPU forward, right after the layer's cache write, the connector calls
:func:`kvcanary.fused.keep.keep_layer_at` once (through its compiled entry): it compares every new
token's computed K and V rows with the cache's bytes at its slot, bit for bit (the write check), and
folds the token's part of its content fingerprint from those rows (from the cache where the check
is off or found a difference). This times that call on one layer of the trained model's geometry
(SmolLM2-135M: 3 KV heads of 64, block size 32, bf16) in vLLM's ``vec`` and ``amx`` layouts, for a
decode batch of ``--tokens`` new tokens (default 16), each in a block of its own, as the connector
calls it: the write check and the fold from the rows, the write check alone, the fold alone
(from the cache), and the fold from the rows without the write check (a layer the time budget
leaves unchecked in a forward), with the layer's lines in the caches (``hot``) and after writing 64 MB of other
memory (``cold``). In an ``amx`` pool a token's K row lies in 32 cache lines, one per pair of
dimensions, each shared by 16 tokens. Each line: the median and the least time of ``--repeats``
calls, and the bytes of cache lines the write check reads in the pool.

    python bench/write_check.py [--tokens 16] [--repeats 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace
from typing import Any

ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
ap.add_argument("--tokens", type=int, default=16)
ap.add_argument("--repeats", type=int, default=200)
ap.add_argument("--threads", type=int, default=1)
args = ap.parse_args()
os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvcanary.audit.reference import DTYPES  # noqa: E402
from kvcanary.audit.tables import layer_row, strides  # noqa: E402
from kvcanary.engines.vllm.fold import Fold, fold_tables  # noqa: E402
from kvcanary.fused._step import describe  # noqa: E402
from kvcanary.fused.fold import SourceTable  # noqa: E402
from kvcanary.fused.keep import KEEP_LAYER_AT, direct, keep_layer_at, keep_tables  # noqa: E402
from kvcanary.geometry.vllm_cpu import vllm_cpu  # noqa: E402
from kvcanary.layout import KvLayout  # noqa: E402
from kvcanary.step import Step  # noqa: E402

torch.set_num_threads(args.threads)
HEADS, DIM, BLOCK, LINE = 3, 64, 32, 64
if args.tokens < 1 or args.repeats < 1:
    ap.error(f"--tokens and --repeats: expected at least 1, got {args.tokens} and {args.repeats}")
BLOCKS = args.tokens + 8


def lines_read(layout: str, tokens: int) -> int:
    """Bytes of the pool's cache lines the write check of ``tokens`` tokens (a block each) reads."""
    if layout == "amx":  # K: a line per dimension pair; V: a 64-byte strip of 16 dimensions per token pair
        return tokens * HEADS * (DIM // 2 + DIM // 16) * LINE
    return tokens * HEADS * (DIM * LINE + 2 * DIM)  # vec: K column-major (a line an element), V a row


def case(layout: str) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g).to(torch.bfloat16)
    geo = vllm_cpu(pool, layout, BLOCK, HEADS, DIM, 0)
    table = SourceTable(KvLayout(tuple(geo.sources("layer0"))))
    group = SimpleNamespace(name="g", canary=SimpleNamespace(table=table))
    ft = fold_tables([group], ["l0"], {"l0": group}, {"l0": (0, 2)}, {"l0": geo})
    n = args.tokens
    new_slots = torch.tensor([b * BLOCK + (5 + b) % BLOCK for b in range(4, 4 + n)])
    step = Step(cached_lens=torch.zeros(n, dtype=torch.int64), new_offsets=torch.arange(n + 1),
                new_tokens=torch.arange(n), new_positions=torch.zeros(n, dtype=torch.int64), new_slots=new_slots,
                block_table=(new_slots // BLOCK)[:, None], block_size=BLOCK)
    descs = geo.descriptors()
    assert descs is not None
    layers = np.array([layer_row(descs[0], descs[1], 0, DTYPES[geo.dtype], geo.element_size, HEADS, DIM,
                                 geo.num_slots - 1, DTYPES[geo.dtype])], dtype=np.int64)
    qkv = torch.zeros(n, 3 * HEADS * DIM, dtype=torch.bfloat16)  # the layer's computed rows, views of one buffer
    k = qkv[:, HEADS * DIM:2 * HEADS * DIM].view(n, HEADS, DIM)
    v = qkv[:, 2 * HEADS * DIM:].view(n, HEADS, DIM)
    k.copy_(geo.k_rows(new_slots))
    v.copy_(geo.v_rows(new_slots))
    st = np.array(strides(k, 0, 1, 2) + strides(v, 0, 1, 2) + strides(k, 0, 1, 2) + strides(k, 0, 1, 2),
                  dtype=np.int64)
    # the step's descriptor holds its tensors' addresses: the step goes back with it, to outlive the calls
    return pool, qkv, k, v, layers, st, (step, describe(step)[None]), np.arange(n), ft


def main() -> None:
    entry = direct(keep_layer_at, KEEP_LAYER_AT)
    junk = np.zeros(64 << 20, dtype=np.uint8)
    n = args.tokens
    for layout in ("vec", "amx"):
        pool, qkv, k, v, layers, st, (step, steps), toks, ft = case(layout)
        for what in ("write check and fold", "write check", "fold", "fold from the rows, unchecked"):
            fold = Fold(ft, ["g"], n)
            if what == "write check":
                fold.void()  # no fold columns: the call checks the writes only
            half, head = np.zeros((1, n), dtype=np.int64), np.zeros((1, n), dtype=np.int64)
            at = keep_tables(layers, st, steps, toks, half, head, *fold.args)
            address = at.__array_interface__["data"][0]
            ka, va = (0, 0) if what == "fold" else (k.data_ptr(), v.data_ptr())
            check = 0 if what.endswith("unchecked") else 1
            for caches in ("hot", "cold"):
                times = []
                for _ in range(args.repeats):
                    if caches == "cold":
                        junk += 1
                    fold.acc[:] = 0
                    if fold.cnt.shape[1]:
                        fold.cnt[:] = 0
                    t0 = time.perf_counter()
                    entry(address, 0, ka, va, check)
                    times.append(time.perf_counter() - t0)
                if ka and check and half.any():
                    raise SystemExit(f"{layout}: the write check found a difference in a clean cache: {half}")
                print(json.dumps({"layout": layout, "call": what, "caches": caches, "tokens": n,
                                  "us": round(statistics.median(times) * 1e6, 2), "least_us": round(min(times) * 1e6, 2),
                                  "pool_lines_KiB": round(lines_read(layout, n) / 1024, 1) if ka and check else 0,
                                  "threads": args.threads}), flush=True)


if __name__ == "__main__":
    main()
