"""The vLLM connector beside another connector that stores and loads KV (under vLLM's
MultiConnector): the canary's stamps travel with the stored KV (:mod:`kvcanary.stamp_store`), and
KV that lands is verified against them before any request reads it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvcanary.engines.vllm_steps import positions_slots

if TYPE_CHECKING:
    from kvcanary.engines.vllm import KvCanaryConnector


def store(conn: KvCanaryConnector) -> None:
    """Save the stamps of each new prompt's whole blocks (primary group) beside the KV another
    connector stores."""
    from kvcanary import stamp_store

    g = conn._group(conn.primary)
    if g is None or g.step is None or conn._rows is None or not conn.stamp_store:
        return
    bs = conn.block_size
    for i, r in enumerate(conn._rows.reqs):
        if r is None:
            continue
        n = (r.prompt_len - 1) // bs * bs  # what a prefix store keeps of it
        if r.computed or r.landed_from >= 0 or n <= 0 or r.scheduled < n:
            continue
        stamps = g.canary.export_stamps(positions_slots(g.step, i, 0, n, 0))
        if stamps is not None:
            stamp_store.save(conn.stamp_store, conn.book.window([r.req_id], [n], n)[0].tolist(), stamps,
                             {n, (r.prompt_len - 2) // bs * bs})


def landed(conn: KvCanaryConnector) -> None:
    """The primary group installs the stamps that travelled with landed KV and verifies its
    bytes; the other groups had no stamps stored, so their landed slots become unknown."""
    from kvcanary import stamp_store

    assert conn._rows is not None
    for i, r in enumerate(conn._rows.reqs):
        if r is None or r.landed_from < 0:
            continue
        tokens = conn.book.window([r.req_id], [r.computed], r.computed)[0].tolist()
        stamps = stamp_store.load(conn.stamp_store, tokens) if conn.stamp_store else None
        for g in conn.groups:
            if g.step is None:
                continue
            lo = max(r.landed_from, int(g.step.starts()[i]))
            slots = positions_slots(g.step, i, lo, r.computed, g.plan.block_size)
            if g.plan.index == conn.primary and stamps is not None and lo == r.landed_from:
                g.canary.import_stamps(slots, stamps[r.landed_from : r.computed])
            else:
                g.canary.import_stamps(slots, None)
            conn.report_and_heal([dataclasses.replace(v, request=r.req_id) for v in g.canary.drain()])
