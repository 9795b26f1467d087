"""A scripted paged serving engine without a model, for tests, benchmarks and the selftest.

It has what real engines have around the KV cache: a block pool with reference counts, a prefix
cache with block sharing and LRU eviction, chunked prefill, decode, abort, and preemption with
recompute. Its "forward" writes deterministic bytes derived from (token, position, prefix) into
real per-layer K and V tensors, in one of several layouts, so a canary sees a realistic pool.
It is not a product: it exists so the canary can be exercised and attacked.
"""

from __future__ import annotations

import dataclasses

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvcanary.sim.kv import make_kv
from kvcanary.sim.pool import BlockPool
from kvcanary.sim.spec import EngineSpec
from kvcanary.step import Step

_MASK = (1 << 61) - 1


@dataclass
class Request:
    rid: int
    tokens: list[int]
    prompt_len: int
    max_new: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache
    offloaded: dict | None = None  # host copy of the KV while preempted (offload engines)
    seeds: list[int] = field(default_factory=list)  # rolling prefix hash per position

    def seed(self, p: int) -> int:
        """A hash of ``tokens[: p + 1]``: what the scripted forward derives position ``p``'s KV from."""
        while len(self.seeds) <= p:
            prev = self.seeds[-1] if self.seeds else 0x5C81
            self.seeds.append(hash((prev, self.tokens[len(self.seeds)])) & _MASK)
        return self.seeds[p]

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class ScriptedEngine:
    """Runs requests step by step; ``canary`` (anything with before/after_forward) is called around
    each forward, and ``hooks`` let tests act at the defined points ``"before_forward"``,
    ``"after_forward"`` and ``"after_step"`` (callables taking ``(engine, step)``), and
    ``"offload"`` / ``"reload"`` (callables taking ``(engine, payload)``, where the payload holds the
    host copy: ``kv`` per layer and half, ``stamps``, and on reload the destination ``slots``)."""

    def __init__(self, spec: EngineSpec, canary: object | None = None) -> None:
        self.spec = spec
        self.canary = canary
        self.rng = random.Random(spec.seed)
        self.pool = BlockPool(spec.num_blocks, spec.prefix_cache)
        self.num_slots = spec.num_blocks * spec.block_size
        self.kv, self.layout = make_kv(spec)
        if spec.null_block:
            self.pool.free.remove(0)
            self.layout = dataclasses.replace(self.layout, reserved=tuple(range(spec.block_size)))
        self.padding_writes: list[int] = []  # slots this step's padding tokens write (a fault sets them)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.hooks: dict[str, list[Callable[["ScriptedEngine", Any], None]]] = {}
        self.next_rid = 0
        self.steps = 0
        self.tokens_generated = 0
        self.preemptions = 0
        self.aborts = 0
        self.offloads = 0
        self.reloads = 0
        self.last_step: Step | None = None
        self.last_rows: list[Request] = []

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt: list[int], max_new: int) -> Request:
        r = Request(self.next_rid, list(prompt), len(prompt), max_new)
        self.next_rid += 1
        self.waiting.append(r)
        return r

    def abort(self, req: Request) -> None:
        self._free(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.aborts += 1

    def preempt(self, req: Request) -> None:
        """Free the request's blocks; it recomputes its whole sequence when readmitted, or, with
        ``spec.offload``, reloads its KV (and stamps) from the host tier."""
        if self.spec.offload and req.computed:
            self._offload(req)
        self._free(req)
        req.computed = 0
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.preemptions += 1

    def _offload(self, req: Request) -> None:
        slots = torch.tensor(self.slots_of(req, 0, req.computed), dtype=torch.int64)
        payload = {
            "count": req.computed,
            "kv": [[view[slots] for view in pair] for pair in self.kv],  # index gathers are copies
            "stamps": self.canary.export_stamps(slots) if self.canary is not None else None,  # type: ignore[attr-defined]
        }
        self._run_hooks("offload", payload)
        req.offloaded = payload
        self.offloads += 1

    def _reload(self, req: Request) -> bool:
        """Bring an offloaded request's KV back into fresh blocks; False if the pool is full."""
        payload = req.offloaded
        assert payload is not None
        n = payload["count"]
        if not self._reserve(req, n, preempt=False):  # admission never preempts: no ping-pong
            self._free(req)
            return False
        req.offloaded = None
        slots = torch.tensor(self.slots_of(req, 0, n), dtype=torch.int64)
        payload["slots"] = slots
        self._run_hooks("reload", payload)
        for pair, saved in zip(self.kv, payload["kv"]):
            for view, rows in zip(pair, saved):
                view[slots] = rows
        if self.canary is not None:
            self.canary.import_stamps(slots, payload["stamps"])  # type: ignore[attr-defined]
        req.computed = n
        self.reloads += 1
        return True

    def _free(self, req: Request) -> None:
        for b in req.blocks:
            self.pool.release(b)
        req.blocks = []

    def prefix_hash(self, req: Request, nblocks: int) -> int:
        return req.seed(nblocks * self.spec.block_size - 1)

    # ---- scheduling -----------------------------------------------------------------------

    def _admit(self) -> None:
        bs = self.spec.block_size
        while self.waiting and len(self.running) < self.spec.max_running:
            req = self.waiting.pop(0)
            if req.offloaded is not None:
                self.running.append(req)
                if not self._reload(req):
                    self.running.remove(req)
                    self.waiting.insert(0, req)
                    break
                continue
            shareable = (len(req.tokens) - 1) // bs  # always compute at least the last token
            for i in range(shareable):
                b = self.pool.lookup(self.prefix_hash(req, i + 1))
                if b is None:
                    break
                req.blocks.append(b)
            req.computed = len(req.blocks) * bs
            if req.blocks and self.canary is not None:  # other requests wrote them: verified before the read
                self.canary.first_read(torch.tensor(self.slots_of(req, 0, req.computed)))  # type: ignore[attr-defined]
            self.running.append(req)

    def _reserve(self, req: Request, upto: int, preempt: bool = True) -> bool:
        """Own blocks for positions ``< upto``, preempting the newest other request if needed."""
        bs = self.spec.block_size
        while len(req.blocks) * bs < upto:
            b = self.pool.allocate()
            if b is None:
                victims = [r for r in self.running if r is not req] if preempt else []
                if not victims:
                    return False
                self.preempt(victims[-1])
                continue
            req.blocks.append(b)
        return True

    def step(self) -> Step | None:
        """Schedule, verify, forward (write KV), stamp, then sample. ``None`` when idle."""
        self._admit()
        plan: list[tuple[Request, int]] = []
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted while reserving for another request
            n = min(self.spec.chunk_size, len(req.tokens) - req.computed)
            if n > 0 and self._reserve(req, req.computed + n):
                plan.append((req, n))
        plan = [(r, n) for r, n in plan if r in self.running]
        if not plan:
            return None
        step = self._build_step(plan)
        self.last_step, self.last_rows = step, [r for r, _ in plan]
        self._run_hooks("before_forward", step)
        if self.canary is not None:
            self.canary.before_forward(step)  # type: ignore[attr-defined]
        self.write_kv(step.new_tokens, step.new_positions, step.new_slots, self._seeds(plan))
        pads, self.padding_writes = self.padding_writes, []
        if pads:  # padding tokens that write somewhere: the engine's own batch says where
            self.write_kv(torch.zeros(len(pads), dtype=torch.int64), torch.zeros(len(pads), dtype=torch.int64),
                          torch.tensor(pads), torch.full((len(pads),), 7))
        self._run_hooks("after_forward", step)
        if self.canary is not None:
            self.canary.after_forward(step, torch.tensor(pads) if pads else None)  # type: ignore[attr-defined]
            self.canary.patrol()  # type: ignore[attr-defined]  # this forward's share of the patrol scrub
        self._finish_step(plan)
        self._run_hooks("after_step", step)
        self.steps += 1
        return step

    def _run_hooks(self, point: str, arg: Any) -> None:
        for fn in self.hooks.get(point, []):
            fn(self, arg)

    def _finish_step(self, plan: list[tuple[Request, int]]) -> None:
        bs = self.spec.block_size
        for req, n in plan:
            before = req.computed // bs
            req.computed += n
            for i in range(before, req.computed // bs):
                self.pool.register(req.blocks[i], self.prefix_hash(req, i + 1))
            if req.computed == len(req.tokens):
                if req.generated >= req.max_new:
                    self._free(req)
                    self.running.remove(req)
                    self.finished.append(req)
                else:
                    req.tokens.append(self.sample(req))
                    self.tokens_generated += 1

    def sample(self, req: Request) -> int:
        return (req.seed(len(req.tokens) - 1) * 0x9E37 + 11) % self.spec.vocab

    # ---- step metadata ----------------------------------------------------------------------

    def slots_of(self, req: Request, start: int, end: int) -> list[int]:
        bs = self.spec.block_size
        return [req.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def _build_step(self, plan: list[tuple[Request, int]]) -> Step:
        spec, bs = self.spec, self.spec.block_size
        rows = len(plan) + spec.pad_rows
        width = max(r.computed + n for r, n in plan)
        cached = [r.computed for r, _ in plan] + [0] * spec.pad_rows
        offsets = [0]
        toks: list[int] = []
        poss: list[int] = []
        slots: list[int] = []
        for req, n in plan:
            toks += req.tokens[req.computed : req.computed + n]
            poss += list(range(req.computed, req.computed + n))
            slots += self.slots_of(req, req.computed, req.computed + n)
            offsets.append(len(toks))
        offsets += [len(toks)] * spec.pad_rows
        exp = torch.full((rows, width), -1, dtype=torch.int64)
        for i, (req, n) in enumerate(plan):
            exp[i, : req.computed + n] = torch.tensor(req.tokens[: req.computed + n])
        kw: dict[str, object] = {}
        if spec.table == "block":
            tab = torch.zeros(rows, -(-width // bs), dtype=torch.int32)
            for i, (req, _) in enumerate(plan):
                tab[i, : len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
            kw = dict(block_table=tab, block_size=bs)
        else:
            tab = torch.zeros(rows, width, dtype=torch.int32)
            for i, (req, n) in enumerate(plan):
                tab[i, : req.computed + n] = torch.tensor(self.slots_of(req, 0, req.computed + n), dtype=torch.int32)
            kw = dict(slot_table=tab)
        cached_t = torch.tensor(cached, dtype=torch.int64)
        starts = None
        if spec.window is not None:
            starts = (cached_t - spec.window).clamp_min(0)
        new_tokens = torch.tensor(toks, dtype=torch.int64)
        return Step(
            cached_lens=cached_t,
            new_offsets=torch.tensor(offsets, dtype=torch.int64),
            new_tokens=new_tokens,
            new_positions=torch.tensor(poss, dtype=torch.int64),
            new_slots=torch.tensor(slots, dtype=torch.int64),
            read_starts=starts,
            row_valid=torch.arange(rows) < len(plan),
            expected_tokens=exp,
            expected_new_tokens=new_tokens.clone(),  # the requests' own tokens (faults edit new_tokens)
            **kw,  # type: ignore[arg-type]
        )

    # ---- KV bytes ---------------------------------------------------------------------------

    def _seeds(self, plan: list[tuple[Request, int]]) -> torch.Tensor:
        out = [req.seed(p) for req, n in plan for p in range(req.computed, req.computed + n)]
        return torch.tensor(out, dtype=torch.int64)

    def write_kv(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 seeds: torch.Tensor) -> None:
        """Write every layer's K and V for ``slots`` (padding slots < 0 are skipped)."""
        keep = slots >= 0
        slots, seeds = slots[keep], seeds[keep]
        for li, views in enumerate(self.kv):
            for hi, view in enumerate(views):
                width = view.shape[-1]
                j = torch.arange(width, dtype=torch.int64)
                v = (seeds[:, None] * 2654435761 + (li * 2 + hi + 1) * 40503 + j * 97) % 65521
                view[slots] = v.to(torch.int16)
