"""Quarantine and repair for transformers continuous batching: fail (``quarantine``) or compute
again (``repair``) the requests that read corrupted KV, keep every other request going, and keep
the corrupted blocks out of the prefix cache.

``repair`` re-queues each request that read corrupted KV as the engine's own soft reset does under
memory pressure: the token its forward sampled from bad KV is dropped, its blocks are freed without
entering the prefix cache, and an equivalent request (prompt plus the tokens generated before)
computes everything again; it finishes with the output a clean run gives. After ``repair_limit``
repairs of one request (corruption that recomputing does not fix), it fails as in quarantine.

After each forward, the protection's poll hands the drained violations to :meth:`Quarantine.mark`:
the requests they name are marked to fail, the blocks they name leave the prefix cache, and a
block whose bytes changed is poisoned. Around the batch update that follows,
:meth:`Quarantine.around_update` holds back the results of marked requests (computed from bad
KV), then fails them the way the engine fails a request, together with every live request that
holds a poisoned block (its next forward would read it). A poisoned block stops being one when
the engine frees it.
"""

from __future__ import annotations

from typing import Any, Callable

from kvcanary.errors import KvCorruptionError
from kvcanary.violations import Check, Violation


class Quarantine:
    """The quarantine state of one protection.

    Attributes
    ----------
    failed : request id -> the :class:`KvCorruptionError` it failed (or is about to fail) with
    poisoned : layer group -> blocks whose bytes changed after they were written
    """

    def __init__(self, prot: Any) -> None:
        self.prot = prot
        self.failed: dict[str, KvCorruptionError] = {}
        self.poisoned: dict[str, set[int]] = {}
        self._due: set[str] = set()
        self.repair = prot.config.mode == "repair"
        self.repairs: dict[str, int] = {}  # request id -> times it was computed again
        self.repaired = 0  # repairs made
        self._redo: set[str] = set()  # requests to compute again at the coming batch update

    def mark(self, found: list[Violation]) -> None:
        """Mark the readers named by ``found`` to fail; drop the blocks involved from the prefix cache."""
        by_rid: dict[str, list[Violation]] = {}
        for v in found:
            if v.request is not None:
                by_rid.setdefault(v.request, []).append(v)
            g = self.prot.groups.get(v.group or "")
            if g is None or v.checks & Check.BAD_SLOT or not 0 <= v.slot < g.canary.num_slots:
                continue
            block = g.block_of(v.slot)
            drop_from_prefix_cache(g.allocator, block)
            if v.checks & (Check.CONTENT | Check.WRITE_CONTENT):  # its bytes are bad: every holder reads them
                self.poisoned.setdefault(g.name, set()).add(block)
        for rid, vs in by_rid.items():
            self._hurt(rid, KvCorruptionError(vs))

    def _hurt(self, rid: str, err: KvCorruptionError) -> None:
        """Request ``rid`` read corrupted KV: compute it again (repair, within the limit) or fail it."""
        if rid in self.failed:
            return
        if self.repair and self.repairs.get(rid, 0) < self.prot.config.repair_limit:
            if rid not in self._redo:
                self.repairs[rid] = self.repairs.get(rid, 0) + 1
                self._redo.add(rid)
            return
        if self.repair:
            err = KvCorruptionError(err.violations, message=f"request {rid} read corrupted KV again after "
                                    f"{self.prot.config.repair_limit} repairs: {err}")
        self.failed[rid] = err
        self._due.add(rid)

    def freed(self, group: str, blocks: list[int]) -> None:
        """The engine freed ``blocks``: their next owner writes them anew."""
        self.poisoned.get(group, set()).difference_update(blocks)

    def due(self) -> dict[str, KvCorruptionError]:
        """Requests to fail now: the marked ones, and every live holder of a poisoned block."""
        for name, blocks in self.poisoned.items():
            g = self.prot.groups.get(name)
            if g is None or not blocks:
                continue
            for rid, table in g.allocator.block_table.items():
                if rid not in self.failed and rid not in self._redo and not blocks.isdisjoint(table):
                    self._hurt(rid, KvCorruptionError([], message=(
                        f"request {rid} holds KV block(s) {sorted(blocks.intersection(table))} of group {name} "
                        f"whose bytes changed after they were written")))
        out = {rid: self.failed[rid] for rid in self._due}
        self._due.clear()
        return out

    def around_update(self, processor: Any, update: Callable[[Any], None]) -> None:
        """Run the engine's batch update with the results of marked requests held back, then fail
        the requests that are due and compute again the ones to repair."""
        from transformers.generation.continuous_batching.requests import RequestStatus

        sched = processor.scheduler
        due = self.due()  # the marked readers, and every live holder of a poisoned block: its forward read it
        # the requests to repair as they were before this update (it may add a token from bad KV)
        before = {rid: (st, len(st.generated_tokens)) for rid in self._redo
                  if (st := sched.active_requests.get(rid) or sched.waiting_requests.get(rid)) is not None}
        router = processor.output_router
        kept: dict[str, Any] = {}
        deliver, deliver_batch = router.deliver, router.deliver_batch

        def hold(outs: list) -> list:
            held = self.failed.keys() | self._redo
            kept.update((o.request_id, o) for o in outs if o.request_id in held)
            return [o for o in outs if o.request_id not in held]

        router.deliver = lambda out: [deliver(o) for o in hold([out])]
        router.deliver_batch = lambda outs: deliver_batch(hold(outs))
        try:
            update(processor)
        finally:
            router.deliver, router.deliver_batch = deliver, deliver_batch
        for rid, out in kept.items():  # finished in this update: its result is replaced by the failure
            if rid in due and rid not in sched.active_requests:
                out.status, out.error = RequestStatus.FAILED, str(due[rid])
                deliver(out)
        fail_requests(processor, due)
        redo, self._redo = self._redo, set()
        for rid in redo:
            if rid in before:
                requeue(processor, *before[rid])
                self.repaired += 1


def requeue(processor: Any, state: Any, generated: int) -> None:
    """Compute ``state``'s request again from the start, as the engine's soft reset does: its
    tokens after the first ``generated`` (sampled from bad KV) are dropped, its blocks are freed
    without entering the prefix cache, an equivalent request waits to be scheduled."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    rid = state.request_id
    del state.generated_tokens[generated:]
    if state.logprobs is not None and len(state.logprobs) > generated:
        del state.logprobs[generated:]
    new_state = state.create_equivalent_initial_request()
    state._status = RequestStatus.FINISHED  # bypasses the setter's lifespan bookkeeping, as the soft reset does
    processor.cache.free_blocks(rid, no_cache=True)
    sched = processor.scheduler
    sched.finish_request(rid)
    if rid in sched.waiting_requests:
        sched.waiting_requests.pop(rid)
        if rid in sched.waiting_requests_order:
            sched.waiting_requests_order.remove(rid)
    sched.add_waiting_request(new_state)


def drop_from_prefix_cache(allocator: Any, block: int) -> None:
    """Forget ``block``'s content hash so no later request's prefix matches it; an unreferenced
    cached block goes back to the free pool."""
    ledger = allocator.ledger
    h = ledger.block_to_hash.pop(block, None)
    if h is not None and ledger.hash_to_block.get(h) == block:
        del ledger.hash_to_block[h]
    if block in ledger.cached_blocks:
        del ledger.cached_blocks[block]
        allocator.pool.free_blocks(allocator.index, [block])


def fail_requests(processor: Any, due: dict[str, KvCorruptionError]) -> None:
    """Fail the live requests in ``due`` (request id -> error) the way the engine fails a request."""
    sched = processor.scheduler
    for rid, err in due.items():
        state = sched.active_requests.get(rid) or sched.waiting_requests.get(rid)
        if state is None:
            continue
        processor._handle_request_error(err, state)
        if rid in sched.waiting_requests:
            sched.waiting_requests.pop(rid)
            if rid in sched.waiting_requests_order:
                sched.waiting_requests_order.remove(rid)
        sched.finish_request(rid)
