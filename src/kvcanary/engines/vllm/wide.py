"""One vLLM forward's write checks and read audit as one compiled call after it
(:class:`WideForward`), planned by :class:`~kvcanary.engines.vllm.audit.VllmAudit` where every
covered layer was seen before and the compiled loop reads it."""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from kvcanary.audit.records import Writes
from kvcanary.audit.tables import (L_ESIZE, PTR_O, PTR_Q, Q_LAYER, Q_LOCAL, S_O, S_Q, STRIDE_COLUMNS, query_table,
                                   strides)
from kvcanary.engines.audit import NO_QUERIES, NO_TOKENS
from kvcanary.engines.vllm.fold import Fold

NOTHING, KEEP, CHECK = 0, 1, 2  # what is left of a layer's checks after its attention (WideForward.before)
# a forward without audited queries: no copies, no pointers, no layer with queries (never written)
NO_KEPT = np.zeros((0, 2, 0), dtype=np.uint8)
NO_PTRS = np.zeros((0, 4), dtype=np.int64)
NO_LAYERS: frozenset[int] = frozenset()


class Planner(Protocol):
    """What a forward's one call reads of the audit that planned it
    (:class:`~kvcanary.engines.vllm.audit.VllmAudit`)."""

    groups: dict[str, Any]  # layer -> its KV cache group
    geometry: dict[str, Any]  # layer -> its cache's geometry
    index: dict[str, int]  # layer -> its number
    seen: dict[str, Any]  # layer -> what its checks take from its attention, once seen
    write_tokens: np.ndarray | None  # this forward's write-checked tokens
    fa: Any  # this forward's audit state
    one_call: int  # forwards checked in one call after them
    clock: list[float]  # the per-layer direct paths' seconds this forward (settled after it)

    def count_writes(self, layers: int, tokens: int, token_bytes: int) -> None: ...

    write_rows: bytes | None  # this forward's write-checked layer rows (1), None: every one

    def unchecked_writes(self, layers: int, tokens: int) -> None: ...


class WideBase:
    """What every forward of one set of live groups shares in :meth:`WideForward.plan`, made once:
    the covered layers' names and rows (``index``), their layer table and floats, each row's sliding
    window, the layers' statics by their name and by their number (each with its row) and the widest
    query row in bytes."""

    def __init__(self, names: list[str], table: np.ndarray, fl: np.ndarray, statics: list[Any],
                 windows: list[int | None], width: int, groups: list[str]) -> None:
        self.names, self.table, self.fl, self.windows, self.width = names, table, fl, windows, width
        self.index = {n: i for i, n in enumerate(names)}
        self.rows = {n: (i, c) for i, (n, c) in enumerate(zip(names, statics))}  # a layer's row and its statics
        self.by_layer: dict[Any, tuple[int, Any]] = {}  # the same by the layer's module, once seen by name
        self.plain_by_layer: dict[Any, int] = {}  # the plain rows' (below) layer modules, once seen: their row
        self.by_number = {c.number: (i, c) for i, c in enumerate(statics)}
        self.numbers = [c.number for c in statics]  # each row's layer number and group, for the records
        # the rows a forward's plain path may take (the attention patch's, kvcanary.engines.vllm.patch.install):
        # checked layers that write their own KV
        self.plain = bytes(int(c.checked and c.writes) for c in statics)
        self.groups = groups
        # the loops' strides (WideForward.st) by the first layer's K and V strides and dtypes and its query's
        # and output's (WideForward.before): the same every forward of one shape
        self.loop_strides: dict[tuple[Any, Any], np.ndarray] = {}
        from kvcanary.fused import keep  # numba: imported once the engine runs
        from kvcanary.fused._step import describe

        self.fused = keep  # the per-layer calls
        self.describe = describe  # a step's descriptor (WideForward.again, each forward)
        self._entry: tuple[Any, Any] = (None, None)

    def keep_layer(self) -> Any:
        """The per-layer call (:func:`kvcanary.fused.keep.keep_layer_at`) through its compiled entry
        (:func:`kvcanary.fused.keep.direct`), looked up each forward (a fault may replace it)."""
        fn = self.fused.keep_layer_at
        if self._entry[0] is not fn:
            self._entry = (fn, self.fused.direct(fn, self.fused.KEEP_LAYER_AT))
        return self._entry[1]


class WideForward:
    """One forward's checks as one compiled call after it (every covered layer seen before and
    read by the compiled loop): inside each layer only its write check and fold before its attention
    (:meth:`before`) and a copy of its audited queries' rows after it (:meth:`keep`), since the engine
    may reuse a layer's query, K, V and output memory in a later layer (a model compiled by
    torch.compile does, even while the tensors are referenced: what a layer computed is read inside
    it or copied); after the forward every layer's queries in one call of
    :func:`kvcanary.fused.audit.check_forward`."""

    def __init__(self, base: WideBase, steps: np.ndarray, qt: np.ndarray, fl: np.ndarray, toks: np.ndarray,
                 fold: Fold) -> None:
        names, width = base.names, base.width
        self.base, self.names, self.index, self.table = base, names, base.index, base.table
        self.steps, self.qt, self.fl = steps, qt, fl
        self.toks, self.fold = toks, fold
        self._fresh()
        # each numpy call costs microseconds right after the engine's matrix products: the write check's
        # two tables in one array, and the audited queries' copies and pointers only where there are some
        self.half, self.head = np.zeros((2, len(names), len(toks)), dtype=np.int64)
        self.kept = np.zeros((len(qt), 2, width), dtype=np.uint8) if len(qt) else NO_KEPT
        self.kept_at = self.kept.__array_interface__["data"][0]  # (ndarray.ctypes costs microseconds)
        self.plain_by_layer = base.plain_by_layer
        self.ptrs = np.zeros((len(names), 4), dtype=np.int64) if len(qt) else NO_PTRS
        self.audited = set(qt[:, Q_LAYER].tolist()) if len(qt) else NO_LAYERS  # the layer rows with queries
        for li in self.audited:
            self.open[li] = 0
        self.st = np.zeros(STRIDE_COLUMNS, dtype=np.int64)  # the layers' tensors' strides, from the first one's
        self.width = width
        self.audit: Any = None  # the audit that planned it (plan)
        self.by_layer = base.by_layer  # the layers seen, by their module (the attention patch's direct path)
        self.clock = [0.0]  # the seconds of the per-layer work, the audit's clock (plan)
        self.original: Callable[..., Any] | None = None  # the engine's attention (the patch's direct path, attend)
        self._tables()

    def _fresh(self) -> None:
        """The state one forward builds up, as it starts (:meth:`__init__`, and :meth:`again` for the
        next forward on this plan)."""
        self.write = False  # this forward checks writes (set by plan)
        self.checks = bytes(len(self.names))  # the layer rows whose writes it checks (set by plan)
        self.trusted = 0  # layers whose new tokens were folded from their computed rows unchecked
        self.differ = False  # a checked write differs (the per-layer call's count was not 0)
        self.md: Any = None  # the last metadata seen, and whether its attention is causal
        self.md_causal = True
        self.md_plain: Any = None  # the last metadata seen where it is causal (the plain path's)
        # the first layer's K and V strides and dtypes, once seen (the plain path's)
        self.kst: Any = None
        self.vst: Any = None
        self.kdt: Any = None
        self.vdt: Any = None
        # the rows the attention patch may take on the plain path from its first statement: plain rows
        # without audited queries (__init__ closes the audited ones), each until seen this forward
        # (Python's fewest steps: a layer's call runs 30 times a forward, where each object touched is
        # a cache miss)
        self.open = bytearray(self.base.plain)
        self.keep_layer = self.base.keep_layer()  # looked up each forward (a fault may replace them)
        self.keep_queries = self.base.fused.keep_queries
        self.wrote: list[int] = []
        self.shape: tuple[Any, ...] | None = None  # the first layer's K and V strides and dtypes
        self.qo_shape: tuple[Any, ...] | None = None  # and its query's and output's, and its heads
        self.seen = bytearray(len(self.names))  # the layer rows seen this forward (a second sight voids the folds)
        self.live = True  # until the audit withdraws it (the forward's end, or a failure of the canary's own)

    @classmethod
    def plan(cls, audit: Planner, live: list[Any], base: WideBase, queries: list[Any], fold: Fold) -> "WideForward":
        from kvcanary.fused._step import describe

        by_number = base.by_number
        picked = [i for i, q in enumerate(queries) if q.layer in by_number and by_number[q.layer][1].audited]
        mine = [queries[i] for i in picked]

        def sink(q: Any) -> float | None:
            c = by_number[q.layer][1]
            return None if c.sink_logits is None else float(c.sink_logits[q.head])

        if mine:
            qt, sinks = query_table(mine, lambda q: by_number[q.layer][0], lambda q: by_number[q.layer][1].rep,
                                    lambda q: base.windows[by_number[q.layer][0]], sink, len(base.fl), picked)
            qt[:, Q_LOCAL] = np.arange(len(qt))  # each query's row of the kept copies
        else:  # a forward the budget audits no query of: no table made (it is never written)
            qt, sinks = NO_QUERIES, []
        # the plan's own array (again() copies the next forward's descriptors into it)
        steps = describe(live[0].step)[None].copy() if len(live) == 1 else np.stack([describe(g.step) for g in live])
        toks = audit.write_tokens if audit.write_tokens is not None else NO_TOKENS
        fl = np.concatenate([base.fl, np.asarray(sinks, dtype=np.float64)]) if sinks else base.fl
        wide = cls(base, steps, qt, fl, toks, fold)
        wide._arm(audit)
        return wide

    def _arm(self, audit: Planner) -> None:
        """This forward's audit, its clock and its write-checked layer rows."""
        self.audit = audit
        self.clock = audit.clock
        self.write = audit.write_tokens is not None
        if self.write:
            rows, n = audit.write_rows, len(self.names)
            self.checks = rows if rows is not None and len(rows) == n else b"\x01" * n

    def reusable(self) -> bool:
        """Whether the next forward may run on this plan again (:meth:`again`): it audited no query,
        no checked write differed (no record holds its tables) and its folds stand."""
        return not len(self.qt) and not self.differ and not self.fold.voided

    def again(self, audit: Planner, live: list[Any], base: WideBase, fold_tokens: int) -> bool:
        """This plan made ready for the next forward over the same live groups (``live``), ``base``
        and ``fold_tokens`` new tokens, where that forward audits no query and checks the same
        tokens' writes (:meth:`reusable` held after the last one): its tables stay where they are, so
        the per-layer call's table of addresses is not made again; the steps' descriptors are copied
        into its own, the folds' sums zeroed, the per-forward state reset. ``False``, the plan left as
        it was: the forward differs from this plan's in something its tables are shaped by (its
        write-checked tokens: the same array, :meth:`~kvcanary.engines.audit.EngineAudit.pick_writes`
        hands out one per count)."""
        toks = audit.write_tokens if audit.write_tokens is not None else NO_TOKENS
        if base is not self.base or len(live) != len(self.steps) or fold_tokens != self.fold.acc.shape[1] \
                or toks is not self.toks:
            return False
        describe = base.describe
        for i, g in enumerate(live):
            self.steps[i] = describe(g.step)
        self.fold.reset()
        self._fresh()  # (no audited rows to close: a plan with queries is not run again)
        self._arm(audit)
        return True

    def before(self, got: tuple[int, Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md: Any,
               output: torch.Tensor | None) -> int:
        """Inside one layer, after its cache write and before its attention: its write check and its
        part of the new tokens' fingerprints (:func:`kvcanary.fused.keep.keep_layer`), while the rows
        just written are in the core's caches. Says what is left for after the attention: ``NOTHING``,
        ``KEEP`` (the layer's audited queries' rows, :meth:`keep`) or ``CHECK`` (a layer whose tensors
        differ from the forward's first in dtype, strides or heads, or without an output buffer, is
        checked as it goes, by the per-layer path). Makes as few tensor calls as it can: each costs
        a microsecond or so, 30 times a forward. ``got``: the layer's row and statics."""
        li, c = got
        if md is not self.md:  # a group's layers share one metadata object a forward: its checks once
            self.md, self.md_causal = md, getattr(md, "causal", True) and getattr(md, "dynamic_causal", None) is None
            self.md_plain = md if self.md_causal else None
        if not c.checked or not self.md_causal:
            return NOTHING
        if output is None:
            return CHECK
        audited = li in self.audited
        # the K and V the write check reads, and for a layer with audited queries the query and output
        # rows kept after its attention, as the forward's first layer's (the strides the loops take)
        kv = (key.stride(), value.stride(), key.dtype, value.dtype)
        if kv != self.shape or (audited and (query.stride(), output.stride(), output.shape[1:], query.dtype,
                                             output.dtype, c.heads) != self.qo_shape):
            if self.shape is None and key.dtype == value.dtype == query.dtype == output.dtype == c.dtype:
                self.shape = kv
                self.kst, self.vst, self.kdt, self.vdt = kv
                qo = self.qo_shape = (query.stride(), output.stride(), output.shape[1:], query.dtype, output.dtype,
                                      c.heads)
                # the loops' strides, made once per shape (the forwards after the first find them)
                st = self.base.loop_strides.get((kv, qo))
                if st is None:
                    out3 = output.view(output.shape[0], c.heads, -1)
                    st = self.base.loop_strides[(kv, qo)] = np.array(
                        strides(key, 0, 1, 2) + strides(value, 0, 1, 2) + strides(query, 0, 1, 2)
                        + strides(out3, 0, 1, 2), dtype=np.int64)
                self.st[:] = st
            else:
                return CHECK
        if self.seen[li]:  # a layer seen twice: the fold is off from here
            self.fold.void()
            self._tables()
        self.seen[li] = 1
        self.open[li] = 0
        # the layer's computed rows go in for its fold wherever it writes its own KV, checked or not
        if c.writes:
            self.keep_written(li, key, value)
        else:
            self.keep_layer(self.at_address, li, 0, 0, 0)
        return KEEP if audited else NOTHING

    def keep_written(self, li: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The per-layer call for the layer of row ``li``, which writes its own KV (``key``, ``value``:
        its computed rows): its write check where this forward checks that row, and its fold; what it
        found noted (a write that differs, the rows checked, the layers folded unchecked)."""
        check = self.checks[li] if self.write else 0
        if self.keep_layer(self.at_address, li, key.data_ptr(), value.data_ptr(), check):
            self.differ = True
        if check:
            self.wrote.append(li)
        elif self.write:
            self.trusted += 1

    def attend(self, got: tuple[int, Any], t0: float, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, kv_cache: torch.Tensor, md: Any, output: torch.Tensor) -> Any:
        """The attention patch's direct path for a layer the plan has seen off the plain path (which
        the patch runs itself: :func:`kvcanary.engines.vllm.patch.install`), ``got`` its row and
        statics, called as the engine usually calls it (an output buffer, no scales, no other
        arguments): through :meth:`before` to the engine's attention (``original``) and :meth:`keep`
        after it, as :func:`attend` does with fewer objects touched. The canary's seconds from ``t0``
        (the patch's first statement) are charged to ``clock``; a failure of the canary's own goes to
        the audit's ``failed``."""
        after = NOTHING
        try:
            after = self.before(got, query, key, value, md, output)
        except Exception as e:
            self.audit.failed(e)
        self.clock[0] += time.perf_counter() - t0
        out = self.original(impl, layer, query, key, value, kv_cache, md, output)  # type: ignore[misc]
        if after != NOTHING:
            _after(self.audit, self, got, after, impl, layer, query, key, value, kv_cache, md, output, out)
        return out

    def _tables(self) -> None:
        """The per-layer call's tables by address (:func:`kvcanary.fused.keep.keep_tables`): this
        forward's and the fold's current ones, held here with the array of their addresses."""
        self.at = self.base.fused.keep_tables(self.table, self.st, self.steps, self.toks, self.half, self.head,
                                              *self.fold.args)
        self.at_address = self.at.__array_interface__["data"][0]

    def keep(self, li: int, query: torch.Tensor, output: torch.Tensor) -> None:
        """After the attention of the layer of row ``li`` (:meth:`before` said ``KEEP``): its audited
        queries' rows copied (:func:`kvcanary.fused.keep.keep_queries`)."""
        self.keep_queries(self.table, li, query.data_ptr(), output.data_ptr(), self.st, self.qt, self.kept)
        self.ptrs[li, PTR_Q] = self.kept_at
        self.ptrs[li, PTR_O] = self.kept_at + self.width

    def finish(self, audit: Planner) -> None:
        """After the forward: every kept layer's queries in one compiled call, and the write checks'
        results recorded."""
        from kvcanary.fused.audit import check_forward

        fa = audit.fa
        assert fa is not None
        audit.one_call += 1
        if self.shape is not None and len(self.qt):
            st = self.st.copy()
            esz = self.table[0, L_ESIZE]  # the compiled layers' queries are in their cache's dtype
            st[S_Q:S_Q + 3] = (2 * self.width, 0, esz)
            st[S_O:S_O + 3] = (2 * self.width, 0, esz)
            none = np.zeros((len(self.names), 0), dtype=np.int64)
            check_forward(self.table, self.ptrs, st, self.steps, NO_TOKENS, self.qt, self.fl, none, none, fa.err,
                          fa.shift, fa.tol, True)
        rows = self.wrote
        # a record only where a write differs (the drain reads nothing else of it), as the per-layer calls counted
        if rows and self.differ:
            if len(rows) == len(self.names) and len(set(rows)) == len(rows):  # every row once: the arrays as they are
                b = self.base
                fa.writes.append(Writes(b.numbers, b.groups, self.toks, self.half, self.head))
            else:
                fa.writes.append(Writes([self.base.numbers[i] for i in rows], [self.base.groups[i] for i in rows],
                                        self.toks, self.half[rows], self.head[rows]))
        if rows:
            audit.count_writes(len(rows), len(self.toks), audit.geometry[self.names[rows[0]]].token_bytes)
        if self.trusted:
            audit.unchecked_writes(self.trusted, len(self.toks))


def attend(audit: Any, plan: WideForward | None, got: tuple[int, Any] | None, t0: float, original: Callable[..., Any],
           impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
           md: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
    """One covered layer's attention (``original``, the engine's) with ``audit``'s checks: with the
    forward's ``plan``, :meth:`WideForward.before` it and :meth:`WideForward.keep` after it (or the
    audit's per-layer check where the plan says ``CHECK``), ``got`` the layer's row and statics in the
    plan (``None``: a layer it does not check); without a plan, every check after the attention
    (the audit's ``check_layer``). The canary's seconds from ``t0`` (the attention patch's first
    statement) to the engine's attention are charged, and those after it. A failure of the canary's
    own goes to the audit's ``failed``, never into the engine."""
    after = CHECK if plan is None else NOTHING
    if plan is not None and got is not None:
        try:
            after = plan.before(got, query, key, value, md, output)
        except Exception as e:
            audit.failed(e)
    # charged on the plan's clock (the audit's, settled after the forward): this runs 30 times a forward,
    # where each object touched is a cache miss
    (plan.clock if plan is not None else audit.clock)[0] += time.perf_counter() - t0
    # the engine's extra arguments passed on only where it gave some (packing none costs, 30 times a forward)
    out = (original(impl, layer, query, key, value, kv_cache, md, output, *args, **kwargs) if args or kwargs
           else original(impl, layer, query, key, value, kv_cache, md, output))
    if after != NOTHING:
        _after(audit, plan, got, after, impl, layer, query, key, value, kv_cache, md, output, out)
    return out


def _after(audit: Any, plan: WideForward | None, got: tuple[int, Any] | None, after: int, impl: Any, layer: Any,
           query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, md: Any, output: Any,
           out: Any) -> None:
    """A layer's checks after its attention (``after``: :meth:`WideForward.before`'s ``KEEP`` or
    ``CHECK``), for :func:`attend` and :meth:`WideForward.attend`: its audited rows kept, or its
    per-layer check; their seconds on the plan's clock (else the audit's), a failure to ``failed``."""
    t0 = time.perf_counter()
    try:
        if after == KEEP:
            if plan is not None and plan.live and got is not None:
                plan.keep(got[0], query, output)
        else:
            audit.check_layer(impl, layer, query, key, value, kv_cache, md, out if out is not None else output)
    except Exception as e:
        audit.failed(e)
    (plan.clock if plan is not None else audit.clock)[0] += time.perf_counter() - t0
