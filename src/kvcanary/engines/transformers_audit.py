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
        self._qt: np.ndarray | None = None  # this forward's audited queries (fused: the compiled loop's table)
        self._fl: np.ndarray | None = None  # and its floats (each layer's scale, soft-cap, tolerance; sinks)
        self._compiled: _Compiled | None = None  # the compiled loop's per-layer constants

    # ---- per forward ----------------------------------------------------------------------------

    def groups_changed(self, groups: dict[str, Any]) -> None:
        self.layer_group = {layer: g for g in groups.values() for layer in g.allocator.layer_indices}
        self._layers = {layer: _LayerInfo(self, layer, self.modules[layer], g)
                        for layer, g in self.layer_group.items() if layer in self.modules}
        self._compiled = _Compiled(self, groups) if self._layers and all(
            g.canary.backend == "fused" for g in groups.values()) else None
        self._windows = {layer: self.window(layer) for layer in self.layer_group}
        self._fused = self._compiled is not None
        self._order = sorted(self._layers)
        self._heads = int(self.prot.model.config.num_attention_heads)
        if groups:
            self._dev = next(iter(groups.values())).canary.device
            budget = self.prot.config.budget_for(self._dev.type)
            # a token's K and V rows in the engine's cache ([tokens, 2, kv heads, head size]), whatever
            # the canary's content layout reads (none with content="none")
            row = max(2 * t.shape[2] * t.shape[3] * t.element_size()
                      for t in (g.allocator.cache_tensor for g in groups.values()))
            # tokens whose K and V rows of every layer fit the content budget
            self._budget = None if budget is None else budget // (row * max(1, len(self._order)))

    def begin(self, steps: dict[str, Any], reqs: list, batch: dict) -> None:
        """Plan this forward's write checks and audited queries (host work from the requests' lengths)."""
        self.fa, self.plans, self.write_tokens, self._qt, self._fl = None, {}, None, None, None
        self.stash.clear()
        self.qstash.clear()
        if not self.on or not steps or not self._order or self.prot.forwards % self.prot.config.audit_every:
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
        err: Any
        shift: Any
        tol: Any
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
        """The compiled loop's query table and floats (:func:`kvcanary.fused.audit.check_forward`)."""
        c = self._compiled
        assert c is not None
        local: dict[int, int] = {}
        rows = []
        fl = np.empty(len(c.fl) + len(queries))
        fl[: len(c.fl)] = c.fl
        for i, q in enumerate(queries):
            info, w, li = self._layers[q.layer], self._windows.get(q.layer), c.index[q.layer]
            local[li] = local.get(li, -1) + 1
            si = -1
            if info.sinks_np is not None:
                si = len(c.fl) + i
                fl[si] = info.sinks_np[q.head]
            rows.append([i, li, q.row, q.token, q.head, q.head // info.rep, q.position,
                         max(q.position - w + 1, 0) if w else 0, q.cached, si, local[li]])
        self._qt = np.array(rows, dtype=np.int64).reshape(-1, 11)
        self._fl = fl
        self.plans = {q.layer: None for q in queries}  # type: ignore[misc]

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
            if (self.stash and self.write_tokens is not None) or self.qstash:
                self._run_compiled(writes=self.write_tokens is not None, audit=True)
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
        self.fa = None  # this forward's audit is dropped
        self.stash.clear()
        self.qstash.clear()
        self.auditor.failed(self.prot, e)

    def _layer_fused(self, layer: int, query: torch.Tensor, out: torch.Tensor) -> None:
        """A large forward on the compiled loop: this layer's writes now; its sampled queries' rows
        kept (copies of a few rows) for the audit after the forward."""
        if self.write_tokens is not None and layer in self.stash:
            self._run_compiled(writes=True, audit=False)
            self.stash.clear()
        if layer in self.plans and self._qt is not None and self._compiled is not None:
            mine = self._qt[self._qt[:, 1] == self._compiled.index[layer]]
            tok, head = torch.from_numpy(mine[:, 3]), torch.from_numpy(mine[:, 4])
            self.qstash[layer] = (query[0, head, tok][:, None].contiguous(), out[0, tok, head][:, None].contiguous(),
                                  True)

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

    def _run_compiled(self, writes: bool, audit: bool) -> None:
        """The kept layers' write checks (``writes``: those in ``stash``) and audited queries
        (``audit``: those in ``qstash``) in one compiled call."""
        c, fa = self._compiled, self.fa
        assert c is not None and fa is not None
        ptrs = np.zeros((len(c.index), 4), dtype=np.int64)
        strides = [0] * 12
        k0 = v0 = q0 = o0 = None
        gathered = False
        if writes:
            for layer, (k, v) in list(self.stash.items()):
                info = self._layers.get(layer)
                if info is None:
                    continue
                if k0 is None:
                    k0, v0 = k, v
                # a cast on the way into the cache, or tensors shaped otherwise: the torch comparison
                if k.dtype != info.k_view.dtype or v.dtype != info.v_view.dtype or k.stride() != k0.stride() \
                        or v.stride() != v0.stride():  # type: ignore[union-attr]
                    self._write(layer, info)
                    continue
                ptrs[c.index[layer], 0], ptrs[c.index[layer], 1] = k.data_ptr(), v.data_ptr()
            if k0 is not None and v0 is not None:
                strides[0:6] = _strides(k0, 2, 1, 3) + _strides(v0, 2, 1, 3)
        if audit:
            for layer, (q, o, gathered) in self.qstash.items():
                if q0 is None or o0 is None:
                    q0, o0 = q, o
                if q.stride() != q0.stride() or o.stride() != o0.stride() or q.dtype != c.dtype or o.dtype != c.dtype:
                    continue  # another shape or dtype than the forward's first: left out (its queries stay -1)
                ptrs[c.index[layer], 2], ptrs[c.index[layer], 3] = q.data_ptr(), o.data_ptr()
            if q0 is not None and o0 is not None:
                strides[6:12] = (_strides(q0, 0, 1, 2) + _strides(o0, 0, 1, 2) if gathered else
                                 _strides(q0, 2, 1, 3) + _strides(o0, 1, 2, 3))
        for name, gi in c.groups.items():
            step = self.steps.get(name)
            if step is not None:
                c.steps[gi] = _loops().step_desc(step)
        toks = self.write_tokens[0] if self.write_tokens is not None else np.zeros(0, dtype=np.int64)
        half = np.zeros((len(c.index), len(toks)), dtype=np.int64)
        head = np.zeros_like(half)
        qt = self._qt if audit and self._qt is not None else _NO_QUERIES
        fl = self._fl if self._fl is not None else c.fl
        _loops().check_forward(c.layers, ptrs, np.array(strides, dtype=np.int64), c.steps, toks, qt, fl, half, head,
                               fa.err, fa.shift, fa.tol, gathered)
        if k0 is not None:
            kept = np.nonzero(ptrs[:, 0])[0]
            fa.writes.append(Writes([c.order[i] for i in kept], [c.group_of[i] for i in kept], toks, half[kept],
                                    head[kept]))
            self._count_writes(len(kept), len(toks), c.row_bytes)

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


_NO_QUERIES = np.zeros((0, 11), dtype=np.int64)


def _strides(t: torch.Tensor, tok: int, head: int, dim: int) -> list[int]:
    es = t.element_size()
    st = t.stride()
    return [st[tok] * es, st[head] * es, st[dim] * es]


class _Compiled:
    """The compiled loop's constants for one protection's layers (:func:`kvcanary.fused.audit.check_forward`):
    per layer its cache descriptors, group, dtypes, sizes and largest slot, and its scale, soft-cap
    and tolerance; a row of step descriptors per group, filled each forward."""

    def __init__(self, audit: CbAudit, groups: dict[str, Any]) -> None:
        from kvcanary.fused._step import DESC_LEN

        self.order = sorted(audit._layers)
        self.index = {layer: i for i, layer in enumerate(self.order)}
        self.groups = {name: i for i, name in enumerate(sorted(groups))}
        infos = [audit._layers[layer] for layer in self.order]
        self.group_of = [i.group.name for i in infos]
        self.dtype = infos[0].k_view.dtype  # the model's: what its queries and outputs come in
        self.row_bytes = infos[0].row_bytes
        rows, fl = [], []
        for i in infos:
            kv = i.k_view
            code = DTYPES.get(kv.dtype, -1)
            rows.append(i.ck + i.cv + [self.groups[i.group.name], code, kv.element_size(), kv.shape[1], kv.shape[2],
                                       i.group.canary.num_slots - 1, DTYPES.get(self.dtype, -1)])
            fl += [i.scale, i.softcap or 0.0, *audit.auditor.tolerance_for(self.dtype)]
        self.layers = np.array(rows, dtype=np.int64)
        self.fl = np.array(fl, dtype=np.float64)
        self.steps = np.zeros((len(self.groups), DESC_LEN), dtype=np.int64)
