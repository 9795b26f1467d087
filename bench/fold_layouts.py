"""The content fingerprint's speed on vLLM's CPU cache layouts, against this core's memory bandwidth.

The verify's content window and the patrol fingerprint runs of neighbouring slots over every layer of
a pool (:func:`kvcanary.fused.fold.fold_slots`), the guard and the first-read checks one slot at a
time (:func:`~kvcanary.fused.fold.fold_slot`). This times both on the trained model's geometry
(SmolLM2-135M: 30 layers, 3 KV heads of 64, block size 32, bf16) in vLLM's ``vec`` and ``amx``
layouts, for a window-sized run of slots (``--slots``, default 11: the 256 KiB content window of
one forward of that model) and for single slots, with the pool's lines in the caches (``hot``) and
after reading 400 MB of other memory (``cold``: as after a forward, whose weights pass through the
caches). Each case is timed with the next source's lines hinted into the caches while one is folded
(``hints: true``, what the canary runs) and without (``false``), the two alternating call by call in
one process, so a busy machine slows both alike. Each line: the median time of ``--repeats`` calls,
the content bytes per second, and the bytes of cache lines the call touches (an ``amx`` K row of a
token lies in 32 lines, one per pair of dimensions, each shared by 16 tokens) per second. Then the
guard's comparison of the null block (block 0, zeroed, as vLLM allocates its pools: 32 slots of
every layer) with its snapshot (:func:`kvcanary.fused.snapshot.same`): against zero, as an all-zero
snapshot says it may, and against the snapshot's copy of the same bytes, alternating. The last line:
this core's read bandwidth (numpy sum over 400 MB).

    python bench/fold_layouts.py [--slots 22] [--repeats 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
ap.add_argument("--slots", type=int, default=11)
ap.add_argument("--repeats", type=int, default=15)
ap.add_argument("--threads", type=int, default=1)
args = ap.parse_args()
os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import njit  # noqa: E402

from kvcanary import layouts  # noqa: E402
from kvcanary.fused.fold import SourceTable, fold_slot, fold_slots  # noqa: E402
from kvcanary.fused.snapshot import HEADER, regions, same, taken  # noqa: E402

torch.set_num_threads(args.threads)
LAYERS, HEADS, DIM, BLOCK, BLOCKS = 30, 3, 64, 32, 256
LINE = 64


@njit
def _run(src, runs, keys, slots, hint):  # type: ignore[no-untyped-def]
    return fold_slots(src, runs, keys, slots, slots.shape[0], hint)


@njit
def _singles(src, runs, keys, slots, hint):  # type: ignore[no-untyped-def]
    out = np.zeros(slots.shape[0], dtype=np.int64)
    for j in range(slots.shape[0]):
        out[j] = fold_slot(src, runs, keys, slots[j], hint)
    return out


def touched(layout: str, slots: np.ndarray) -> int:
    """Bytes of the cache lines the fingerprints of ``slots`` read, over every layer (K and V)."""
    per_head = 0
    blocks = {int(s) // BLOCK for s in slots}
    if layout == "amx":  # K: 16-token tiles, 32 lines each per head; V: 2-token pairs, 4 lines each per head
        tiles = {int(s) // 16 for s in slots}
        pairs = {int(s) // 2 for s in slots}
        per_head = len(tiles) * 32 * LINE + len(pairs) * (DIM // 16) * LINE
    else:  # vec: K column-major in a block (a line holds 32 tokens' element), V row-major (2 lines a token)
        per_head = len(blocks) * DIM * LINE + len(slots) * 2 * DIM
    return per_head * HEADS * LAYERS


@njit
def _same(regions, snap):  # type: ignore[no-untyped-def]
    return same(regions.ctypes.data, regions.shape[0], snap.ctypes.data)


def guard(t: SourceTable, tensors: list[torch.Tensor], junk: np.ndarray, name: str) -> None:
    """The null block's comparison with its snapshot, against zero and against the copy."""
    block = np.arange(BLOCK, dtype=np.int64)
    for tensor in tensors:
        tensor.view(BLOCKS, -1)[0] = 0  # the null block, zeroed
    reg = regions(t, block, t.bytes_per_slot)
    zero = taken(reg)
    copy = zero.copy()
    copy[:HEADER].view(np.int64)[0] = 0  # the same bytes, compared as a copy
    assert zero[:HEADER].view(np.int64)[0] == 1 and _same(reg, zero) and _same(reg, copy)
    for temp in ("hot", "cold"):
        times: dict[str, list[float]] = {"zero": [], "copy": []}
        for _ in range(args.repeats):
            for kind, snap in (("zero", zero), ("copy", copy)):
                if temp == "cold":
                    junk.sum()
                else:
                    _same(reg, snap)
                t0 = time.perf_counter()
                _same(reg, snap)
                times[kind].append(time.perf_counter() - t0)
        for kind in ("zero", "copy"):
            sec = statistics.median(times[kind])
            size = int(reg[:, 1].sum())
            print(json.dumps({"layout": name, "case": "guard", "caches": temp, "against": kind, "KiB": size // 1024,
                              "us": round(sec * 1e6, 1), "GB_s": round(size / sec / 1e9, 2),
                              "threads": args.threads}), flush=True)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    junk = np.ones(400 * 2**20 // 8)
    content = LAYERS * 2 * HEADS * DIM * 2  # bytes of one slot's K and V over every layer
    rng = np.random.default_rng(1)
    for name in ("vec", "amx"):
        make = layouts.vllm_cpu_amx if name == "amx" else layouts.vllm_cpu_vec
        t = SourceTable(make(tensors, BLOCK, HEADS, DIM))
        start = 7 * BLOCK + 5
        cases = {"run": (_run, np.arange(start, start + args.slots, dtype=np.int64)),
                 "single": (_singles, np.sort(rng.choice(BLOCKS * BLOCK, args.slots, replace=False)).astype(np.int64))}
        for case, (fn, slots) in cases.items():
            assert (fn(t.src, t.runs, t.keys, slots, True) == fn(t.src, t.runs, t.keys, slots, False)).all()
            for temp in ("hot", "cold"):
                times: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(args.repeats):
                    for hint in (True, False):
                        if temp == "cold":
                            junk.sum()
                        else:
                            fn(t.src, t.runs, t.keys, slots, hint)
                        t0 = time.perf_counter()
                        fn(t.src, t.runs, t.keys, slots, hint)
                        times[hint].append(time.perf_counter() - t0)
                for hint in (True, False):
                    sec = statistics.median(times[hint])
                    print(json.dumps({"layout": name, "case": case, "caches": temp, "hints": hint,
                                      "slots": len(slots), "us": round(sec * 1e6, 1),
                                      "content_GB_s": round(len(slots) * content / sec / 1e9, 2),
                                      "lines_GB_s": round(touched(name, slots) / sec / 1e9, 2),
                                      "lines_KiB": touched(name, slots) // 1024, "threads": args.threads}), flush=True)
        guard(t, tensors, junk, name)
    t0 = time.perf_counter()
    for _ in range(3):
        junk.sum()
    print(json.dumps({"read_bandwidth_GB_s": round(3 * junk.nbytes / (time.perf_counter() - t0) / 1e9, 2)}))


if __name__ == "__main__":
    main()
