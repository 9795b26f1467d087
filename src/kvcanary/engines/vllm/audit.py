"""vLLM (CPU build): the write check and the read audit (:mod:`kvcanary.audit`) inside each
attention layer's forward.

vLLM's CPU attention writes a layer's new K and V into its cache (``do_kv_cache_update``) before
the layer's attention runs (``CPUAttentionBackendImpl.forward``). The class-level patch of that
forward (:mod:`kvcanary.engines.vllm.patch`), installed by the worker-side connector, checks the
layers of the KV cache groups the canary covers around the engine's attention:

- before it (the write has run): compares the K and V the layer computed (the forward's ``key`` and
  ``value``, the inputs of the cache-write op) bit for bit with the cache rows at the new tokens'
  slots (``slot_mapping``), and folds them into the new tokens' content fingerprints;
- after it: recomputes the forward's sampled queries of that layer in fp32 from the cache at the
  slots of the group's verified step table, with the layer's own scale, window, soft-cap and sinks,
  and compares them with the engine's output rows.

(Where a layer is checked by the per-layer path, both run after the attention.)

The cache is read through each layer's geometry (:mod:`kvcanary.geometry.vllm_cpu`): on a CPU pool
by the compiled loops where a descriptor places its elements (``vec``, ``vec16``, ``amx``:
:func:`compiled_reads`), else by the torch reference. Layers the canary does not cover, draft-model
layers, KV-sharing layers (no write of their own) and non-causal or ALiBi attention are passed
through unchecked.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from kvcanary.audit.budget import shape_class
from kvcanary.audit.records import LayerPlan, plan_layers
from kvcanary.audit.reference import DTYPES
from kvcanary.audit.tables import (L_STEP, PTR_K, PTR_O, PTR_Q, PTR_V, STRIDE_COLUMNS, floats, query_table,
                                   strides)
from kvcanary.engines.audit import NO_QUERIES, EngineAudit
from kvcanary.engines.vllm.fold import Fold, FoldTables, fold_tables
from kvcanary.engines.vllm import wide
from kvcanary.engines.vllm.patch import ACTIVE, ORIGINAL, REGISTRY, install
from kvcanary.engines.vllm.wide import WideBase, WideForward
from kvcanary.geometry.base import KvGeometry

log = logging.getLogger("kvcanary")
CPU = torch.device("cpu")  # the host path's device (made once: each forward's plan passes it)


@dataclass(frozen=True)
class _Layer:
    """A layer's constants for its checks, read from its attention on its first call: its number
    in the records, whether it is checked at all (decoder attention), writes its own KV (no KV
    sharing) and is audited (no ALiBi, its group's window), its heads, query heads per KV head,
    scale, soft-cap, sinks and tolerance, its cache's dtype, whether the compiled loop reads it, and
    its floats for the compiled loop without queries, and the sinks' logits for those with them."""

    number: int
    checked: bool
    writes: bool
    audited: bool
    heads: int
    rep: int
    scale: float
    softcap: float | None
    sinks: torch.Tensor | None
    tol: tuple[float, float]
    dtype: torch.dtype
    compiled: bool
    floats: np.ndarray
    sink_logits: np.ndarray | None


def compiled_reads(geometry: KvGeometry) -> bool:
    """Whether the compiled loops read this layer's cache: a descriptor places its elements
    (:meth:`~kvcanary.geometry.base.KvGeometry.descriptors`) and its dtype is one they compute in."""
    return geometry.dtype in DTYPES and geometry.descriptors() is not None


class VllmAudit(EngineAudit):
    """The write check and read audit of one worker's connector."""

    def __init__(self, conn: Any, heads: int) -> None:
        super().__init__(conn, heads)
        self.groups: dict[str, Any] = {}  # layer name -> its group (the connector's)
        self.geometry: dict[str, KvGeometry] = {}  # layer name -> its cache's geometry
        self.index: dict[str, int] = {}  # layer name -> its number in the records' "layer" field
        self.plans: dict[int, LayerPlan] | None = {}  # by the layer's number (None: not made yet)
        self._to_plan: tuple[Any, ...] = ([], {})
        self._rows: dict[str, tuple[int, np.ndarray]] = {}  # the compiled loop's layer row, by the cache it was made for
        self.seen: dict[str, _Layer] = {}  # layer -> what its checks take from its attention, once seen
        self._tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # this forward's compiled tables by layer
        self._step_descs: dict[str, np.ndarray] = {}
        self._strides: dict[tuple[Any, ...], np.ndarray] = {}
        self.skipped = 0  # covered layers the per-layer wrapper does not reach (GPU backends)
        self.torch_layers = 0  # covered layers of a compiled canary whose cache the compiled loops cannot read
        self.one_call = 0  # forwards whose queries were checked in one call after the forward
        self._wide: WideForward | None = None  # this forward's checks, kept for one compiled call after it
        # the last forward's plan, where the next may run on it again (WideForward.reusable, again)
        self._spare: WideForward | None = None
        self.reused = 0  # forwards that ran on the last forward's plan
        # by the live groups: the covered layers, their layer table, floats and rows
        self._wide_base: dict[tuple[Any, ...], WideBase] = {}
        self._fold_tables: dict[tuple[Any, ...], FoldTables] = {}
        # by the live groups' names: their covered layers, the layers' windows by number, and the pool's address
        self._live: dict[tuple[str, ...], tuple[list[str], dict[int, int | None], int]] = {}
        # each group's new tokens' fingerprints folded in this forward's layers, for its stamp
        self.folds: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.folded = 0  # new tokens stamped with fingerprints folded in the layers

    def register(self, groups: list[Any], geometry: dict[str, KvGeometry]) -> None:
        """The covered groups' layers, checked from now on (``geometry``: each layer's cache)."""
        if not self.on:
            return
        install()
        for g in groups:
            for name in g.plan.layers:
                if name in geometry:
                    self.groups[name] = g
                    found = re.search(r"layers\.(\d+)\.", name)
                    self.index[name] = int(found.group(1)) if found else len(self.index)
                    self.geometry[name] = geometry[name]
                    REGISTRY[name] = self
        self._live.clear()
        self.say_torch_layers()

    def say_torch_layers(self) -> None:
        """Say once, at start, which covered layers of a compiled (``fused``) canary are checked by the
        torch path: their cache has no descriptor the compiled loops read
        (:meth:`~kvcanary.geometry.base.KvGeometry.descriptors`) or a dtype they do not compute in.
        That path costs several times the compiled one (about 20 % of a trained model's run)."""
        slow = [n for n, g in self.groups.items()
                if g.canary.backend == "fused" and not compiled_reads(self.geometry[n])]
        self.torch_layers = len(slow)
        if slow:
            kinds = sorted({f"{type(self.geometry[n]).__name__} in {self.geometry[n].dtype}" for n in slow})
            log.warning("kvcanary: the compiled write check and read audit cannot read the cache of %d layer(s) (%s); "
                        "they are checked in torch, several times slower (stats: audit_layers_torch)", len(slow),
                        ", ".join(kinds))

    def say_skipped(self, layers: dict[str, str]) -> None:
        """Say once, at start, which covered layers run without the write check and read audit
        (``layers``: name -> backend): the per-layer wrapper wraps vLLM's CPU attention only; on a
        GPU backend it would sit inside the attention a full CUDA graph captures."""
        self.skipped = len(layers) if self.on else 0
        if self.skipped:
            names = sorted(set(layers.values()))
            log.warning("kvcanary: the write check and read audit run inside vLLM's CPU attention only; %d layer(s) "
                        "on %s run without them (stats: audit_layers_skipped); verify and stamp cover them as "
                        "every other layer", self.skipped, ", ".join(names))

    def begin(self, live: list[Any], rows: Any, forwards: int) -> None:
        """Plan this forward's write checks and audited queries from the steps' host values."""
        self.fa, self.plans, self.folds = None, {}, {}
        self._unset()
        self.write_tokens = self.write_index = None
        self._tables, self._step_descs = {}, {}
        if not live or not self.groups or not self.due(forwards):
            return
        t0 = time.perf_counter()
        step = live[0].step
        # the rows as Python ints (two conversions): right after the engine's forward each numpy call
        # costs tens of microseconds (cold caches), a builtin on a short list a few
        qsl, cached = step.new_offsets.tolist(), step.cached_lens.tolist()
        q = [b - a if x is not None else 0 for a, b, x in zip(qsl, qsl[1:], rows.reqs)]  # padding rows: none
        layers, windows, pool = self._covered(live)
        # a new pool (or dtype: a new pool) or batch shape class is a new situation for the budget
        situation = (shape_class(len(q), any(b - a > 1 for a, b in zip(qsl, qsl[1:]))), pool)
        queries = self.sample(layers, q, qsl, cached, self.index.__getitem__, lambda n: self.groups[n].name,
                              situation=situation, rids=rows.rids)
        self._to_plan = (queries, windows)  # the per-layer path's plans, made when it runs (_layer_plans)
        self.plans = None
        fa = self.start(forwards, qsl, cached, {g.name: g.step.new_slots for g in live}, queries, CPU,
                        host=True)
        self.pick_writes(qsl[-1], CPU, len(layers))  # the one call after the forward thins them (WideForward)
        if all(g.canary.backend == "fused" for g in live):
            self._wide = ACTIVE[0] = self._deferred(live, layers, pool, fa.queries)
        if self._wide is None:
            self._layer_plans()
        if self._wide is None and any(g.canary.backend == "fused" for g in live):
            from kvcanary.fused._step import describe  # the compiled loop's tables, for each layer's call

            self._step_descs = {g.name: describe(g.step)[None] for g in live}
            for name in (n for n in layers if self.index[n] in self._layer_plans()):
                known = self.seen.get(name)
                if known is not None and known.compiled:
                    self._tables[name] = self._table(name, known)
        self.planned(t0)

    def _covered(self, live: list[Any]) -> tuple[list[str], dict[int, int | None], int]:
        """The live groups' covered layers, their windows by layer number and the pool's address (the
        first layer's cache), made once per set of live groups."""
        key = tuple(g.name for g in live)
        got = self._live.get(key)
        if got is None:
            layers = [n for g in live for n in g.plan.layers if n in self.groups]
            windows = {self.index[n]: self.groups[n].plan.window for n in layers}
            got = self._live[key] = (layers, windows, self.geometry[layers[0]].tensor.data_ptr() if layers else 0)
        return got

    def _deferred(self, live: list[Any], layers: list[str], pool: int, queries: list[Any]) -> "WideForward | None":
        """This forward's checks as one compiled call after it (:class:`WideForward`), where every covered
        layer was seen (its constants known) and the compiled loop reads it; else ``None`` (``pool``:
        the first covered layer's cache address, :meth:`_covered`'s)."""
        if not layers:
            return None
        key = (*(g.name for g in live), pool)
        base = self._wide_base.get(key)
        if base is None or base.names != layers:  # a layer's statics, once seen, stay
            statics = [self.seen.get(n) for n in layers]
            if any(c is None or not c.compiled for c in statics):
                return None
            gi = {g.name: i for i, g in enumerate(live)}
            table = np.concatenate([self._layer_row(n, self.geometry[n], c.dtype) for n, c in zip(layers, statics)
                                    if c is not None])
            table[:, L_STEP] = [gi[self.groups[n].name] for n in layers]
            fl = np.concatenate([c.floats for c in statics if c is not None])
            width = max(int(self.geometry[n].head_dim) * self.geometry[n].element_size for n in layers)
            base = self._wide_base[key] = WideBase(layers, table, fl, statics,
                                                   [self.groups[n].plan.window for n in layers], width,
                                                   [self.groups[n].name for n in layers])
            self._fold_tables[key] = fold_tables(live, layers, self.groups, getattr(self.adapter, "spans", {}),
                                                 self.geometry)
        tokens = max(int(g.step.num_new) for g in live)
        spare, self._spare = self._spare, None
        if spare is not None and not queries and spare.again(self, live, base, tokens):
            self.reused += 1
            return spare  # the last forward's plan, its tables where they were
        fold = Fold(self._fold_tables[key], [g.name for g in live], tokens)
        plan = WideForward.plan(self, live, base, queries, fold)
        plan.original = ORIGINAL.get("forward")  # the engine's attention, for the patch's direct path
        return plan

    # ---- inside the forward -----------------------------------------------------------------------

    def layer(self, t0: float, original: Callable[..., Any], impl: Any, layer: Any, query: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, md: Any, output: Any, *args: Any,
              **kwargs: Any) -> Any:
        """One covered layer's attention with its checks: where the forward's checks run in one call
        after it, its plan's checks around it (the layer is remembered by object for the patch's direct
        path); else every check after the attention (:meth:`check_layer`); both by
        :func:`kvcanary.engines.vllm.wide.attend`. The canary's seconds from
        ``t0`` (the patch's first statement) to the engine's attention are charged, and its checks'
        after it. A failure of the canary's own goes to :meth:`failed`, never into the engine."""
        plan, got = self._wide, None
        if plan is not None:
            got = plan.base.rows.get(layer.layer_name)
            if got is not None:
                plan.base.by_layer[layer] = got
                if plan.base.plain[got[0]]:
                    plan.base.plain_by_layer[layer] = got[0]
        return wide.attend(self, plan, got, t0, original, impl, layer, query, key, value, kv_cache, md, output, *args,
                           **kwargs)

    def finish(self) -> None:
        """After the forward: the audited queries of every layer kept for it, in one compiled call."""
        plan = self._wide
        self._unset()
        self.settle()  # the layers' seconds
        if plan is None or self.fa is None:
            return
        t0 = time.perf_counter()
        self.folds = plan.fold.results()  # folded inside the layers: valid whatever the call below does
        self.folded += plan.fold.whole()
        try:
            plan.finish(self)
            if plan.reusable():  # the next forward without queries runs on it again (_deferred)
                self._spare = plan
        except Exception as e:
            self.failed(e)
        finally:
            self.spent += time.perf_counter() - t0  # inside the after-forward hook, which counts its time

    def _layer_plans(self) -> dict[int, LayerPlan]:
        """The per-layer path's plans of this forward's queries, by the layer's number (made on its
        first use: the one call after the forward needs none)."""
        if self.plans is None:
            queries, windows = self._to_plan
            self.plans = plan_layers(queries, windows, CPU)
        return self.plans

    def failed(self, e: Exception) -> None:
        self._unset()
        self._spare = None
        super().failed(e)

    def _unset(self) -> None:
        """No forward of this audit's runs its checks in one call from here on (until the next plan)."""
        if self._wide is not None:
            self._wide.live = False
            if ACTIVE[0] is self._wide:
                ACTIVE[0] = None
        self._wide = None

    def check_layer(self, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, md: Any, output: torch.Tensor) -> None:
        name = layer.layer_name
        g = self.groups.get(name)
        fa = self.fa
        if g is None or fa is None or g.step is None:
            return
        c = self.seen.get(name)
        if c is None:
            c = self.seen[name] = self._constants(name, impl, kv_cache, query.dtype)
        if not c.checked or not getattr(md, "causal", True) or getattr(md, "dynamic_causal", None) is not None:
            return
        write = self.write_tokens is not None and c.writes
        plan = self._layer_plans().get(c.number) if c.audited else None
        out3 = output.view(output.shape[0], c.heads, -1)
        geom = self.geometry[name]
        if c.compiled and key.dtype == value.dtype == query.dtype == out3.dtype == c.dtype:
            self._compiled(name, g, geom, key, value, query, out3, write, plan, c)
            return
        if write:
            assert self.write_index is not None
            slots = g.step.new_slots[self.write_index]
            self.check_writes(c.number, g.name, geom, slots, key[self.write_index], value[self.write_index])
        if plan is not None:
            self.check_queries(plan, g.step, geom, query[plan.token, plan.head], out3[plan.token, plan.head], c.rep,
                               c.scale, c.softcap, c.sinks[plan.head] if c.sinks is not None else None, c.tol)

    def _constants(self, name: str, impl: Any, kv_cache: torch.Tensor, query_dtype: torch.dtype) -> _Layer:
        """What a layer's checks take from its attention once (its impl's settings do not change)."""
        from vllm.v1.attention.backend import AttentionType

        g = self.groups[name]
        window = impl.sliding_window if impl.sliding_window and impl.sliding_window > 0 else None
        sinks = impl.sinks.detach() if getattr(impl, "sinks", None) is not None else None
        softcap = impl.logits_soft_cap if impl.logits_soft_cap else None
        scale, tol = float(impl.scale), self.auditor.tolerance_for(query_dtype)
        return _Layer(
            number=self.index[name], checked=getattr(impl, "attn_type", None) == AttentionType.DECODER,
            writes=getattr(impl, "kv_sharing_target_layer_name", None) is None,
            # a layer whose window is not its group's is not audited, nor ALiBi
            audited=getattr(impl, "alibi_slopes", None) is None and window == g.plan.window,
            heads=impl.num_heads, rep=impl.num_heads // impl.num_kv_heads, scale=scale, softcap=softcap, sinks=sinks,
            tol=tol, dtype=kv_cache.dtype,
            compiled=g.canary.backend == "fused" and compiled_reads(self.geometry[name]),
            floats=floats([(scale, softcap or 0.0, *tol)]),
            sink_logits=None if sinks is None else sinks.float().numpy())

    def _compiled(self, name: str, g: Any, geom: KvGeometry, key: torch.Tensor, value: torch.Tensor,
                  query: torch.Tensor, out3: torch.Tensor, write: bool, plan: LayerPlan | None, c: _Layer) -> None:
        """One layer's write check and audited queries in one compiled call."""
        qt, fl = NO_QUERIES, c.floats
        if plan is not None:
            qt, fl = self._tables.get(name) or self._table(name, c)
        ptrs = np.zeros((1, 4), dtype=np.int64)
        if write:
            ptrs[0, PTR_K], ptrs[0, PTR_V] = key.data_ptr(), value.data_ptr()
        if plan is not None:
            ptrs[0, PTR_Q], ptrs[0, PTR_O] = query.data_ptr(), out3.data_ptr()
        shape = (key.stride(), value.stride(), query.stride(), out3.stride(), key.element_size())
        st = self._strides.get(shape)
        if st is None:
            st = self._strides[shape] = np.array(strides(key, 0, 1, 2) + strides(value, 0, 1, 2)
                                                 + strides(query, 0, 1, 2) + strides(out3, 0, 1, 2), dtype=np.int64)
            assert st.shape == (STRIDE_COLUMNS,)
        steps = self._step_descs.get(g.name)
        if steps is None:
            from kvcanary.fused._step import describe

            steps = describe(g.step)[None]
        self.run_compiled(self._layer_row(name, geom, query.dtype), ptrs, st, steps, qt, fl, False,
                          [self.index[name]], [g.name], geom.token_bytes)

    def _table(self, name: str, c: _Layer) -> tuple[np.ndarray, np.ndarray]:
        """One layer's query table and floats (:mod:`kvcanary.audit.tables`) from the forward's queries
        of that layer and the layer's constants (the layer is row 0 of its own layer table)."""
        assert self.fa is not None
        picked = [i for i, q in enumerate(self.fa.queries) if q.layer == c.number]
        window = self.groups[name].plan.window
        sinks = c.sink_logits
        qt, sink_logits = query_table([self.fa.queries[i] for i in picked], lambda q: 0, lambda q: c.rep,
                                      lambda q: window,
                                      (lambda q: float(sinks[q.head])) if sinks is not None else (lambda q: None),
                                      4, picked)
        return qt, floats([(c.scale, c.softcap or 0.0, *c.tol)], sink_logits)

    def _layer_row(self, name: str, geom: KvGeometry, query_dtype: torch.dtype) -> np.ndarray:
        """The compiled loop's layer table of one layer (made again when its cache moved)."""
        got = self._rows.get(name)
        ptr = geom.tensor.data_ptr()
        if got is None or got[0] != ptr:
            got = self._rows[name] = (ptr, np.array([self.layer_row(geom, 0, query_dtype)], dtype=np.int64))
        return got[1]

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "audit_forwards_one_call": self.one_call, "audit_plans_reused": self.reused,
                "audit_layers_skipped": self.skipped,
                "audit_layers_torch": self.torch_layers, "content_folded_in_layers": self.folded}

    def close(self) -> None:
        self._unset()
        for name in [n for n, a in REGISTRY.items() if a is self]:
            del REGISTRY[name]

