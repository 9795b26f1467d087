"""The vLLM connector's scheduler side (engine core): what each step ships to the workers.

Per step and scheduled request (:class:`~kvcanary.engines.vllm.steps.ReqStep`): its new committed
token ids (a token not yet sampled is never guessed), the draft tokens its forward writes
(speculative decoding), its computed-token count, where rejected drafts were rolled back, and the
slot of its first new token in the primary KV cache group; per step, the requests that finished,
the blocks vLLM zeroes and the block copies it makes before the forward.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvcanary.engines.vllm.steps import ReqStep


F = TypeVar("F", bound=Callable[..., Any])


def timed(fn: F) -> F:
    """Count a scheduler-side hook's time in :attr:`SchedulerSide.seconds` (the process's total: the
    worker's stats report it as ``scheduler_us`` where the scheduler runs in the same process)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SchedulerSide.seconds += time.perf_counter() - t0

    return wrapper  # type: ignore[return-value]


def _id(block: Any) -> int:
    """A block id from vLLM's block ids (int) or its blocks (``KVCacheBlock``)."""
    return block if isinstance(block, int) else int(block.block_id)


@dataclass
class CanaryMeta(KVConnectorMetadata):
    """What the scheduler side sends the workers each step."""

    reqs: list[ReqStep] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    zeroed: list[int] = field(default_factory=list)  # blocks vLLM zeroes before this forward
    # block copies (source, destination) vLLM makes before this forward (a partial prefix-cache hit
    # copied to a private block)
    copies: list[tuple[int, int]] = field(default_factory=list)


class SchedulerSide:
    """The connector's scheduler-side hooks. The connector sets ``primary`` (the group whose slots
    match rows to requests), ``block_size`` (that group's) and ``ship_blocks`` (a healing mode: each
    request's blocks travel with its step)."""

    primary: int
    block_size: int
    ship_blocks: bool
    _kv_cache_manager: Any
    seconds = 0.0  # every scheduler side's hooks in this process, in all

    def __init__(self) -> None:
        self._reqs: dict[str, Any] = {}  # request id -> vLLM Request
        self._sent: dict[str, int] = {}  # request id -> tokens already sent to the workers
        self._end: dict[str, int] = {}  # request id -> computed + scheduled tokens as of its last step
        self._local: dict[str, int] = {}  # request id -> tokens the local prefix cache had
        self._finished: list[str] = []

    @timed
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._reqs[request.request_id] = request
        self._local[request.request_id] = num_computed_tokens
        return 0, False

    @timed
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._reqs[request.request_id] = request

    @timed
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The step's :class:`CanaryMeta`."""
        so = scheduler_output
        meta = CanaryMeta(finished=self._finished, zeroed=list(so.new_block_ids_to_zero or []),
                          copies=[(int(c[0]), int(c[1])) for c in getattr(so, "kv_cache_block_copies", None) or ()])
        self._finished = []
        step = (so.num_scheduled_tokens, so.scheduled_spec_decode_tokens or {})  # looked up once a step
        for r in so.scheduled_new_reqs:
            self._add(meta, step, r.req_id, r.num_computed_tokens, r.block_ids, resumed=True)
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        blocks = self._blocks()
        for i, rid in enumerate(cached.req_ids):
            self._add(meta, step, rid, cached.num_computed_tokens[i], blocks(rid), resumed=rid in resumed)
        return meta

    def _blocks(self) -> Callable[[str], Any]:
        """A running request's blocks per KV cache group, by its id: vLLM's own lists of its blocks
        where the manager exposes them (one lookup, no copy of the request's block ids each step),
        else its block ids."""
        m = self._kv_cache_manager
        if m is None:
            return lambda rid: ()
        get = getattr(getattr(m, "coordinator", None), "get_blocks", None)
        return get if get is not None else m.get_block_ids  # type: ignore[no-any-return]

    def _add(self, meta: CanaryMeta, step: tuple[Any, Any], rid: str, computed: int, block_ids: Any,
             resumed: bool) -> None:
        """One scheduled request's :class:`ReqStep` (``step``: the scheduler output's scheduled token
        counts and drafts, by request)."""
        req = self._reqs.get(rid)
        primary, bs = self.primary, self.block_size
        blocks = block_ids[primary] if len(block_ids) > primary else []
        if req is None or computed // bs >= len(blocks):
            return
        scheduled = int(step[0][rid])
        spec = step[1].get(rid)
        drafts = [int(t) for t in spec] if spec else []
        have = self._sent.get(rid, 0)
        known = req.all_token_ids
        upto = min(len(known), computed + scheduled)  # a token not yet sampled is not sent, never guessed
        tokens = list(known[have:upto]) if upto > have else []
        self._sent[rid] = max(have, upto)
        # a running request whose computed count went back (rejected drafts) rewrites those positions
        end = self._end.get(rid, 0)
        rollback = end if not resumed and computed < end else 0
        self._end[rid] = computed + scheduled
        first = _id(blocks[computed // bs]) * bs + computed % bs
        local = self._local.pop(rid, computed)  # below computed: another connector lands the rest
        rs = ReqStep(rid, computed, scheduled, first, have, tokens, drafts, rollback,
                     landed_from=local if local < computed else -1, prompt_len=len(req.prompt_token_ids or []))
        if self.ship_blocks:
            rs.blocks = [_id(b) for b in blocks[: -(-computed // bs)]]
            rs.private_from = self._private_from(rs.blocks)
        meta.reqs.append(rs)

    def _private_from(self, blocks: list[int]) -> int:
        """The index of the first of ``blocks`` that no other request holds (shared blocks come first:
        a request shares a prefix)."""
        pool = getattr(self._kv_cache_manager, "block_pool", None)
        if pool is None:
            return len(blocks)
        j = len(blocks)
        while j > 0 and pool.blocks[blocks[j - 1]].ref_cnt <= 1:
            j -= 1
        return j

    @timed
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        for d in (self._reqs, self._sent, self._local, self._end):
            d.pop(rid, None)
        self._finished.append(rid)
        return False, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])
