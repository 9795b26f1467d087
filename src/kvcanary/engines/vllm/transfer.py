"""The vLLM connector beside another connector that stores and loads KV (under vLLM's
MultiConnector): the canary's stamps travel with the stored KV (:mod:`kvcanary.stamp_store`), and
KV that lands is verified against them before any request reads it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from kvcanary.engines.base import hook
from kvcanary.engines.vllm.steps import Rows, positions_slots
from kvcanary.violations import Violation


class TransferSide:
    """The worker connector's hooks around another connector's stores and loads. The connector
    sets ``stamp_store`` (where stamps are kept beside stored KV; ``None``: nowhere), and has its
    forward's ``rows``, its ``groups`` and ``primary`` group, its token ``book`` and
    ``report_and_heal``."""

    stamp_store: str | None
    rows: Rows | None
    groups: list[Any]
    primary: int
    block_size: int
    book: Any
    meta: Any
    group: Callable[[int], Any]  # the connector's
    report_and_heal: Callable[[list[Violation]], None]

    def store_stamps(self) -> None:
        """Save the stamps of each new prompt's whole blocks (primary group) beside the KV another
        connector stores."""
        from kvcanary import stamp_store

        g = self.group(self.primary)
        if g is None or g.step is None or self.rows is None or not self.stamp_store:
            return
        bs = self.block_size
        for i, r in enumerate(self.rows.reqs):
            if r is None:
                continue
            n = (r.prompt_len - 1) // bs * bs  # what a prefix store keeps of it
            if r.computed or r.landed_from >= 0 or n <= 0 or r.scheduled < n:
                continue
            stamps = g.canary.export_stamps(positions_slots(g.step, i, 0, n, 0))
            if stamps is not None:
                stamp_store.save(self.stamp_store, self.book.window([r.req_id], [n], n)[0].tolist(), stamps,
                                 {n, (r.prompt_len - 2) // bs * bs})

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """After the other connectors of a MultiConnector landed their KV: install the stamps that
        travelled with it and verify every landed byte (a torn or wrong load is reported here)."""
        if self.rows is not None and any(r.landed_from >= 0 for r in self.meta.reqs):
            self.landed()

    @hook("the landing check")
    def landed(self) -> None:
        """The primary group installs the stamps that travelled with landed KV and verifies its
        bytes; the other groups had no stamps stored, so their landed slots become unknown."""
        from kvcanary import stamp_store

        assert self.rows is not None
        for i, r in enumerate(self.rows.reqs):
            if r is None or r.landed_from < 0:
                continue
            tokens = self.book.window([r.req_id], [r.computed], r.computed)[0].tolist()
            stamps = stamp_store.load(self.stamp_store, tokens) if self.stamp_store else None
            for g in self.groups:
                if g.step is None:
                    continue
                lo = max(r.landed_from, int(g.step.starts()[i]))
                slots = positions_slots(g.step, i, lo, r.computed, g.plan.block_size)
                if g.plan.index == self.primary and stamps is not None and lo == r.landed_from:
                    g.canary.import_stamps(slots, stamps[r.landed_from : r.computed])
                else:
                    g.canary.import_stamps(slots, None)
                self.report_and_heal([dataclasses.replace(v, request=r.req_id) for v in g.canary.drain()])

    def has_connector_metadata(self) -> bool:
        """``False``: vLLM asks this in every attention layer, and calls the per-layer load and save
        hooks below only where it is true. The canary has no per-layer load or save (its per-layer
        checks patch the attention itself, :mod:`kvcanary.engines.vllm.patch`), so the two calls a
        layer are left out; its metadata is bound as ever (:meth:`bind_connector_metadata`)."""
        return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None
