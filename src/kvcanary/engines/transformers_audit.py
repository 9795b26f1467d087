"""transformers continuous batching: the write check and the read audit (:mod:`kvcanary.audit`)
inside each protected forward.

Two class-level patches feed it: the paged cache's ``update`` (each layer's computed K and V,
before the cache write) and the attention function the model looks up (each layer's query and
attention output, after the cache was written and read). Each layer's computed K and V are
compared with the cache rows at their new tokens' slots, and the forward's sampled queries are
recomputed from the cache at the slots of their group's verified step table, with the module's own
scale, window, sinks and soft-capping (where the attention implementation applies them:
transformers' ``sdpa`` and ``paged|eager`` kernels leave Gemma2's logit soft-capping out, and
``sdpa`` leaves attention sinks out, which is said once).

On a CPU pool (the fused backend) both checks run in compiled loops (:mod:`kvcanary.fused.audit`):
a decode-sized forward keeps references to each layer's tensors and checks every layer in two
calls after the forward; a larger one checks each layer's writes as it goes and keeps only the
sampled queries' rows. Elsewhere the torch reference runs each layer's checks as it goes.

The decode fast path (flash attention reading through a block table, on GPUs) is not audited yet:
its forwards are counted apart (``audit_forwards_skipped``) and said once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from kvcanary.audit import (DTYPES, Auditor, ForwardAudit, LayerPlan, Query, Writes, cache_desc, check_layer, plan_layers,
                            rows_desc, to_device, write_mismatch)

log = logging.getLogger("kvcanary")
Tap = Callable[..., Any]
DEFER_TOKENS = 256  # forwards of at most this many new tokens are checked after the forward, from references


class CbAudit:
    """The write check and read audit of one :class:`~kvcanary.engines.transformers.Protection`.

    ``taps`` (fault injection only): ``"update"`` wraps the cache update as
    ``tap(original, cache, key, value, layer_idx, kwargs)`` and ``"attention"`` the attention
    function as ``tap(original, module, query, key, value, mask, *args, **kwargs)``.
    """

    def __init__(self, prot: Any) -> None:
        cfg = prot.config
        self.prot = prot
        self.auditor = Auditor(cfg.audit_queries, cfg.audit_tolerance)
        self.write_check = cfg.write_check
        self.on = cfg.mode != "off" and (cfg.write_check or cfg.audit_queries > 0)
        self.fa: ForwardAudit | None = None
        self.steps: dict[str, Any] = {}
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> its computed K and V
        self.qstash: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}  # layer -> query, output, gathered
        self.layer_group: dict[int, Any] = {}
        self.plans: dict[int, LayerPlan] = {}
        self.modules: dict[int, Any] = {}  # layer index -> its attention module
        self.write_tokens: tuple[np.ndarray, Any] | None = None
        self.taps: dict[str, Tap] = {}
        self.skipped = 0  # forwards of the decode fast path, not audited
        self.failed = 0  # forwards whose audit failed (an internal error, counted)
        self._wturn = 0
        self._said: set[str] = set()
        self._layers: dict[int, _LayerInfo] = {}
        self._windows: dict[int, int | None] = {}
        self._fused = False  # the compiled loops run the checks (a CPU pool on the fused backend)
        self._deferred = False  # this forward is checked after it, from references to its tensors
        self._order: list[int] = []  # the layers, in the order the rotation walks them
        self._heads = 1
        self._dev = torch.device("cpu")
        self._budget: int | None = None
        self._qt: np.ndarray | None = None  # this forward's audited queries (fused: the compiled loops' table)
        self._qlayers: list[int] = []  # the layers with audited queries, in the table's order
        self._wplans: dict[tuple[int, ...], Any] = {}  # layers -> the compiled write check's constant arrays

    # ---- per forward ----------------------------------------------------------------------------

    def groups_changed(self, groups: dict[str, Any]) -> None:
        self.layer_group = {layer: g for g in groups.values() for layer in g.allocator.layer_indices}
        self._layers = {layer: _LayerInfo(self, layer, self.modules[layer], g)
                        for layer, g in self.layer_group.items() if layer in self.modules}
        self._wplans.clear()
        self._windows = {layer: self.window(layer) for layer in self.layer_group}
        self._fused = bool(groups) and all(g.canary.backend == "fused" for g in groups.values())
        self._order = sorted(self._layers)
        self._heads = int(self.prot.model.config.num_attention_heads)
        if groups:
            self._dev = next(iter(groups.values())).canary.device
            budget = self.prot.config.budget_for(self._dev.type)
            row = max(g.canary.layout.sources[0].row_bytes * 2 for g in groups.values())
            # tokens whose K and V rows of every layer fit the content budget
            self._budget = None if budget is None else budget // (row * max(1, len(self._order)))

    def begin(self, steps: dict[str, Any], reqs: list, batch: dict) -> None:
        """Plan this forward's write checks and audited queries (host work from the requests' lengths)."""
        self.fa, self.plans, self.write_tokens, self._qt = None, {}, None, None
        self.stash.clear()
        self.qstash.clear()
        if not self.on or not steps or not self._order:
            return
        if batch.get("block_table") is not None:
            self.skipped += 1
            self._say("fast_path", "kvcanary: the decode fast path (attention through a block table) is not audited; "
                      "its forwards are counted as audit_forwards_skipped")
            return
        q = np.fromiter((fs.query_length for fs in reqs), dtype=np.int64, count=len(reqs))
        past = np.fromiter((fs.state.position_offset for fs in reqs), dtype=np.int64, count=len(reqs)) - q
        cu = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        total = int(cu[-1])
        self.steps = steps
        self._deferred = self._fused and total <= DEFER_TOKENS
        queries = []
        for layer, r, off, head in self.auditor.pick(self._order, q.tolist(), self._heads):
            if self._windows.get(layer) is not None:
                off = int(q[r]) - 1  # a window group caches only a prefill's last tokens: the last one's reads
            queries.append(Query(layer, r, int(cu[r] + off), head, int(past[r] + off), int(past[r]),
                                 self.layer_group[layer].name))
        s = len(queries)
        if self._fused:
            self._plan_fused(queries)
            err, shift, tol = np.full(s, -1.0), np.zeros(s, dtype=np.int64), np.zeros(s)
        else:
            self.plans = plan_layers(queries, self._windows, self._dev)
            err, shift, tol = (torch.full((s,), -1.0, device=self._dev), torch.zeros(s, dtype=torch.int64, device=self._dev),
                               torch.zeros(s, device=self._dev))
        self.fa = self.auditor.begin(ForwardAudit(
            self.prot.forwards, cu, past, {name: st.new_slots for name, st in steps.items()}, queries,
            err, shift, tol))  # type: ignore[arg-type]
        if self.write_check and total:
            n = total if self._budget is None else min(total, max(1, self._budget))
            toks = (self._wturn + np.arange(n)) % total if n < total else np.arange(n)
            self._wturn = int((self._wturn + n) % total)
            self.write_tokens = (toks, toks if self._fused else to_device(self._dev, [toks])[0])

    def _plan_fused(self, queries: list[Query]) -> None:
        """The compiled audit's query table (:func:`kvcanary.fused.audit.audit_queries`, ``qt``)."""
        self._qlayers = sorted({q.layer for q in queries})
        index = {layer: i for i, layer in enumerate(self._qlayers)}
        local: dict[int, int] = {}
        rows = []
        for i, q in enumerate(queries):
            info, w = self._layers[q.layer], self._windows.get(q.layer)
            li = index[q.layer]
            local[li] = local.get(li, -1) + 1
            rows.append([i, li, q.row, q.token, q.head, q.head // info.rep, q.position,
                         max(q.position - w + 1, 0) if w else 0, q.cached, i if info.sinks is not None else -1,
                         local[li]])
        self._qt = np.array(rows, dtype=np.int64).reshape(-1, 11)
        self.plans = {layer: None for layer in self._qlayers}  # type: ignore[misc]

    def window(self, layer: int) -> int | None:
        """The sliding window layer ``layer`` declares: on its module (Gemma, GPT-OSS), else its layer
        group's (Mistral); ``None`` for full attention."""
        m = self.modules.get(layer)
        g = self.layer_group.get(layer)
        return getattr(m, "sliding_window", None) or getattr(getattr(g, "allocator", None), "sliding_window", None)

    def finish(self) -> None:
        """After the forward: the checks kept for it (the compiled loops), in two calls."""
        if self.fa is None or not self._fused:
            return
        t0 = time.perf_counter()
        try:
            if self.stash and self.write_tokens is not None:
                self._write_layers(sorted(self.stash))
            if self.qstash:
                self._audit_fused()
        except Exception as e:
            self._failed(e)
        finally:
            self.stash.clear()
            self.qstash.clear()
            self.prot.seconds += time.perf_counter() - t0

    def end(self) -> None:
        self.fa = None
        self.stash.clear()
        self.qstash.clear()
        self.steps = {}

    def drain(self) -> list:
        return self.auditor.drain()

    # ---- inside the forward -----------------------------------------------------------------------

    def update(self, original: Callable[..., Any], cache: Any, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int, kwargs: dict) -> Any:
        """Around the cache update of one layer: keep its computed K and V for the write check."""
        if self.fa is not None and self.write_tokens is not None:
            self.stash[layer_idx] = (key, value)
        tap = self.taps.get("update")
        if tap is not None:
            return tap(original, cache, key, value, layer_idx, kwargs)
        return original(cache, key, value, layer_idx, kwargs)

    def attention(self, original: Callable[..., Any], module: Any, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, mask: Any, *args: Any, **kwargs: Any) -> Any:
        """Around the attention of one layer: the engine's own, then this layer's checks (or what
        they need after the forward)."""
        tap = self.taps.get("attention")
        out = (tap(original, module, query, key, value, mask, *args, **kwargs) if tap is not None
               else original(module, query, key, value, mask, *args, **kwargs))
        if self.fa is None:
            return out
        layer = module.layer_idx
        if self._deferred:  # references only: the checks run after the forward
            if layer in self.plans:
                self.qstash[layer] = (query, out[0], False)
            return out
        t0 = time.perf_counter()
        try:
            if self._fused:
                self._layer_fused(layer, query, out[0])
            else:
                with self.prot.work_context():
                    self._layer(layer, query, out[0])
        except Exception as e:
            self._failed(e)
        finally:
            self.prot.seconds += time.perf_counter() - t0
        return out

    def _failed(self, e: Exception) -> None:
        """The audit's own failure: this forward's audit is dropped (no stamp depends on it); counted
        and logged outside ``raise`` mode, raised (in the caller's thread too) in it."""
        self.fa = None
        self.stash.clear()
        self.qstash.clear()
        if self.prot.config.mode == "raise":
            self.prot.pending = e
            raise e
        self.failed += 1
        self.prot.internal_errors += 1
        log.error("kvcanary internal error in the attention audit (counted, not raised)",
                  exc_info=e if self.failed <= 3 else None)

    def _layer_fused(self, layer: int, query: torch.Tensor, out: torch.Tensor) -> None:
        """A large forward on the compiled loops: this layer's writes now; its sampled queries' rows
        kept (copies of a few rows) for the audit after the forward."""
        if self.write_tokens is not None and layer in self.stash:
            self._write_layers([layer])
            self.stash.pop(layer, None)
        if layer in self.plans and self._qt is not None:
            li = self._qlayers.index(layer)
            mine = self._qt[self._qt[:, 1] == li]
            tok, head = torch.from_numpy(mine[:, 3]), torch.from_numpy(mine[:, 4])
            self.qstash[layer] = (query[0, head, tok][:, None].clone(), out[0, tok, head][:, None].clone(), True)

    def _layer(self, layer: int, query: torch.Tensor, out: torch.Tensor) -> None:
        """The torch reference: this layer's writes and sampled queries, now."""
        info = self._layers.get(layer)
        if info is None or self.fa is None or info.group.name not in self.steps:
            return
        if self.write_tokens is not None and layer in self.stash:
            self._write(layer, info)
        plan = self.plans.get(layer)
        if plan is not None:
            self._audit(query, out, plan, info)

    def _physical(self, g: Any, slots: torch.Tensor) -> torch.Tensor:
        s = slots.clamp(min=0)
        return torch.div(s, g.tpp, rounding_mode="floor") * g.stride + s % g.tpp

    def _write_layers(self, layers: list[int]) -> None:
        """The write check of ``layers`` in one compiled call (their computed K and V in ``stash``)."""
        assert self.write_tokens is not None and self.fa is not None
        host = self.write_tokens[0]
        mine, addrs = [], []
        k0 = v0 = None
        for layer in layers:
            info = self._layers.get(layer)
            if info is None:
                continue
            k, v = self.stash[layer]
            if k0 is None:
                k0, v0 = k, v
            # a cast on the way into the cache, or tensors of another shape: the torch comparison
            if k.dtype != info.k_view.dtype or v.dtype != info.v_view.dtype or k.stride() != k0.stride() \
                    or v.stride() != v0.stride() or k.shape != k0.shape:  # type: ignore[union-attr]
                self._write(layer, info)
                continue
            mine.append(layer)
            addrs.append((k.data_ptr(), v.data_ptr()))
        if not mine or k0 is None or v0 is None:
            return
        key = tuple(mine)
        got = self._wplans.get(key)
        if got is None:
            infos = [self._layers[layer] for layer in mine]
            names = sorted({i.group.name for i in infos})
            got = self._wplans[key] = (np.array([i.ck + i.cv for i in infos], dtype=np.int64),
                                       np.array([names.index(i.group.name) for i in infos], dtype=np.int64), names,
                                       [i.group.name for i in infos], infos[0].row_bytes)
        caches, groups, names, layer_groups, row_bytes = got
        slots = np.stack([self.steps[n].new_slots.numpy()[host] for n in names])
        es = k0.element_size()
        ks, vs = k0.stride(), v0.stride()
        strides = np.array([ks[2] * es, ks[1] * es, ks[3] * es, vs[2] * es, vs[1] * es, vs[3] * es], dtype=np.int64)
        half = np.empty((len(mine), len(host)), dtype=np.int64)
        head = np.empty_like(half)
        _loops().write_compare(np.array(addrs, dtype=np.int64), strides, caches, groups, slots, host, es, k0.shape[1],
                               k0.shape[3], half, head)
        self.fa.writes.append(Writes(mine, layer_groups, host, half, head))
        self._count_writes(len(mine), len(host), row_bytes)

    def _audit_fused(self) -> None:
        """Every kept layer's audited queries in one compiled call."""
        fa, qt = self.fa, self._qt
        assert fa is not None and qt is not None
        steps, step_index, descs = [], {}, []
        fl = np.zeros(4 * len(self._qlayers) + len(qt))
        keep = np.zeros(len(qt), dtype=bool)
        for li, layer in enumerate(self._qlayers):
            got = self.qstash.get(layer)
            info = self._layers[layer]
            if got is None or info.group.name not in self.steps:
                descs.append(info.desc)  # no query or output this forward: its queries are left out
                continue
            query, out, gathered = got
            name = info.group.name
            if name not in step_index:
                step_index[name] = len(steps)
                steps.append(_loops().step_desc(self.steps[name]))
            d = info.desc.copy()
            d[12:20] = rows_desc(query, 2, 1, 3) + rows_desc(out, 1, 2, 3) if not gathered else \
                rows_desc(query, 0, 1, 2) + rows_desc(out, 0, 1, 2)
            d[21], d[22], d[24], d[25] = DTYPES.get(query.dtype, -1), query.shape[-1], step_index[name], int(gathered)
            fl[4 * li: 4 * li + 4] = (info.scale, info.softcap or 0.0, *self.auditor.tolerance_for(query.dtype))
            if d[20] >= 0 and d[21] >= 0 and out.dtype == query.dtype:
                keep |= qt[:, 1] == li
            descs.append(d)
        mine = qt[keep]
        if not len(mine):
            return
        sinks = mine[:, 9] >= 0
        if sinks.any():
            for j in np.nonzero(sinks)[0]:
                info = self._layers[self._qlayers[mine[j, 1]]]
                fl[4 * len(self._qlayers) + j] = info.sinks_np[mine[j, 4]]  # type: ignore[index]
            mine = mine.copy()
            mine[sinks, 9] = 4 * len(self._qlayers) + np.nonzero(sinks)[0]
        _loops().audit_queries(np.array(descs, dtype=np.int64), np.stack(steps), mine, fl, fa.err, fa.shift, fa.tol)

    def _count_writes(self, layers: int, tokens: int, row_bytes: int) -> None:
        c = self.auditor.counts
        c["write_slots_checked"] += layers * tokens
        c["write_bytes_checked"] += layers * tokens * row_bytes

    def _write(self, layer: int, info: "_LayerInfo") -> None:
        """One layer's write check with torch ops (the reference; any device)."""
        assert self.write_tokens is not None and self.fa is not None
        host, toks = self.write_tokens
        k, v = self.stash.pop(layer)
        g = info.group
        src_k, src_v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [T, Hkv, D]
        idx = toks if isinstance(toks, torch.Tensor) else torch.from_numpy(toks)
        slots = self.steps[g.name].new_slots[idx]
        phys = self._physical(g, slots)
        half, head = write_mismatch(src_k[idx], src_v[idx], info.k_view[phys], info.v_view[phys])
        self.fa.writes.append(Writes([layer], [g.name], host, torch.where(slots >= 0, half, 0)[None], head[None]))
        self._count_writes(1, len(host), info.row_bytes)

    def _audit(self, query: torch.Tensor, out: torch.Tensor, plan: LayerPlan, info: "_LayerInfo") -> None:
        """One layer's audited queries with torch ops (the reference; any device)."""
        assert self.fa is not None
        g, step = info.group, self.steps[info.group.name]
        k_view, v_view = info.k_view, info.v_view
        shape = plan.grid.shape
        slots = step.lookup(plan.row[:, None].expand(shape).reshape(-1), plan.grid.reshape(-1)).view(shape)
        kvh = (plan.head // info.rep)[:, None].expand(shape)
        n = min(k_view.shape[0], v_view.shape[0])
        phys = self._physical(g, slots)

        def read(slots: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
            p = torch.where(plan.old, phys + shift * g.stride, phys).clamp(0, n - 1)
            return k_view[p, kvh], v_view[p, kvh]

        sink = info.sinks[plan.head] if info.sinks is not None else None
        check_layer(self.fa, plan, slots, query[0, plan.head, plan.token], out[0, plan.token, plan.head], read,
                    info.scale, info.softcap, sink, self.auditor.tolerance_for(query.dtype))

    def _say(self, key: str, text: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(text)

    def stats(self) -> dict[str, int]:
        out = self.auditor.stats()
        out["audit_forwards_skipped"] = self.skipped
        return out


class _LayerInfo:
    """What the checks need of one layer, gathered once: its group, its cache's token views and
    their descriptors, and what its attention computes (its scale, and its logit soft-cap and sinks
    where the attention implementation applies them; said once where it leaves one out)."""

    def __init__(self, audit: CbAudit, layer: int, module: Any, g: Any) -> None:
        self.layer, self.group = layer, g
        self.k_view, self.v_view = g.allocator._kv_token_views[layer]  # [physical slots, Hkv, D]
        self.row_bytes = 2 * self.k_view[0].numel() * self.k_view.element_size()
        self.rep = max(1, int(audit.prot.model.config.num_attention_heads) // int(self.k_view.shape[1]))
        self.ck, self.cv = (self._desc(t, g) for t in (self.k_view, self.v_view))
        impl = str(getattr(audit.prot.model.config, "_attn_implementation", ""))
        softcap = getattr(module, "attn_logit_softcapping", None)
        if softcap is not None and "flash" not in impl:
            audit._say("softcap", f"kvcanary: the {impl} attention of {type(module).__name__} leaves the model's logit "
                       f"soft-capping ({softcap}) out; the audit checks the attention it computes, without it")
            softcap = None
        sinks = getattr(module, "sinks", None)
        if sinks is not None and impl == "sdpa":
            audit._say("sinks", f"kvcanary: the sdpa attention of {type(module).__name__} leaves the model's attention "
                       "sinks out; the audit checks the attention it computes, without them")
            sinks = None
        self.scale = float(module.scaling)
        self.softcap: float | None = None if softcap is None else float(softcap)
        self.sinks: torch.Tensor | None = None if sinks is None else sinks.detach()
        self.sinks_np = None if self.sinks is None else self.sinks.float().cpu().numpy().astype(np.float64)
        # the compiled audit's descriptor (kvcanary.fused.audit.audit_queries): the cache's part here,
        # the queries' and outputs' for each forward
        self.desc = np.array(self.ck + self.cv + [0] * 8 + [DTYPES.get(self.k_view.dtype, -1), 0, 0,
                                                            g.canary.num_slots - 1, 0, 0], dtype=np.int64)

    @staticmethod
    def _desc(t: torch.Tensor, g: Any) -> list[int]:
        """The compiled loops' descriptor of a layer's token rows, addressed by compact slot."""
        es = t.element_size()
        row = t.stride(0) * es
        return cache_desc(t.data_ptr(), g.tpp, g.stride * row, row, t.stride(1) * es, t.stride(2) * es)


def _loops() -> Any:
    """The compiled loops (imported on first use: numba is loaded only where the fused path runs)."""
    from kvcanary.fused import audit

    return audit
