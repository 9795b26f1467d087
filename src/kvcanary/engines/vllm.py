"""Protect a vLLM V1 engine with one flag: a KV connector that stamps and verifies every worker's cache.

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvCanaryConnector","kv_role":"kv_both"}'
    LLM(model=..., kv_transfer_config={"kv_connector": "KvCanaryConnector", "kv_role": "kv_both"})

The name resolves through kvcanary's ``vllm.general_plugins`` entry point
(:func:`kvcanary.engines.vllm_plugin.register`), loaded in every vLLM process. Configuration comes
from the ``KVCANARY_*`` variables (default mode ``log``); ``KVCANARY_VIOLATIONS_LOG`` collects every
worker's events in one JSONL file. With another connector, list both under vLLM's
``MultiConnector``; the canary verifies what the other one lands.

Scheduler side (engine core): ships, per step, each scheduled request's new token ids, its
computed-token count and the slot of its first new token, and the blocks vLLM zeroes. Worker side
(one canary per worker and tensor-parallel rank): at ``bind_connector_metadata``, inside the forward
context, it builds the step from the CPU attention metadata (block table, sequence lengths, query
start offsets, slot mapping) and verifies every cached slot each request reads; reads of slots that
another request of the batch computes in this same forward (a prefix-cache hit handed out before its
KV exists) are left to ``wait_for_save``, which stamps the written slots and then verifies those.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcanary import layouts
from kvcanary.canary import Canary
from kvcanary.config import CanaryConfig
from kvcanary.engines.base import Adapter, step_from_block_table
from kvcanary.engines.token_book import TokenBook
from kvcanary.errors import UnsupportedError
from kvcanary.step import Step
from kvcanary.violations import Site, Violation

log = logging.getLogger("kvcanary")
NAME = "KvCanaryConnector"


@dataclass
class ReqStep:
    """One scheduled request in one step, as the scheduler sees it."""

    req_id: str
    computed: int  # tokens already in the cache (read this step)
    scheduled: int  # tokens written this step
    first_slot: int  # the slot of its first new token (matches the worker's row)
    start: int  # position of the first token in ``tokens``
    tokens: list[int]  # token ids from ``start`` on that the worker has not been sent yet
    landed_from: int = -1  # another connector lands positions [landed_from, computed) this step
    prompt_len: int = 0


@dataclass
class CanaryMeta(KVConnectorMetadata):
    """What the scheduler side sends the workers each step."""

    reqs: list[ReqStep] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    zeroed: list[int] = field(default_factory=list)  # blocks vLLM zeroes before this forward


class KvCanaryConnector(KVConnectorBase_V1, Adapter):
    """vLLM V1 KV connector that runs kvcanary on every worker. Loads and saves no KV itself."""

    engine = "vllm"

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        Adapter.__init__(self, CanaryConfig.from_env(CanaryConfig(mode="log")))
        self.block_size = int(vllm_config.cache_config.block_size)
        extra = dict(getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {})
        self.stamp_store: str | None = extra.get("stamp_store") or os.environ.get("KVCANARY_STAMP_STORE")
        self._local: dict[str, int] = {}  # request id -> tokens the local prefix cache had
        self.rank = _rank()
        # scheduler side
        self._reqs: dict[str, Any] = {}  # request id -> vLLM Request
        self._sent: dict[str, int] = {}  # request id -> tokens already sent to the workers
        self._finished: list[str] = []
        # worker side
        self.canary: Canary | None = None
        self.forwards = 0
        self._step: Step | None = None
        self._rows: list[str] = []
        self._history: dict[int, list[str]] = {}  # forward -> its rows' request ids (the diagnosis' writers)
        self._seen: set[str] = set()  # requests whose first read of cached KV was verified
        self._meta = CanaryMeta()
        self.kv_caches: dict[str, torch.Tensor] = {}

    # ---- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._reqs[request.request_id] = request
        self._local[request.request_id] = num_computed_tokens
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._reqs[request.request_id] = request

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        so = scheduler_output
        meta = CanaryMeta(finished=self._finished, zeroed=list(so.new_block_ids_to_zero or []))
        self._finished = []
        for r in so.scheduled_new_reqs:
            self._add(meta, r.req_id, r.num_computed_tokens, so.num_scheduled_tokens[r.req_id], r.block_ids[0])
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            blocks = self._kv_cache_manager.get_block_ids(rid)[0] if self._kv_cache_manager is not None else []
            self._add(meta, rid, cached.num_computed_tokens[i], so.num_scheduled_tokens[rid], blocks)
        return meta

    def _add(self, meta: CanaryMeta, rid: str, computed: int, scheduled: int, blocks: list[int]) -> None:
        req = self._reqs.get(rid)
        if req is None or not blocks:
            return
        have = self._sent.get(rid, 0)
        known = req.all_token_ids
        upto = min(len(known), computed + scheduled)  # a token not yet sampled is not sent, never guessed
        tokens = list(known[have:upto]) if upto > have else []
        self._sent[rid] = max(have, upto)
        first = blocks[computed // self.block_size] * self.block_size + computed % self.block_size
        local = self._local.pop(rid, computed)  # below computed: another connector lands the rest
        meta.reqs.append(ReqStep(rid, computed, scheduled, first, have, tokens,
                                 landed_from=local if local < computed else -1,
                                 prompt_len=len(req.prompt_token_ids or [])))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._reqs.pop(rid, None)
        self._sent.pop(rid, None)
        self._local.pop(rid, None)
        self._finished.append(rid)
        return False, None

    # ---- worker side --------------------------------------------------------------------------

    def canaries(self) -> list[Canary]:
        return [self.canary] if self.canary is not None else []

    def _first_reader(self, v: Violation) -> Violation:
        rid = self.first_reader("kv", v)
        return dataclasses.replace(v, request=rid) if rid else v

    def request_at(self, step: int, row: int) -> str | None:
        rids = self._history.get(step, [])
        return rids[row] or None if 0 <= row < len(rids) else None

    def named_canaries(self) -> dict[str, Canary]:
        return {"kv": self.canary} if self.canary is not None else {}

    def metric_labels(self) -> dict[str, str]:
        return {"engine": self.engine, "tp_rank": str(self.rank), "pp_rank": str(_pp_rank()),
                "dp_rank": str(getattr(self._vllm_config.parallel_config, "data_parallel_rank", 0))}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.shielded("register_kv_caches", self._register, kv_caches)

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = list(kv_caches.values())
        t = tensors[0]
        if t.dim() != 4 or t.device.type != "cpu":
            raise UnsupportedError(f"vLLM KV cache: expected the CPU backend's [num_blocks, kv_heads, block_size, "
                                   f"2 * head_dim] tensors, got shape {tuple(t.shape)} on {t.device}")
        num_blocks, heads, bs, two_d = t.shape
        self.kv_caches = kv_caches
        isa = _cpu_isa(t.dtype, bs, two_d // 2)
        build = {"vec": layouts.vllm_cpu_vec, "vec16": layouts.vllm_cpu_vec, "amx": layouts.vllm_cpu_amx}.get(isa)
        if build is None:
            raise UnsupportedError(f"vLLM CPU attention kernels {isa!r}: kvcanary describes the KV layouts of "
                                   f"'vec', 'vec16' and 'amx', not this one; the canary is off on this worker")
        # block 0 is vLLM's null block: tables pad with it, nothing may write it
        layout = dataclasses.replace(build(tensors, bs, heads, two_d // 2), reserved=tuple(range(bs)))
        self.canary = Canary(num_blocks * bs, layout, self.config)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step = None
        if self.canary is not None and isinstance(connector_metadata, CanaryMeta):
            self.shielded("the before-forward check", self._before, connector_metadata)

    def _before(self, meta: CanaryMeta) -> None:
        from vllm.forward_context import get_forward_context

        assert self.canary is not None
        for rid in meta.finished:
            self.book.forget(rid)
            self._seen.discard(rid)
        for r in meta.reqs:
            if r.tokens:
                self.book.extend(r.req_id, r.start, r.tokens)
        if meta.zeroed:  # zeroed bytes: their stamps go too (a read before a write is EMPTY)
            self.canary.release(_block_slots(meta.zeroed, self.block_size))
        md = get_forward_context().attn_metadata
        if not md:
            return
        md = next(iter(md.values())) if isinstance(md, dict) else md
        step, rows = build_step(md, meta.reqs, self.book, self.block_size)
        self._step, self._rows, self._meta = step, rows, meta
        self._history[self.forwards] = rows
        self._history.pop(self.forwards - self.config.history, None)
        self._verify_first_reads(step, rows)
        self.canary.before_forward(step)

    def _verify_first_reads(self, step: Step, rows: list[str]) -> None:
        """A request's first step with KV already cached (a local prefix-cache hit) reads blocks it
        did not write: every byte of them is verified before this forward (up to the positions this
        same step writes or another connector lands, which are checked as they are written or land)."""
        assert self.canary is not None
        self.forget_first_reads()
        for i, rid in enumerate(rows):
            if not rid or rid in self._seen:
                continue
            self._seen.add(rid)
            end = int((step.written_from if step.written_from is not None else step.cached_lens)[i])
            if end <= 0:
                continue
            self.verify_first_read("kv", step, i, 0, end, rid)

    def wait_for_save(self) -> None:
        if self._step is not None:
            self.shielded("the after-forward check", self._after)

    def _after(self) -> None:
        assert self.canary is not None and self._step is not None
        self.canary.after_forward(self._step)
        self.canary.patrol()  # this forward's share of the patrol over cold cache
        self.forwards += 1
        self.report([self._first_reader(v) if v.site == Site.FIRST_READ else _named(v, self._rows)
                     for v in self.canary.drain()], rank=self.rank)
        self.publish_metrics()
        if self.stamp_store:
            self._store()

    def _store(self) -> None:
        """Save the stamps of each new prompt's whole blocks beside the KV another connector stores."""
        from kvcanary import stamp_store

        assert self.canary is not None and self._step is not None and self.stamp_store
        bs = self.block_size
        for r in self._meta.reqs:
            n = (r.prompt_len - 1) // bs * bs  # what a prefix store keeps of it
            if r.computed or r.landed_from >= 0 or n <= 0 or r.scheduled < n or r.req_id not in self._rows:
                continue
            row = self._rows.index(r.req_id)
            stamps = self.canary.export_stamps(self._step.lookup(torch.full((n,), row), torch.arange(n)))
            if stamps is not None:
                stamp_store.save(self.stamp_store, self.book.window([r.req_id], [n], n)[0].tolist(), stamps,
                                 {n, (r.prompt_len - 2) // bs * bs})

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """After the other connectors of a MultiConnector landed their KV: install the stamps that
        travelled with it and verify every landed byte (a torn or wrong load is reported here)."""
        if self._step is not None and any(r.landed_from >= 0 for r in self._meta.reqs):
            self.shielded("the landing check", self._landed)

    def _landed(self) -> None:
        from kvcanary import stamp_store

        assert self.canary is not None and self._step is not None
        step = self._step
        for r in self._meta.reqs:
            if r.landed_from < 0 or r.req_id not in self._rows:
                continue
            row = self._rows.index(r.req_id)
            pos = torch.arange(r.landed_from, r.computed)
            slots = step.lookup(torch.full_like(pos, row), pos)
            tokens = self.book.window([r.req_id], [r.computed], r.computed)[0].tolist()
            stamps = stamp_store.load(self.stamp_store, tokens) if self.stamp_store else None
            self.canary.import_stamps(slots, None if stamps is None else stamps[r.landed_from : r.computed])
            self.report([dataclasses.replace(v, request=r.req_id) for v in self.canary.drain()], rank=self.rank)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def stats(self) -> dict[str, int]:
        out = Adapter.stats(self)
        out["forwards"] = self.forwards
        return out

    def recover(self) -> None:
        self._step = None
        Adapter.recover(self)


def _cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The CPU attention kernels vLLM picks for this cache (they fix its byte layout)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_dim))


def build_step(md: Any, reqs: list[ReqStep], book: TokenBook, block_size: int) -> tuple[Step, list[str]]:
    """The step of one forward from vLLM's CPU attention metadata and the scheduler's requests.

    Rows follow the metadata (the runner's batch order); each is matched to its request by the
    slot of its first new token, and a row whose request says otherwise is padding. Reads of
    slots the step itself writes, and of KV another connector lands this step, start
    ``written_from``.
    """
    qsl = md.query_start_loc.long()
    r = qsl.shape[0] - 1
    n = int(md.num_actual_tokens)
    slots = md.slot_mapping[:n].long()
    cached = (md.seq_lens[:r].long() - (qsl[1:] - qsl[:-1])).tolist()
    by_slot = {x.first_slot: x for x in reqs}
    rows = [by_slot.get(s) for s in slots[qsl[:-1].clamp(max=max(n - 1, 0))].tolist()]
    ok = [x is not None and x.computed == c for x, c in zip(rows, cached)]
    rids = [x.req_id if x is not None else "" for x in rows]
    upto = [int(u) for u in md.seq_lens[:r].tolist()]
    tokens = book.window([rid or "__none__" for rid in rids], [u if k else 0 for u, k in zip(upto, ok)],
                         max(upto + [1]))
    step = step_from_block_table(md.block_table, block_size, qsl, md.seq_lens, slots, tokens, torch.tensor(ok))
    landed = torch.tensor([x.landed_from if x is not None and x.landed_from >= 0 else c for x, c in zip(rows, cached)],
                          dtype=torch.int64)
    assert step.written_from is not None
    step.written_from = torch.minimum(step.written_from, landed)  # landed KV is read once it has landed
    return step, rids


def _block_slots(blocks: list[int], block_size: int) -> torch.Tensor:
    b = torch.tensor(blocks, dtype=torch.int64)
    return (b[:, None] * block_size + torch.arange(block_size)).reshape(-1)


def _named(v: Violation, rids: list[str]) -> Violation:
    rid = rids[v.row] if 0 <= v.row < len(rids) and rids[v.row] else None
    return dataclasses.replace(v, request=rid)


def _pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except Exception:  # not initialised (scheduler side)
        return 0


def _rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (scheduler side)
        return int(os.environ.get("RANK", 0))
