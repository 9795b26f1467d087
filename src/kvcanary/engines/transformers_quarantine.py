"""Quarantine for transformers continuous batching: fail the requests that read corrupted KV,
keep every other request going, and keep the corrupted blocks out of the prefix cache.

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

    def mark(self, found: list[Violation]) -> None:
        """Mark the readers named by ``found`` to fail; drop the blocks involved from the prefix cache."""
        by_rid: dict[str, list[Violation]] = {}
        for v in found:
            if v.request is not None:
                by_rid.setdefault(v.request, []).append(v)
            g = self.prot.groups.get(v.group or "")
            if g is None or v.checks & Check.BAD_SLOT or not 0 <= v.slot < g.canary.num_slots:
                continue
            block = v.slot // g.tpp
            drop_from_prefix_cache(g.allocator, block)
            if v.checks & Check.CONTENT:  # its bytes are bad: every holder reads them
                self.poisoned.setdefault(g.name, set()).add(block)
        for rid, vs in by_rid.items():
            self.failed.setdefault(rid, KvCorruptionError(vs))
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
                if rid not in self.failed and not blocks.isdisjoint(table):
                    self.failed[rid] = KvCorruptionError([], message=(
                        f"request {rid} holds KV block(s) {sorted(blocks.intersection(table))} of group {name} "
                        f"whose bytes changed after they were written"))
                    self._due.add(rid)
        out = {rid: self.failed[rid] for rid in self._due}
        self._due.clear()
        return out

    def around_update(self, processor: Any, update: Callable[[Any], None]) -> None:
        """Run the engine's batch update with the results of marked requests held back, then fail
        the requests that are due."""
        from transformers.generation.continuous_batching.requests import RequestStatus

        router = processor.output_router
        kept: dict[str, Any] = {}
        deliver, deliver_batch = router.deliver, router.deliver_batch

        def hold(outs: list) -> list:
            kept.update((o.request_id, o) for o in outs if o.request_id in self.failed)
            return [o for o in outs if o.request_id not in self.failed]

        router.deliver = lambda out: [deliver(o) for o in hold([out])]
        router.deliver_batch = lambda outs: deliver_batch(hold(outs))
        try:
            update(processor)
        finally:
            router.deliver, router.deliver_batch = deliver, deliver_batch
        due = self.due()
        for rid, out in kept.items():  # finished in this update: its result is replaced by the failure
            if rid in due and rid not in processor.scheduler.active_requests:
                out.status, out.error = RequestStatus.FAILED, str(due[rid])
                deliver(out)
        fail_requests(processor, due)


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
