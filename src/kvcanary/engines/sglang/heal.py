"""What SGLang's scheduler does with a forward's violations: ``repair``, ``quarantine`` and
``raise`` through SGLang's own retraction and abort paths.

After a forward (the model runner's hook), :meth:`Heal.forward` names the requests of the forward
that read corrupted KV (each violation's request; for a record of no request, such as the patrol's
or a guard's, every row whose table holds its slot; and every row that reads a slot found with
wrong bytes before, see below) and decides for each:

- ``repair``: computed again. When the scheduler processes the forward's results
  (:meth:`Heal.settle`, around ``Scheduler.process_batch_result``), the request is retracted the
  way SGLang retracts a decode under memory pressure while a forward is in flight: the token this
  forward sampled from bad KV is dropped (SGLang's own skip of a request retracted mid-forward),
  its KV is released without entering the radix cache, and it goes back to the waiting queue,
  where it is prefilled again from ``origin_input_ids + output_ids`` and finishes with the output a
  clean run gives. After ``repair_limit`` repairs of one request it fails instead, with the
  evidence.
- ``quarantine``: failed the same way, with its output so far and ``finish_reason`` ``abort``
  carrying the evidence; no token computed from corrupted KV reaches it.

A slot a violation names (its bytes or stamp are not what the reader's table expects) is
**poisoned** until the engine frees it: after the retractions the radix cache gives up unlocked
entries, least recently used first, until no poisoned slot is left in it (SGLang's tree offers no
eviction of one chosen entry, so this can empty the cache's evictable part: a one-time cost per
corruption found). Where the slot's bytes are wrong or gone (a content or write-check mismatch, a
released slot), every request whose row holds it is hurt in every forward that reads it, not only
the one the violation names. So a repaired request never reads the corrupted KV again.

``raise``: every request of the forward fails with status 500 (:func:`fail_all`), so that each
caller's ``generate`` raises in its own thread with the canary's error (SGLang answers a scheduler
that raises by killing its whole process tree, the caller's included, so the canary never raises
there).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

import torch

from kvcanary.step import Step
from kvcanary.violations import Check, Violation

log = logging.getLogger("kvcanary")
HEAL_MODES = ("quarantine", "repair")
ERROR_TYPE = "KvCorruptionError"
REDO, FAIL = "redo", "fail"
# a slot named with these holds wrong bytes (or none): whoever reads it is hurt, not only the reader
# named (a wrong position, link or token may be the reader's table entry, not the slot)
SPOILED = Check.CONTENT | Check.WRITE_CONTENT | Check.EMPTY
EVICT_FIRST = 16  # tokens the first eviction round asks the radix cache for (doubling each round)


class Heal:
    """The healing state of the adapter in one scheduler process.

    Attributes
    ----------
    mode : ``quarantine`` or ``repair``
    limit : repairs of one request after which it fails
    due : request id -> (``"redo"`` or ``"fail"``, the evidence), at the coming result processing
    poisoned : slots a violation named, until the engine frees them (evicted from the radix cache)
    spoiled : the poisoned slots whose bytes are wrong or gone (:data:`SPOILED`): every reader is hurt
    failed : request id -> the evidence it failed with
    """

    def __init__(self, mode: str, limit: int) -> None:
        self.mode, self.limit = mode, limit
        self.due: dict[str, tuple[str, str]] = {}
        self.repairs: dict[str, int] = {}
        self.poisoned: set[int] = set()
        self.spoiled: set[int] = set()  # poisoned slots whose bytes are wrong (or gone): every reader is hurt
        self.failed: dict[str, str] = {}
        self.counts = {"repairs": 0, "requests_failed": 0, "slots_poisoned": 0, "cache_evictions": 0}

    # ---- after a forward (model runner) ---------------------------------------------------------

    def forward(self, found: Sequence[Violation], step: Step | None, rids: Sequence[str]) -> None:
        """Take one forward's violations: poison the slots they name, and decide what happens to
        every request of the forward that read corrupted KV."""
        for v in found:
            if v.slot > 0 and not v.checks & Check.BAD_SLOT and v.checks & ~Check.ATTENTION:
                if v.slot not in self.poisoned:
                    self.counts["slots_poisoned"] += 1
                self.poisoned.add(v.slot)
                if v.checks & SPOILED:
                    self.spoiled.add(v.slot)
        why = reasons(found, step, rids, self.spoiled)
        for rid, text in why.items():
            if rid in self.due or rid in self.failed:
                continue
            if self.mode == "repair":
                n = self.repairs[rid] = self.repairs.get(rid, 0) + 1
                if n <= self.limit:
                    self.due[rid] = (REDO, text)
                    continue
                text = f"request {rid} read corrupted KV again after {self.limit} repairs: {text}"
            self.due[rid] = (FAIL, text)

    def freed(self, slots: torch.Tensor) -> None:
        """The engine freed ``slots``: they are no longer poisoned."""
        if self.poisoned:
            gone = slots.tolist()
            self.poisoned.difference_update(gone)
            self.spoiled.difference_update(gone)

    def clear(self) -> None:
        """The engine reset its pool."""
        self.poisoned.clear()
        self.spoiled.clear()

    # ---- when the scheduler processes the forward's results ------------------------------------

    def settle(self, sched: Any, batch: Any, process: Callable[[], Any]) -> Any:
        """Run SGLang's processing of ``batch``'s results (``process``) with the due requests'
        outputs dropped, then retract (``repair``) or fail them, and evict poisoned slots from the
        radix cache; returns what ``process`` returned."""
        mine = [(req, *self.due.pop(req.rid)) for req in (batch.reqs or []) if req.rid in self.due]
        # a request finished, or being aborted by its client, ends as SGLang ends it
        mine = [(req, act, why) for req, act, why in mine if not req.finished() and req.to_finish is None]
        if not mine:
            out = process()
            self.evict(sched.tree_cache)
            return out
        for req, _, _ in mine:
            req.is_retracted = True  # SGLang skips the output of a request retracted while its forward ran
        proc = sched.batch_result_processor
        overlap = proc.enable_overlap
        if batch.forward_mode.is_decode():  # the decode path takes that skip only under its overlap scheduler
            object.__setattr__(proc, "enable_overlap", True)  # (a frozen dataclass)
        try:
            out = process()
        finally:
            object.__setattr__(proc, "enable_overlap", overlap)
        gone = {id(req) for req, _, _ in mine}
        batch.filter_batch(keep_indices=[i for i, r in enumerate(batch.reqs) if id(r) not in gone])
        for req, act, why in mine:
            self._settle_one(sched, req, act, why)
        self.evict(sched.tree_cache)
        return out

    def _settle_one(self, sched: Any, req: Any, act: str, why: str) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, release_req

        if sched.chunked_req is req:
            sched.chunked_req = None
        release_req(req=req, remaing_req_count=0, req_to_token_pool=sched.req_to_token_pool,
                    token_to_kv_pool_allocator=sched.token_to_kv_pool_allocator, tree_cache=sched.tree_cache,
                    hisparse_coordinator=getattr(sched, "hisparse_coordinator", None), offload_kv=False)
        if act == REDO:
            self.counts["repairs"] += 1
            log.warning("kvcanary: computing request %s again: %s", req.rid, why)
            sched._add_request_to_queue(req, is_retracted=True)
            return
        from sglang.srt.managers.scheduler import _make_abort_req

        self.counts["requests_failed"] += 1
        self.failed[str(req.rid)] = why
        log.error("kvcanary: failing request %s: %s", req.rid, why)
        req.to_finish = FINISH_ABORT(f"kvcanary: {why}", None, ERROR_TYPE)
        sched.send_abort_output(_make_abort_req(req, finished_reason=req.to_finish.to_json()), req)

    def evict(self, tree_cache: Any) -> None:
        """Evict unlocked radix-cache entries, least recently used first, until no poisoned slot is
        left in the cache or nothing more can be evicted (freed slots leave :attr:`poisoned`
        through :meth:`freed`)."""
        if not self.poisoned or tree_cache is None:
            return
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        ask = EVICT_FIRST
        while self.poisoned:
            room = int(tree_cache.evictable_size())
            if room <= 0:
                break
            self.counts["cache_evictions"] += 1
            tree_cache.evict(EvictParams(num_tokens=min(ask, room)))
            ask *= 2

    def forget(self, rid: str) -> None:
        """Request ``rid`` left its row for good (finished or failed)."""
        self.repairs.pop(rid, None)
        self.due.pop(rid, None)


def reasons(found: Iterable[Violation], step: Step | None, rids: Sequence[str],
            poisoned: Iterable[int] = ()) -> dict[str, str]:
    """The requests of this forward that read corrupted KV, each with the evidence: each record's
    request; for a record of no request (the patrol's, a guard's), every row whose table holds its
    slot; and every row whose table holds a ``poisoned`` slot (at the positions it reads or writes
    this forward)."""
    out: dict[str, str] = {}
    unnamed: list[Violation] = []
    for v in found:
        if v.request:
            out.setdefault(v.request, v.describe())
        elif v.slot >= 0:
            unnamed.append(v)
    if step is None or step.slot_table is None:
        return out
    for v in unnamed:
        for r in holders(step, torch.tensor([v.slot], dtype=torch.int64)):
            if rids[r]:
                out.setdefault(rids[r], f"request {rids[r]} reads a slot where {v.describe()}")
    bad = sorted(poisoned)
    if bad:
        for r in holders(step, torch.tensor(bad, dtype=torch.int64)):
            if rids[r]:
                out.setdefault(rids[r], f"request {rids[r]} reads a slot found corrupted in an earlier forward")
    return out


def holders(step: Step, slots: torch.Tensor) -> list[int]:
    """The rows of ``step`` whose table holds one of ``slots`` among the positions it reaches."""
    assert step.slot_table is not None
    rows = step.table_rows.long() if step.table_rows is not None else torch.arange(step.num_rows)
    ends = step.cached_lens.long() + (step.new_offsets[1:] - step.new_offsets[:-1]).long()
    width = max(1, int(ends.max()) if ends.numel() else 1)
    table = step.slot_table[rows, :width].long()
    inside = torch.arange(width)[None, :] < ends[:, None]
    hit = (torch.isin(table, slots) & inside).any(dim=1)
    return [int(r) for r in hit.nonzero().flatten()]


def fail_all(reqs: Sequence[Any], message: str, status_code: int | None) -> list[str]:
    """``raise`` mode: mark every request of ``reqs`` to finish with an abort carrying ``message``
    (SGLang's own ``to_finish``); returns the ids marked."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    marked = []
    for req in reqs:
        if not req.finished():
            req.to_finish = FINISH_ABORT(message, status_code, ERROR_TYPE)
            marked.append(str(req.rid))
    return marked
