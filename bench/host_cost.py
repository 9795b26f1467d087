"""The canary's host cost per forward at the batch sizes GPU servers run, on the CPU.

For each engine adapter's step building (transformers continuous batching: the compiled
:class:`~kvcanary.engines.transformers.compiled.StepBuilder` from the batch's read and write indices
and the requests' states; vLLM: :mod:`kvcanary.engines.vllm.steps` from stand-in attention metadata
and the scheduler side's request records), then every canary call of a forward (verify before,
stamp, guard and patrol after, the drain), times per forward:

- ``host_us``: step building plus every canary call, the compiled ops included;
- ``ops_us``: the compiled forward entries alone (:mod:`kvcanary.fused.forward`: the data work);
- ``build_us``, ``before_us``, ``after_us``, ``drain_us``: the stages; ``outside_ops_us`` = host - ops;
- ``before_MB``, ``after_MB``: the bytes the compiled loops move per forward (a stamp and a table
  entry per read or written slot, and the content bytes fingerprinted), and ``ops_GBps`` their rate,
  beside this core's read bandwidth (``read_bandwidth_GBps_1thread``, a torch sum over 256 MiB).

Cases: 16, 64 and 256 running requests at 1K and 4K context, decode (one new token per request)
and mixed (a quarter of the requests prefill a 256-token chunk, half the context where that is
shorter), plus the demo's shape (16 requests, ``--contexts 48``), with metadata checks only
(``content_budget_bytes=0``, no patrol) and with the default budgets. Every request advances each
forward, as in a decode run; the engine's own metadata for the next forward is made between the
timed parts. The KV pool is synthetic: 4 content sources of 128 bytes a token (a layer's K and V of
two layers), a slot per context token plus room to grow. Medians over ``--forwards``; one JSON line
per case. Intra-op threads: 1 (``torch.set_num_threads``), the compiled loops are single-threaded.

    python bench/host_cost.py [--engines transformers,vllm] [--forwards 12] [--requests 16,64,256] [--contexts 48,1024,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvcanary import Canary, CanaryConfig  # noqa: E402
from kvcanary.engines.token_book import TokenBook  # noqa: E402
from kvcanary.fused.forward import ForwardArgs  # noqa: E402
from kvcanary.layout import ByteSource, KvLayout  # noqa: E402

BLOCK = 16


def target_us(n: int, ctx: int, mixed: bool, metadata_only: bool) -> int | None:
    """The host-time targets per forward: the demo-shaped decode forward (16 requests of a short
    context), and 256 requests x 4K context with metadata checks."""
    if n == 16 and ctx <= 64 and not mixed:
        return 150
    if n == 256 and ctx == 4096 and metadata_only:
        return 1000
    return None


class Timed:
    """Time spent in the compiled forward entries (wraps :class:`ForwardArgs`' two calls)."""

    spent = 0.0

    @classmethod
    def install(cls) -> None:
        for name in ("before", "after"):
            fn = getattr(ForwardArgs, name)

            def timed(self, *a, _fn=fn):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                try:
                    return _fn(self, *a)
                finally:
                    cls.spent += time.perf_counter() - t

            setattr(ForwardArgs, name, timed)


def make_canary(num_slots: int, metadata_only: bool) -> Canary:
    kv = torch.randint(-100, 100, (num_slots, 4, 64), dtype=torch.int16)  # [slot, source, 64 x 2 bytes]
    sources = tuple(ByteSource.from_tensor(f"s{i}", kv[:, i]) for i in range(4))
    cfg = CanaryConfig(mode="log", backend="fused", content_budget_bytes=0 if metadata_only else "auto",
                       patrol_budget_bytes=0 if metadata_only else "auto")
    return Canary(num_slots, KvLayout(sources), cfg)


def chunk(ctx: int) -> int:
    """The prefill chunk of the mixed batches: 256 tokens, or half a shorter context."""
    return min(256, ctx // 2)


class Requests:
    """``n`` running requests of ``ctx`` tokens: decode, or a quarter prefilling 256-token chunks."""

    def __init__(self, n: int, ctx: int, mixed: bool, num_slots: int, grow: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.n, self.mixed = n, mixed
        self.q = np.ones(n, dtype=np.int64)
        if mixed:
            self.q[: max(1, n // 4)] = chunk(ctx)
        self.past = np.full(n, ctx, dtype=np.int64) - self.q
        per = -(-(ctx + grow) // BLOCK)  # blocks per request, with room to grow
        blocks = rng.permutation(num_slots // BLOCK)[: n * per].reshape(n, per)
        self.blocks = blocks.astype(np.int64)
        self.tokens = rng.integers(0, 32000, (n, ctx + grow), dtype=np.int64)
        self.states = [types.SimpleNamespace(request_id=f"r{i}", initial_tokens=self.tokens[i, :8].tolist(),
                                             generated_tokens=self.tokens[i, 8:ctx].tolist(), position_offset=ctx)
                       for i in range(n)]

    def slots(self, row: int, lo: int, hi: int) -> np.ndarray:
        pos = np.arange(lo, hi)
        return self.blocks[row, pos // BLOCK] * BLOCK + pos % BLOCK

    def advance(self) -> None:
        """Every request moves on by its new tokens (a prefill chunk's request keeps prefilling)."""
        for i, st in enumerate(self.states):
            end = int(self.past[i] + self.q[i])
            st.generated_tokens.extend(
                self.tokens[i, len(st.initial_tokens) + len(st.generated_tokens): end + int(self.q[i])].tolist())
            self.past[i] = end
            st.position_offset = end + int(self.q[i])

    def cb_batch(self) -> tuple[dict, list]:
        """transformers continuous batching's forward metadata (one layer group)."""
        cu_q = np.zeros(self.n + 1, dtype=np.int32)
        np.cumsum(self.q, out=cu_q[1:])
        cu_k = np.zeros(self.n + 1, dtype=np.int32)
        np.cumsum(self.past + self.q, out=cu_k[1:])
        read = np.concatenate([self.slots(i, 0, int(self.past[i] + self.q[i])) for i in range(self.n)])
        write = np.concatenate([self.slots(i, int(self.past[i]), int(self.past[i] + self.q[i])) for i in range(self.n)])
        ids = np.concatenate([self.tokens[i, self.past[i]: self.past[i] + self.q[i]] for i in range(self.n)])
        pos = np.concatenate([np.arange(self.past[i], self.past[i] + self.q[i]) for i in range(self.n)])
        ids, pos = ids.astype(np.int32), pos.astype(np.int32)  # as the engine's batch holds them
        t = torch.from_numpy
        batch = {"cu_seq_lens_q": t(cu_q), "cu_seq_lens_k": t(cu_k), "read_index": [t(read)], "write_index": [t(write)],
                 "input_ids": t(ids)[None], "position_ids": t(pos)[None]}
        reqs = [types.SimpleNamespace(query_length=int(self.q[i]), state=st) for i, st in enumerate(self.states)]
        for i, st in enumerate(self.states):
            st.position_offset = int(self.past[i] + self.q[i])
        return batch, reqs

    def vllm_inputs(self, first: bool) -> tuple[types.SimpleNamespace, list]:
        """vLLM's attention metadata of one KV cache group and the scheduler side's request records."""
        from kvcanary.engines.vllm.steps import ReqStep

        qsl = np.zeros(self.n + 1, dtype=np.int32)
        np.cumsum(self.q, out=qsl[1:])
        seq = (self.past + self.q).astype(np.int32)
        slots = np.concatenate([self.slots(i, int(self.past[i]), int(seq[i])) for i in range(self.n)])
        md = types.SimpleNamespace(query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq),
                                   slot_mapping=torch.from_numpy(slots), num_actual_tokens=int(qsl[-1]),
                                   block_table=torch.from_numpy(self.blocks.astype(np.int32)))
        reqs = []
        for i in range(self.n):
            c, s = int(self.past[i]), int(self.q[i])
            start = 0 if first else c
            reqs.append(ReqStep(req_id=f"r{i}", computed=c, scheduled=s, first_slot=int(slots[qsl[i]]), start=start,
                                tokens=self.tokens[i, start: c + s].tolist()))
        return md, reqs


class CbForward:
    """The transformers adapter's per-forward work: the compiled step build, the canary's hooks."""

    def __init__(self, canary: Canary) -> None:
        from kvcanary.engines.transformers.compiled import StepBuilder

        self.canary, self.book, self.builder = canary, TokenBook(), StepBuilder()
        pages = types.SimpleNamespace(block_stride=BLOCK)  # the group's geometry: what the step build reads of it
        self.groups = {"full": types.SimpleNamespace(index=0, pages=pages, block_size=BLOCK, trash=-7, canary=canary)}

    def prepare(self, reqs_: Requests, first: bool) -> tuple:
        return reqs_.cb_batch()

    def build(self, batch: dict, reqs: list) -> dict:
        return self.builder.build(self.groups, self.book, batch, reqs)


class VllmForward:
    """The vLLM adapter's per-forward work: the token book, rows matched to requests, one group's step."""

    def __init__(self, canary: Canary) -> None:
        self.canary, self.book = canary, TokenBook()

    def prepare(self, reqs_: Requests, first: bool) -> tuple:
        return reqs_.vllm_inputs(first)

    def build(self, md: types.SimpleNamespace, reqs: list) -> dict:
        from kvcanary.engines.vllm.steps import build_step, match_rows

        self.book.extend_all([(r.req_id, r.start, r.tokens) for r in reqs if r.tokens])
        rows = match_rows(md, reqs, self.book)
        return {"full": build_step(md, rows, BLOCK, None)}


def run_case(engine: str, n: int, ctx: int, mixed: bool, metadata_only: bool, forwards: int) -> dict:
    grow = (forwards + 4) * (chunk(ctx) if mixed else 1)
    num_slots = n * -(-(ctx + grow) // BLOCK) * BLOCK + BLOCK
    canary = make_canary(num_slots, metadata_only)
    reqs = Requests(n, ctx, mixed, num_slots, grow)
    fwd = (CbForward if engine == "transformers" else VllmForward)(canary)
    # the cache the requests read was written before: stamp it (untimed), as the engine's earlier forwards did
    warm = Requests(n, ctx, False, num_slots, grow)
    warm.q[:] = warm.past + warm.q
    warm.past[:] = 0
    for st in warm.states:
        st.position_offset = ctx
        st.generated_tokens = warm.tokens[int(st.request_id[1:]), 8:ctx].tolist()
    steps = fwd.build(*fwd.prepare(warm, True))
    for s in steps.values():
        canary.after_forward(s)
    canary.drain()
    rec: dict[str, list[float]] = {k: [] for k in ("build", "before", "after", "drain", "host", "ops")}
    per_slot = canary.layout.content_bytes_per_slot
    for i in range(forwards + 2):  # the first two warm the buffers and the caches
        if i == 2:
            st0 = canary.stats()
        args = fwd.prepare(reqs, False)
        Timed.spent = 0.0
        t0 = time.perf_counter()
        steps = fwd.build(*args)
        t1 = time.perf_counter()
        for s in steps.values():
            canary.before_forward(s)
        t2 = time.perf_counter()
        for s in steps.values():
            canary.after_forward(s, patrol=True)
        t3 = time.perf_counter()
        found = canary.drain()
        t4 = time.perf_counter()
        assert not found and canary.internal_errors == 0, (found[:3], canary.internal_errors)
        if i >= 2:
            for k, v in (("build", t1 - t0), ("before", t2 - t1), ("after", t3 - t2), ("drain", t4 - t3),
                         ("host", t4 - t0), ("ops", Timed.spent)):
                rec[k].append(v * 1e6)
        reqs.advance()
    med = {k: round(statistics.median(v), 1) for k, v in rec.items()}
    st = canary.stats()
    d = {k: (st[k] - st0[k]) / forwards for k in st0}
    # bytes each stage's compiled loops move per forward: a stamp and a table entry per read or written
    # slot, the content bytes fingerprinted (verify window; stamp, guard slots and patrol after)
    before_b = d["slots_verified"] * 40 + d["content_bytes_verified"]
    after_b = d["slots_stamped"] * 40 + d["content_bytes_stamped"] + d["content_bytes_scrubbed"] + \
        d["guard_checks"] * per_slot
    out = {"engine": engine, "requests": n, "context": ctx, "kind": "mixed" if mixed else "decode",
           "checks": "metadata" if metadata_only else "default_budget",
           "read_slots": int(reqs.past.sum()), "new_tokens": int(reqs.q.sum()),
           **{f"{k}_us": v for k, v in med.items()}, "outside_ops_us": round(med["host"] - med["ops"], 1),
           "before_MB": round(before_b / 1e6, 3), "after_MB": round(after_b / 1e6, 3),
           "ops_GBps": round((before_b + after_b) / med["ops"] / 1e3, 2) if med["ops"] else None,
           "target_us": target_us(n, ctx, mixed, metadata_only), "forwards": forwards, "threads": 1}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="transformers,vllm")
    ap.add_argument("--requests", default="16,64,256")
    ap.add_argument("--contexts", default="48,1024,4096")
    ap.add_argument("--kinds", default="decode,mixed")
    ap.add_argument("--checks", default="metadata,default_budget")
    ap.add_argument("--forwards", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    Timed.install()
    big = torch.ones(1 << 25, dtype=torch.int64)  # 256 MiB
    big.sum()
    t = time.perf_counter()
    big.sum()
    print(json.dumps({"read_bandwidth_GBps_1thread": round(big.numel() * 8 / (time.perf_counter() - t) / 1e9, 2)}))
    del big
    for engine in args.engines.split(","):
        for n in map(int, args.requests.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                for kind in args.kinds.split(","):
                    for checks in args.checks.split(","):
                        print(json.dumps(run_case(engine, n, ctx, kind == "mixed", checks == "metadata",
                                                  args.forwards)), flush=True)


if __name__ == "__main__":
    main()
