"""The write check and the read audit (:mod:`kvcanary.audit`) as every engine adapter runs them.

An engine's audit (``engines/<engine>/audit.py``) knows where a forward's tensors come from: which
layer's computed K and V, queries and outputs it is handed, and its attention's scale, window,
soft-cap and sinks. Everything else is here, once:

- planning a forward on the host: every new token's writes are checked, and the queries audited
  (:meth:`EngineAudit.sample`) are as many as the time budget allows, with more where a situation
  or a request is new (:mod:`kvcanary.audit.budget`);
- the torch reference for one layer, reading the cache through the layer's geometry
  (:meth:`EngineAudit.check_writes`, :meth:`EngineAudit.check_queries`);
- the compiled check of some layers in one call (:meth:`EngineAudit.run_compiled`), its tables
  built by :mod:`kvcanary.audit.tables`;
- the counts, the adapter's failures, and draining the results.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch

from kvcanary.audit.auditor import Auditor
from kvcanary.audit.budget import FOCUS, QueryBudget
from kvcanary.audit.records import ForwardAudit, LayerPlan, Query, Writes, to_device
from kvcanary.audit.reference import DTYPES, check_layer, write_mismatch
from kvcanary.audit.tables import PTR_K, QUERY_COLUMNS, layer_row
from kvcanary.geometry.base import KvGeometry
from kvcanary.violations import Violation

NO_TOKENS = np.zeros(0, dtype=np.int64)
NO_QUERIES = np.zeros((0, QUERY_COLUMNS), dtype=np.int64)
# a forward without queries shares these (of no length, never written): right after an engine's forward
# each numpy call costs tens of microseconds, which a forward the budget audits no query of need not pay
_NO_ERR, _NO_SHIFT, _NO_TOL = np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0)


class EngineAudit:
    """What both engine adapters' audits share. ``adapter``: the engine adapter (its ``config``, and
    its ``internal_errors`` and ``pending`` error where the audit fails); ``heads``: the model's
    query heads.

    Attributes
    ----------
    auditor : the rotation of sampled queries, the forwards not yet drained and the counts
    fa : this forward's audit while it runs (``None``: none)
    budget : the count of queries per forward (:class:`~kvcanary.audit.budget.QueryBudget`)
    write_tokens : this forward's batch tokens whose writes are checked (host), and ``write_index``
        the same on the pool's device
    spent : the audit's own seconds in this forward so far
    """

    def __init__(self, adapter: Any, heads: int) -> None:
        cfg = adapter.config
        self.adapter, self.config = adapter, cfg
        self.auditor = Auditor(cfg.audit_queries, cfg.audit_tolerance)
        self.write_check = cfg.write_check
        self.on = cfg.mode != "off" and (cfg.write_check or cfg.audit_queries > 0)
        self.heads = max(1, heads)
        self.fa: ForwardAudit | None = None
        self.write_tokens: np.ndarray | None = None
        self.write_index: torch.Tensor | None = None
        self.budget = QueryBudget(cfg.audit_queries, cfg.audit_budget)
        self.spent = 0.0
        self._opened = 0.0  # when this forward's audit was planned
        # the wall clock and the canary's seconds at the last forward's end; before the first, from here, so the
        # first forward is charged everything the canary did since it started (a new pool's setup, a prefill's
        # stamps: a hundredth of a short run on a trained model)
        self._last = (time.perf_counter(), float(getattr(self.adapter, "seconds", 0.0)))
        self._stage: dict[str, int] = {}  # request -> 1 after its first audited forward, 2 after its first decode
        self._tokens: tuple[np.ndarray, torch.Tensor] | None = None  # 0 .. n-1 on the host and the device, grown
        self._token_views: dict[int, tuple[np.ndarray, torch.Tensor]] = {}  # their first n, by n
        self._results: np.ndarray | None = None  # the one call's write-check results, reused (run_compiled)
        self.write_rows: bytes | None = None  # this forward's write-checked layer positions (1), None: every layer
        # seconds the adapter's per-layer direct paths spent in this forward, added up there in one list
        # (touching the audit and the adapter inside every layer costs more) and settled after it (settle)
        self.clock = [0.0]

    # ---- planning a forward (host) ------------------------------------------------------------

    def due(self, forwards: int) -> bool:
        """Whether the forward numbered ``forwards`` is audited (``audit_every``)."""
        return self.on and forwards % self.config.audit_every == 0

    def pick_writes(self, total: int, device: torch.device, layers: int = 0) -> None:
        """This forward's write-checked tokens, all ``total`` of them, and of its ``layers`` layers
        (positions in the adapter's order of them) those whose writes are checked
        (:meth:`~kvcanary.audit.budget.QueryBudget.write_layers`), as ``write_rows``: a byte per
        position, 1 where checked, or ``None`` for every layer; ``layers`` 0: every layer (an adapter
        that checks them all)."""
        self.write_tokens = self.write_index = None
        self.write_rows = None
        if not self.write_check or not total:
            return
        if layers:
            first, n = self.budget.write_layers(layers)
            if n < layers:
                rows = bytearray(layers)
                for i in range(first, first + n):
                    rows[i % layers] = 1
                self.write_rows = bytes(rows)
        have = self._tokens
        if have is None or len(have[0]) < total or have[1].device != device:  # made again only to grow
            toks = np.arange(max(total, 2 * len(have[0]) if have is not None else 0, 256))
            have = self._tokens = (toks, to_device(device, [toks])[0])
            self._token_views.clear()
        # views, read only by the checks: the same objects forward after forward of one size (a slice is
        # microseconds right after a forward, and a plan made for them is run again only on the same ones)
        views = self._token_views.get(total)
        if views is None:
            if len(self._token_views) >= 64:
                self._token_views.clear()
            views = self._token_views[total] = (have[0][:total], have[1][:total])
        self.write_tokens, self.write_index = views

    def sample(self, layers: Sequence[Hashable], lengths: np.ndarray | Sequence[int],
               starts: np.ndarray | Sequence[int], cached: np.ndarray | Sequence[int],
               layer_id: Callable[[Any], int], group_of: Callable[[Any], str | None],
               last_token: Callable[[Any], bool] = lambda layer: False, situation: Hashable = None,
               rids: Sequence[str] | None = None) -> list[Query]:
        """This forward's audited queries (:meth:`Auditor.pick`'s rotation over ``layers``, the rows
        with ``lengths`` new tokens from ``starts`` in the batch, after ``cached`` tokens, and the
        heads), as many as :attr:`budget` gives a forward in ``situation``, and :data:`FOCUS` more
        on each row of ``rids`` (the rows' requests) in a new situation of its own; ``layer_id``: a
        layer's number in the records; ``last_token``: a layer whose queries are its rows' last new
        tokens (a window group caches only a prefill's last ones). ``lengths``, ``starts`` and
        ``cached``: arrays or lists (an adapter that has the rows as Python ints passes lists: numpy
        is not called on a forward without queries)."""
        self._opened, self.spent = time.perf_counter(), 0.0
        count = self.budget.plan(situation)
        focus = self._focus(rids, lengths, cached) if rids is not None else []
        if count <= 0 and not focus:
            return []
        out = []
        lens = lengths.tolist() if isinstance(lengths, np.ndarray) else list(lengths)
        for li, r, off, head in self.auditor.pick(list(range(len(layers))), lens, self.heads, count, focus, FOCUS):
            layer = layers[li]
            if last_token(layer):
                off = int(lengths[r]) - 1
            out.append(Query(layer_id(layer), r, int(starts[r] + off), head, int(cached[r] + off), int(cached[r]),
                             group_of(layer)))
        return out

    def _focus(self, rids: Sequence[str], lengths: np.ndarray | Sequence[int],
               cached: np.ndarray | Sequence[int]) -> list[int]:
        """The rows whose request is in a new situation of its own: its first audited forward reads a
        prefix it did not write (``cached`` > 0: a prefix-cache hit), or it decodes (one new token)
        for the first time."""
        stage, out = self._stage, []
        for i, rid in enumerate(rids):
            if not rid or lengths[i] <= 0:
                continue
            st = stage.get(rid)
            if st is None:
                stage[rid] = 1
                if cached[i] > 0:
                    out.append(i)
            elif st == 1 and lengths[i] == 1:
                stage[rid] = 2
                out.append(i)
        if len(stage) > 4 * len(rids) + 4096:  # requests that left: forgotten (one that comes back gets a new focus)
            self._stage = {rid: stage[rid] for rid in rids if rid in stage}
        return out

    def start(self, step: int, starts: np.ndarray | Sequence[int], cached: np.ndarray | Sequence[int],
              slots: dict[str | None, torch.Tensor], queries: list[Query], device: torch.device,
              host: bool) -> ForwardAudit:
        """This forward's audit, its results on the host (``host``: the compiled loop fills them) or
        on ``device`` (the torch reference). ``starts`` and ``cached`` as :meth:`sample` takes them."""
        s = len(queries)
        err: Any
        shift: Any
        tol: Any
        if host and not s:
            err, shift, tol = _NO_ERR, _NO_SHIFT, _NO_TOL
        elif host:
            err, shift, tol = np.full(s, -1.0), np.zeros(s, dtype=np.int64), np.zeros(s)
        else:
            err, shift = torch.full((s,), -1.0, device=device), torch.zeros(s, dtype=torch.int64, device=device)
            tol = torch.zeros(s, device=device)
        self.fa = self.auditor.begin(ForwardAudit(step, starts, cached, slots, queries, err, shift, tol))
        return self.fa

    # ---- the torch reference, one layer --------------------------------------------------------

    def check_writes(self, layer: int, group: str | None, geometry: KvGeometry, slots: torch.Tensor,
                     src_k: torch.Tensor, src_v: torch.Tensor) -> None:
        """One layer's write check: ``slots`` (int ``[n]``, -1: none) the checked tokens' slots,
        ``src_k`` and ``src_v`` (``[n, Hkv, D]``) what the layer computed for them."""
        assert self.fa is not None and self.write_tokens is not None
        s = slots.clamp(min=0)
        half, head = write_mismatch(src_k, src_v, geometry.k_rows(s), geometry.v_rows(s))
        self.fa.writes.append(Writes([layer], [group], self.write_tokens, torch.where(slots >= 0, half, 0)[None],
                                     head[None]))
        self.count_writes(1, len(self.write_tokens), geometry.token_bytes)

    def check_queries(self, plan: LayerPlan, step: Any, geometry: KvGeometry, q: torch.Tensor, out: torch.Tensor,
                      group_size: int, scale: float, softcap: float | None, sinks: torch.Tensor | None,
                      tol: tuple[float, float]) -> None:
        """One layer's audited queries: ``q`` and ``out`` (``[S, D]``) the plan's queries and the
        engine's outputs for them, read against the cache at the slots of the verified ``step``;
        ``sinks`` (``[S]``) each query's head's sink logit."""
        assert self.fa is not None
        shape = plan.grid.shape
        slots = step.lookup(plan.row[:, None].expand(shape).reshape(-1), plan.grid.reshape(-1)).view(shape)
        kvh = (plan.head // group_size)[:, None].expand(shape)
        bs, limit = geometry.block_size, geometry.num_slots - 1

        def read(slots: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
            s = torch.where(plan.old, slots + shift * bs, slots).clamp(0, limit)
            return geometry.k_rows(s, kvh), geometry.v_rows(s, kvh)

        fa = self.fa
        if isinstance(fa.err, np.ndarray):  # results kept on the host: the torch reference writes through views
            fa = dataclasses.replace(fa, err=torch.from_numpy(fa.err), shift=torch.from_numpy(fa.shift),
                                     tol=torch.from_numpy(fa.tol))
        check_layer(fa, plan, slots, q, out, read, scale, softcap, sinks, tol)

    # ---- the compiled loop, some layers in one call -------------------------------------------

    def run_compiled(self, layers: np.ndarray, ptrs: np.ndarray, strides: np.ndarray, steps: np.ndarray,
                     qt: np.ndarray, fl: np.ndarray, gathered: bool, layer_ids: Sequence[int],
                     groups: Sequence[str | None], token_bytes: int, rows: list[int] | None = None) -> None:
        """The write checks of the layers with a computed K's address in ``ptrs`` and the queries of
        ``qt`` in one call of :func:`kvcanary.fused.audit.check_forward` (the tables:
        :mod:`kvcanary.audit.tables`); ``layer_ids`` and ``groups``: each table row's layer number
        and group in the records; ``rows``: the table rows with a K's address, in order (``None``:
        read from ``ptrs``)."""
        from kvcanary.fused.audit import check_forward

        fa = self.fa
        assert fa is not None
        toks = self.write_tokens if self.write_tokens is not None else NO_TOKENS
        shape = (layers.shape[0], len(toks))
        if self._results is None or self._results.shape[1:] != shape:
            self._results = np.zeros((2, *shape), dtype=np.int64)  # kept: each numpy call is dear after a forward
        half, head = self._results  # zeroed by the call
        differ = check_forward(layers, ptrs, strides, steps, toks, qt, fl, half, head, fa.err, fa.shift, fa.tol,
                               gathered)
        if rows is None:
            rows = [i for i, p in enumerate(ptrs[:, PTR_K].tolist()) if p]
        else:
            rows = sorted(rows)
        if rows:
            if differ:  # a record only where a write differs (the drain reads nothing else of it), of copies
                kept = rows if len(rows) < shape[0] else slice(None)
                fa.writes.append(Writes([layer_ids[i] for i in rows], [groups[i] for i in rows], toks,
                                        half[kept].copy(), head[kept].copy()))
            self.count_writes(len(rows), len(toks), token_bytes)

    @staticmethod
    def layer_row(geometry: KvGeometry, step: int, query_dtype: torch.dtype) -> list[int]:
        """A layer's row of the compiled loop's layer table (a strided geometry)."""
        descs = geometry.descriptors()
        assert descs is not None
        return layer_row(descs[0], descs[1], step, DTYPES.get(geometry.dtype, -1), geometry.element_size,
                         geometry.num_kv_heads, geometry.head_dim, geometry.num_slots - 1, DTYPES.get(query_dtype, -1))

    # ---- counts, failures, results --------------------------------------------------------------

    def count_writes(self, layers: int, tokens: int, token_bytes: int) -> None:
        c = self.auditor.counts
        c["write_slots_checked"] += layers * tokens
        c["write_bytes_checked"] += layers * tokens * token_bytes

    def unchecked_writes(self, layers: int, tokens: int) -> None:
        """``layers`` layers' writes of ``tokens`` new tokens left unchecked this forward by the budget."""
        self.auditor.counts["write_slots_unchecked"] += layers * tokens

    def failed(self, e: Exception) -> None:
        """The audit failed inside a forward: this forward's audit is dropped (no stamp depends on
        it), the failure counted or, in ``raise`` mode, raised."""
        self.fa = None
        self.settle()
        self.auditor.failed(self.adapter, e)

    def planned(self, t0: float) -> None:
        """The forward's audit planned (since ``t0``): the planning's seconds are the budget's too."""
        self.spent += time.perf_counter() - t0

    def settle(self) -> float:
        """The seconds the per-layer direct paths added to ``clock`` since the last call: charged as
        :meth:`charge` does (the adapter's canary time, and the budget's), and returned."""
        dt = self.clock[0]
        if dt:
            self.clock[0] = 0.0
            self.charge(dt)
        return dt

    def charge(self, seconds: float) -> None:
        """Seconds the audit spent inside the forward: the adapter's canary time, and the budget's."""
        self.adapter.seconds += seconds
        self.spent += seconds

    def end(self) -> None:
        """After the forward: the budget learns what the canary cost since the last forward's end (its
        every check, this forward's audit among them) against the wall time since then."""
        self.settle()
        now, canary = time.perf_counter(), float(getattr(self.adapter, "seconds", 0.0))
        if self.fa is not None and self._opened:  # an idle gap saves up at most one forward's share (the balance's bound)
            last = self._last
            self.budget.observe(len(self.fa.queries), self.spent, now - last[0], canary - last[1])
        self._last = (now, canary)
        self.fa = None
        self._opened = 0.0

    def drain(self) -> list[Violation]:
        """The violations the forwards' checks found (decoding their results is the budget's time too)."""
        t0 = time.perf_counter()
        try:
            return self.auditor.drain()
        finally:
            self.spent += time.perf_counter() - t0

    def counts(self) -> dict[str, int]:
        """The counters the metrics publish: queries audited, new tokens' layer writes checked (and
        their bytes) and left unchecked by the time budget."""
        return self.auditor.stats()

    def stats(self) -> dict[str, int]:
        return {**self.auditor.stats(), **self.budget.stats()}
