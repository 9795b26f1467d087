"""transformers continuous batching: the write check and the read audit (:mod:`kvcanary.audit`)
inside each protected forward.

Two class-level patches feed it: the paged cache's ``update`` (each layer's computed K and V,
before the cache write) and the attention function the model looks up (each layer's query and
attention output, after the cache was written and read). Each layer's computed K and V are
compared with the cache rows at their new tokens' slots, and the forward's sampled queries are
recomputed from the cache at the slots of their group's verified step table, with the module's own
scale, window, sinks and soft-capping (where the attention implementation applies them:
transformers' ``sdpa`` and ``paged|eager`` kernels leave Gemma2's logit soft-capping out, and
``sdpa`` leaves attention sinks out, which is said once). The cache is read through each layer's
geometry (:class:`~kvcanary.geometry.token_pages.TokenPages`).

On a CPU pool (the fused backend) both checks run in compiled loops (:mod:`kvcanary.fused.audit`):
a decode-sized forward keeps references to each layer's tensors and checks every layer in one
call after the forward; a larger one checks each layer's writes as it goes and keeps only the
sampled queries' rows. Elsewhere the torch reference runs each layer's checks as it goes.

The decode fast path (flash attention reading through a block table, on GPUs) is not audited yet:
its forwards are counted apart (``audit_forwards_skipped``) and said once.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from kvcanary.audit.budget import shape_class
from kvcanary.audit.records import LayerPlan, plan_layers
from kvcanary.audit.tables import (PTR_K, PTR_O, PTR_Q, PTR_V, Q_HEAD, Q_LAYER, Q_TOKEN, S_K, S_O, S_Q, S_V,
                                   STRIDE_COLUMNS, floats, query_table, strides)
from kvcanary.engines.audit import NO_QUERIES, EngineAudit
from kvcanary.engines.transformers import hooks

log = logging.getLogger("kvcanary")
Tap = Callable[..., Any]
DEFER_TOKENS = 256  # forwards of at most this many new tokens are checked after the forward, from references


class CbAudit(EngineAudit):
    """The write check and read audit of one :class:`~kvcanary.engines.transformers.entry.Protection`.

    ``taps`` (fault injection only): ``"update"`` wraps the cache update as
    ``tap(original, cache, key, value, layer_idx, kwargs)`` and ``"attention"`` the attention
    function as ``tap(original, module, query, key, value, mask, *args, **kwargs)``.
    """

    def __init__(self, prot: Any) -> None:
        super().__init__(prot, int(prot.model.config.num_attention_heads))
        self.steps: dict[str, Any] = {}
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> its computed K and V
        self.qstash: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}  # layer -> query, output, gathered
        self.layer_group: dict[int, Any] = {}
        self.plans: dict[int, LayerPlan | None] = {}
        self.modules: dict[int, Any] = {}  # layer index -> its attention module
        self._module_ids: dict[int, int] = {}  # layer index -> the id of its attention module (hooks.PASS)
        self.taps: dict[str, Tap] = {}
        self.skipped = 0  # forwards of the decode fast path, not audited
        self.layer_seconds = 0.0  # the per-layer hooks' share of the canary's seconds
        self.fused = False  # the compiled loops run the checks (a CPU pool on the fused backend)
        self._said: set[str] = set()
        self._layers: dict[int, _LayerInfo] = {}
        self._windows: dict[int, int | None] = {}
        self._deferred = False  # this forward is checked after it, from references to its tensors
        self._order: list[int] = []  # the layers, in the order the rotation walks them
        self._dev = torch.device("cpu")
        self._pool_key: tuple[Any, ...] = ()
        self._qt: np.ndarray | None = None  # this forward's compiled query table
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
        self.fused = self._compiled is not None
        self._order = sorted(self._layers)
        if groups:
            self._dev = next(iter(groups.values())).canary.device
            # a new pool or dtype is a new situation for the audit's budget
            self._pool_key = tuple((g.pages.cache.data_ptr(), str(g.pages.cache.dtype)) for g in groups.values())

    def begin(self, steps: dict[str, Any], reqs: list, batch: dict, forwards: int) -> None:
        """Plan this forward's write checks and audited queries (host work from the requests' lengths)."""
        t0 = time.perf_counter()
        self.stop_keeping()
        self.fa, self.plans, self._qt, self._fl = None, {}, None, None
        self.write_tokens = self.write_index = None
        self.stash.clear()
        self.qstash.clear()
        if len(self._module_ids) != len(self.modules):  # the modules are registered once, on entry
            self._module_ids = {layer: id(m) for layer, m in self.modules.items()}
        ids = self._module_ids if "attention" not in self.taps else {}
        # where this is the only protected model, a forward that needs nothing of any layer's attention has the
        # model look up the engine's own function (no wrapper at all); with several, each module is looked up
        alone = len(hooks.ACTIVE) <= 1
        if ids:  # no audit this forward, unless planned below: every layer's attention straight to the engine
            hooks.PASS[0] = (set(ids.values()), self.clock, alone)
        if not steps or not self._order or not self.due(forwards):
            return
        if batch.get("block_table") is not None:
            self.skipped += 1
            self._say("fast_path", "kvcanary: the decode fast path (attention through a block table) is not audited; "
                      "its forwards are counted as audit_forwards_skipped")
            return
        # the rows as Python ints: right after the engine's forward each numpy call costs tens of
        # microseconds (cold caches), a builtin on a short list a few; numpy is called where queries are
        q = [fs.query_length for fs in reqs]
        past = [fs.state.position_offset - n for fs, n in zip(reqs, q)]
        cu = [0, *itertools.accumulate(q)]
        total = cu[-1]
        self.steps = steps
        self._deferred = self.fused and total <= DEFER_TOKENS
        situation = (shape_class(len(reqs), any(n > 1 for n in q)), self._pool_key)
        queries = self.sample(self._order, q, cu, past, int, lambda layer: self.layer_group[layer].name,
                              lambda layer: self._windows.get(layer) is not None, situation,
                              [fs.state.request_id for fs in reqs])
        if self.fused:
            self._plan_fused(queries)
        else:
            self.plans = plan_layers(queries, self._windows, self._dev)  # type: ignore[assignment]
        self.start(forwards, cu, past, {name: st.new_slots for name, st in steps.items()}, queries, self._dev,
                   host=self.fused)
        self.pick_writes(total, self._dev)
        cache = getattr(self.adapter, "cache", None)
        if self._deferred and self.write_tokens is not None and "update" not in self.taps and cache is not None:
            hooks.KEEP[0] = (cache.cache_tensor, self.stash, self.clock)  # every layer's K and V, kept directly
        if ids and self._deferred:  # the layers of the audited queries wrapped: their query and output kept
            skip = {i for layer, i in ids.items() if layer not in self.plans}
            hooks.PASS[0] = (skip, self.clock, alone and len(skip) == len(ids))
        elif ids:  # a large forward: every layer's checks as it goes
            hooks.PASS[0] = None
        self.planned(t0)

    def stop_keeping(self) -> None:
        """The cache update's and the attention wrapper's direct paths off (where they are this
        audit's), and their seconds settled (the canary's, the budget's and the per-layer hooks' count)."""
        keep = hooks.KEEP[0]
        if keep is not None and keep[1] is self.stash:
            hooks.KEEP[0] = None
        skip = hooks.PASS[0]
        if skip is not None and skip[1] is self.clock:
            hooks.PASS[0] = None
        self.layer_seconds += self.settle()

    def _plan_fused(self, queries: list[Any]) -> None:
        """The compiled loop's query table and floats (:mod:`kvcanary.audit.tables`)."""
        c = self._compiled
        assert c is not None
        if not queries:  # none this forward (the budget's cadence): no tables made
            self._qt, self._fl, self.plans = NO_QUERIES, c.fl, {}
            return
        info = self._layers
        self._qt, sinks = query_table(
            queries, lambda q: c.index[q.layer], lambda q: info[q.layer].rep, lambda q: self._windows.get(q.layer),
            lambda q: _sink(info[q.layer], q.head), len(c.fl))
        self._fl = np.concatenate([c.fl, np.asarray(sinks, dtype=np.float64)])
        self.plans = {q.layer: None for q in queries}

    def window(self, layer: int) -> int | None:
        """The sliding window layer ``layer`` declares: on its module (Gemma, GPT-OSS), else its layer
        group's (Mistral); ``None`` for full attention."""
        m = self.modules.get(layer)
        g = self.layer_group.get(layer)
        return getattr(m, "sliding_window", None) or getattr(getattr(g, "allocator", None), "sliding_window", None)

    def finish(self) -> None:
        """After the forward: the checks kept for it (the compiled loop), in one call."""
        self.stop_keeping()
        if self.fa is None or not self.fused:
            return
        t0 = time.perf_counter()
        try:
            if (self.stash and self.write_tokens is not None) or self.qstash:
                self._run(writes=self.write_tokens is not None, audit=True)
        except Exception as e:
            self.failed(e)
        finally:
            self.stash.clear()
            self.qstash.clear()
            self.spent += time.perf_counter() - t0  # inside the after-forward hook, which counts its time

    def end(self) -> None:
        self.stop_keeping()
        super().end()
        self.stash.clear()
        self.qstash.clear()
        self.steps = {}

    def failed(self, e: Exception) -> None:
        self.stop_keeping()
        self.stash.clear()
        self.qstash.clear()
        super().failed(e)

    # ---- inside the forward -----------------------------------------------------------------------

    def update(self, original: Callable[..., Any], cache: Any, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int, kwargs: dict, t0: float | None = None) -> Any:
        """Around the cache update of one layer: keep its computed K and V for the write check. The
        canary's seconds since ``t0`` (the patch's first statement) are charged: 30 layers' lookups
        and references are a tenth of a millisecond a forward, more than some hooks."""
        if self.fa is not None and self.write_tokens is not None:
            self.stash[layer_idx] = (key, value)
        tap = self.taps.get("update")
        if t0 is not None:  # on the clock the direct paths use, settled after the forward (stop_keeping)
            self.clock[0] += time.perf_counter() - t0
        if tap is not None:
            return tap(original, cache, key, value, layer_idx, kwargs)
        return original(cache, key, value, layer_idx, kwargs)

    def attended(self, module: Any, query: torch.Tensor, out: Any) -> None:
        """After the attention of one layer (the engine's own, ``out`` its result): this layer's checks
        (or what they need after the forward), their seconds charged."""
        if self.fa is None:
            return
        layer = module.layer_idx  # every audited module has one (Protection registers it by it)
        if self._deferred and layer not in self.plans:
            return  # nothing of this layer's kept (most layers of a decode forward): no timer either
        t0 = time.perf_counter()
        try:
            if self._deferred:  # references only: the checks run after the forward
                self.qstash[layer] = (query, out[0], False)
            elif self.fused:
                self._layer_fused(layer, query, out[0])
            else:
                with self.adapter.work_context():
                    self._layer(layer, query, out[0])
        except Exception as e:
            self.failed(e)
        finally:  # on the clock the direct paths use, settled after the forward (stop_keeping)
            self.clock[0] += time.perf_counter() - t0

    def _layer_fused(self, layer: int, query: torch.Tensor, out: torch.Tensor) -> None:
        """A large forward on the compiled loop: this layer's writes now; its sampled queries' rows
        kept (copies of a few rows) for the audit after the forward."""
        if self.write_tokens is not None and layer in self.stash:
            self._run(writes=True, audit=False)
            self.stash.clear()
        if layer in self.plans and self._qt is not None and self._compiled is not None:
            mine = self._qt[self._qt[:, Q_LAYER] == self._compiled.index[layer]]
            tok, head = torch.from_numpy(mine[:, Q_TOKEN]), torch.from_numpy(mine[:, Q_HEAD])
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
            sink = info.sinks[plan.head] if info.sinks is not None else None
            self.check_queries(plan, self.steps[info.group.name], info.geometry, query[0, plan.head, plan.token],
                               out[0, plan.token, plan.head], info.rep, info.scale, info.softcap, sink,
                               self.auditor.tolerance_for(query.dtype))

    def _write(self, layer: int, info: "_LayerInfo") -> None:
        """One layer's write check with torch ops (the reference; any device)."""
        assert self.write_index is not None
        k, v = self.stash.pop(layer)
        idx = self.write_index
        slots = self.steps[info.group.name].new_slots[idx]
        self.check_writes(layer, info.group.name, info.geometry, slots, k[0].transpose(0, 1)[idx],
                          v[0].transpose(0, 1)[idx])

    def _run(self, writes: bool, audit: bool) -> None:
        """The kept layers' write checks (``writes``: those in ``stash``) and audited queries
        (``audit``: those in ``qstash``) in one compiled call."""
        c = self._compiled
        assert c is not None
        # each layer's row of addresses (PTR_* columns), made an array once: numpy's indexed assignment from
        # lists cost tens of microseconds a forward here, where everything is cold after the model's forward
        ptrs = [0] * (4 * len(c.index))
        st = [0] * STRIDE_COLUMNS
        q0 = o0 = None
        gathered = False
        wrote: list[int] = []  # the table rows whose writes the call checks
        if writes:
            # each layer's addresses, strides and dtypes in one pass over the kept references (reading them in
            # the cache-update hook instead, while the tensors are in the CPU's caches, measured dearer in all);
            # a layer whose tensors differ from the first one's in strides or dtype, or whose dtype is not its
            # cache's (a cast on the way in), is compared by torch
            first = sig = None
            odd = []
            index, dtype = c.index, c.cache_dtype
            for layer, (k, v) in self.stash.items():
                i = index.get(layer)
                if i is None:
                    continue
                m = (k.stride(), v.stride(), k.dtype, v.dtype)
                if sig is None and m[2] == m[3] == dtype[layer]:
                    first, sig = (k, v), m
                if m != sig or m[2] != dtype[layer]:
                    odd.append(layer)
                    continue
                ptrs[4 * i + PTR_K], ptrs[4 * i + PTR_V] = k.data_ptr(), v.data_ptr()
                wrote.append(i)
            for layer in odd:
                self._write(layer, self._layers[layer])
            if first is not None:
                st[S_K:S_K + 3], st[S_V:S_V + 3] = strides(first[0], 2, 1, 3), strides(first[1], 2, 1, 3)
        if audit:
            for layer, (q, o, gathered) in self.qstash.items():
                if q0 is None or o0 is None:
                    q0, o0 = q, o
                if q.stride() != q0.stride() or o.stride() != o0.stride() or q.dtype != c.dtype or o.dtype != c.dtype:
                    continue  # another shape or dtype than the forward's first: left out (its queries stay -1)
                i = 4 * c.index[layer]
                ptrs[i + PTR_Q], ptrs[i + PTR_O] = q.data_ptr(), o.data_ptr()
            if q0 is not None and o0 is not None:
                if gathered:
                    st[S_Q:S_Q + 3], st[S_O:S_O + 3] = strides(q0, 0, 1, 2), strides(o0, 0, 1, 2)
                else:
                    st[S_Q:S_Q + 3], st[S_O:S_O + 3] = strides(q0, 2, 1, 3), strides(o0, 1, 2, 3)
        from kvcanary.fused._step import describe

        for name, gi in c.groups.items():
            step = self.steps.get(name)
            if step is not None:
                c.steps[gi] = describe(step)
        qt = self._qt if audit and self._qt is not None else NO_QUERIES
        fl = self._fl if self._fl is not None else c.fl
        self.run_compiled(c.layers, np.array(ptrs, dtype=np.int64).reshape(-1, 4), np.array(st, dtype=np.int64),
                          c.steps, qt, fl, gathered, c.order, c.group_of, c.token_bytes, wrote)

    def _say(self, key: str, text: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(text)

    def stats(self) -> dict[str, int]:
        out = super().stats()
        out["audit_forwards_skipped"] = self.skipped
        return out


class _LayerInfo:
    """What the checks need of one layer, gathered once: its group and geometry, and what its
    attention computes (its scale, and its logit soft-cap and sinks where the attention
    implementation applies them; said once where it leaves one out)."""

    def __init__(self, audit: CbAudit, layer: int, module: Any, g: Any) -> None:
        self.layer, self.group = layer, g
        self.geometry = g.pages.layer(layer)
        self.rep = max(1, audit.heads // self.geometry.num_kv_heads)
        config = audit.adapter.model.config
        impl = str(getattr(config, "_attn_implementation", ""))
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


def _sink(info: _LayerInfo, head: int) -> float | None:
    return None if info.sinks_np is None else float(info.sinks_np[head])


class _Compiled:
    """The compiled loop's constants for one protection's layers (:mod:`kvcanary.audit.tables`): the
    layer table, each layer's floats, and a row of step descriptors per group, filled each forward."""

    def __init__(self, audit: CbAudit, groups: dict[str, Any]) -> None:
        from kvcanary.fused._step import DESC_LEN

        self.order = sorted(audit._layers)
        self.index = {layer: i for i, layer in enumerate(self.order)}
        self.groups = {name: i for i, name in enumerate(sorted(groups))}
        infos = [audit._layers[layer] for layer in self.order]
        self.group_of = [i.group.name for i in infos]
        self.dtype = infos[0].geometry.dtype  # the model's: what its queries and outputs come in
        self.cache_dtype = {i.layer: i.geometry.dtype for i in infos}  # each layer's cache's
        self.token_bytes = infos[0].geometry.token_bytes
        self.layers = np.array([audit.layer_row(i.geometry, self.groups[i.group.name], self.dtype) for i in infos],
                               dtype=np.int64)
        self.fl = floats([(i.scale, i.softcap or 0.0, *audit.auditor.tolerance_for(self.dtype)) for i in infos])
        self.steps = np.zeros((len(self.groups), DESC_LEN), dtype=np.int64)
