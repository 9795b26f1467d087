"""SGLang's torch-native attention: the write check and the read audit (:mod:`kvcanary.audit`)
inside each protected forward.

One class-level wrap of ``TorchNativeAttnBackend.forward_extend`` and ``.forward_decode`` (each layer's
computed ``q``, ``k``, ``v``, the ``RadixAttention`` layer and the output ``o``, after the backend
wrote K and V into the pool and read the whole row back) feeds it. Each layer's computed K and V
are compared bit for bit with the pool's rows at their tokens' ``out_cache_loc`` slots, and the
forward's sampled queries are recomputed from the pool at the slots of the verified step (SGLang's
``req_to_token``), with the layer's own scale and sliding window (``sliding_window_size + 1``
positions: the backend's mask). The backend applies no logit soft-cap (it calls SDPA with the
scale only), so the audit checks the attention it computes, and says once that a model's
``logit_cap`` is left out.

On a CPU pool (the fused backend) both checks run in the compiled loop
(:mod:`kvcanary.fused.audit`): a forward of at most :data:`DEFER_TOKENS` new tokens keeps
references to each layer's tensors and checks every layer in one call after the forward; a larger
one checks each layer in one call as it goes. Elsewhere (a CUDA pool) the torch reference runs each
layer's checks as it goes, with device ops only: nothing is read on the host until the results are
drained after the forward.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import numpy as np
import torch

from kvcanary.audit.budget import shape_class
from kvcanary.audit.records import LayerPlan, plan_layers
from kvcanary.audit.tables import PTR_K, PTR_O, PTR_Q, PTR_V, S_K, S_O, S_Q, S_V, STRIDE_COLUMNS, floats, \
    query_table, strides
from kvcanary.engines.audit import NO_QUERIES, EngineAudit
from kvcanary.geometry.base import KvGeometry
from kvcanary.step import Step

log = logging.getLogger("kvcanary")
DEFER_TOKENS = 256  # forwards of at most this many new tokens are checked after the forward, from references


class Layer:
    """What the checks need of one ``RadixAttention`` layer, read once: its number, geometry, query
    heads per KV head, scale and window (``None``: full attention)."""

    def __init__(self, attn: Any, geometry: KvGeometry) -> None:
        self.id = int(attn.layer_id)
        self.geometry = geometry
        self.heads = int(attn.tp_q_head_num)
        self.rep = max(1, self.heads // int(attn.tp_k_head_num))
        self.dim = int(attn.qk_head_dim)
        self.scale = float(attn.scaling)
        sws = getattr(attn, "sliding_window_size", None)
        self.window: int | None = int(sws) + 1 if sws is not None and int(sws) > -1 else None
        self.logit_cap = float(getattr(attn, "logit_cap", 0.0) or 0.0)


class SglangAudit(EngineAudit):
    """The write check and read audit of the SGLang adapter over one pool.

    Parameters
    ----------
    adapter : the adapter (its ``config``, failures, canary time)
    attns : the model's ``RadixAttention`` layers
    geometries : each pool layer's geometry, by layer number
    group : the name the pool's records carry
    fused : whether the compiled loop runs the checks (a CPU pool on the fused backend)
    """

    def __init__(self, adapter: Any, attns: list[Any], geometries: Sequence[KvGeometry], group: str,
                 fused: bool) -> None:
        layers = {int(a.layer_id): Layer(a, geometries[int(a.layer_id)]) for a in attns}
        super().__init__(adapter, max((x.heads for x in layers.values()), default=1))
        self.layers = layers
        self.order = sorted(layers)
        self.group = group
        self.fused = fused
        self.step: Step | None = None
        self.plans: dict[int, LayerPlan | None] = {}
        self.kept: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> its q, k, v, o (the deferred check)
        self.deferred = False
        self._qt: np.ndarray | None = None
        capped = sorted({x.logit_cap for x in layers.values() if x.logit_cap})
        if capped and self.on:
            log.warning("kvcanary: SGLang's torch-native attention leaves the model's logit soft-cap (%s) out; the "
                        "audit checks the attention it computes, without it", capped[0])
        if fused and layers:
            self._tables()

    def _tables(self) -> None:
        """The compiled loop's constants: the layer table, each layer's floats, one step row."""
        from kvcanary.fused._step import DESC_LEN

        infos = [self.layers[i] for i in self.order]
        self.index = {layer: i for i, layer in enumerate(self.order)}
        dtype = infos[0].geometry.dtype  # the model's: its queries and outputs come in it
        self.dtype = dtype
        self.table = np.array([self.layer_row(x.geometry, 0, dtype) for x in infos], dtype=np.int64)
        self.fl = floats([(x.scale, 0.0, *self.auditor.tolerance_for(dtype)) for x in infos])
        self.steps = np.zeros((1, DESC_LEN), dtype=np.int64)

    # ---- per forward --------------------------------------------------------------------------

    def begin(self, step: Step, cached: np.ndarray, q: np.ndarray, rids: list[str], forwards: int) -> None:
        """Plan this forward's write checks and audited queries: host work from each row's ``cached``
        and new (``q``) token counts, the step's on the host (int64 ``[R]``)."""
        t0 = time.perf_counter()
        self.fa, self.step, self.plans, self._qt = None, None, {}, None
        self.write_tokens = self.write_index = None
        self.kept.clear()
        if not self.order or not self.due(forwards):
            return
        cu = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        total = int(cu[-1])
        self.step = step
        self.deferred = self.fused and total <= DEFER_TOKENS
        situation = (shape_class(len(q), bool((q > 1).any())), self.group)
        queries = self.sample(self.order, q, cu, cached, int, lambda layer: self.group, situation=situation,
                              rids=rids)
        if self.fused:
            self._qt, _ = query_table(queries, lambda x: self.index[x.layer], lambda x: self.layers[x.layer].rep,
                                      lambda x: self.layers[x.layer].window, lambda x: None, len(self.fl))
            self.plans = {x.layer: None for x in queries}
        else:
            self.plans = plan_layers(queries, {i: x.window for i, x in self.layers.items()},  # type: ignore[assignment]
                                     step.cached_lens.device)
        self.start(forwards, cu, cached, {self.group: step.new_slots}, queries, step.cached_lens.device,
                   host=self.fused)
        self.pick_writes(total, step.cached_lens.device)
        self.planned(t0)

    def layer(self, attn: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, o: torch.Tensor,
              wrote: bool) -> None:
        """After one layer's attention (its write into the pool done when ``wrote``): its checks now,
        or references to its tensors for the check after the forward."""
        if self.fa is None:
            return
        t0 = time.perf_counter()
        try:
            info = self.layers.get(int(attn.layer_id))
            if info is None:
                return
            heads = q.reshape(q.shape[0], info.heads, info.dim)
            out = o.reshape(o.shape[0], info.heads, info.dim)
            if not (wrote and k is not None and v is not None and self.write_tokens is not None):
                k = v = None
            if self.deferred:
                if k is not None or info.id in self.plans:
                    self.kept[info.id] = (heads, k, v, out)  # type: ignore[assignment]
            elif self.fused:
                self._run({info.id: (heads, k, v, out)})
            else:
                self._reference(info, heads, k, v, out)
        except Exception as e:
            self.failed(e)
        finally:
            self.charge(time.perf_counter() - t0)

    def finish(self) -> None:
        """After the forward: the checks kept for it, in one compiled call."""
        if self.fa is None or not self.kept:
            return
        t0 = time.perf_counter()
        try:
            self._run(self.kept)
        except Exception as e:
            self.failed(e)
        finally:
            self.kept.clear()
            self.spent += time.perf_counter() - t0  # the budget's (the after-forward hook counts the adapter's)

    def end(self) -> None:
        super().end()
        self.kept.clear()
        self.step = None

    def failed(self, e: Exception) -> None:
        self.kept.clear()
        super().failed(e)

    # ---- the checks -----------------------------------------------------------------------------

    def _run(self, kept: dict[int, tuple[Any, ...]]) -> None:
        """The write checks and audited queries of the ``kept`` layers (query heads ``[T, Hq, D]``,
        computed K and V ``[T, Hkv, D]`` or ``None``, outputs ``[T, Hq, D]``) in one compiled call."""
        from kvcanary.fused._step import describe

        assert self.step is not None
        ptrs = np.zeros((len(self.order), 4), dtype=np.int64)
        st = [0] * STRIDE_COLUMNS
        q0 = k0 = None  # the first layer's tensors: their strides are the call's
        for layer, (q, k, v, o) in kept.items():
            i = self.index[layer]
            if q0 is None:
                q0, o0 = q, o
                st[S_Q:S_Q + 3], st[S_O:S_O + 3] = strides(q, 0, 1, 2), strides(o, 0, 1, 2)
            if q.stride() == q0.stride() and o.stride() == o0.stride() and q.dtype == o.dtype == self.dtype:
                ptrs[i, PTR_Q], ptrs[i, PTR_O] = q.data_ptr(), o.data_ptr()
            if k is None or v is None:
                continue
            if k0 is None:
                k0, v0 = k, v
                st[S_K:S_K + 3], st[S_V:S_V + 3] = strides(k, 0, 1, 2), strides(v, 0, 1, 2)
            g = self.layers[layer].geometry
            if k.dtype == v.dtype == g.dtype and k.stride() == k0.stride() and v.stride() == v0.stride():
                ptrs[i, PTR_K], ptrs[i, PTR_V] = k.data_ptr(), v.data_ptr()
            else:  # a cast on the way into the pool, or tensors shaped otherwise: the torch comparison
                self._writes(self.layers[layer], k, v)
        self.steps[0] = describe(self.step)
        # the loop skips the queries of layers without a query address (another call checks them)
        qt = self._qt if self._qt is not None and ptrs[:, PTR_Q].any() else NO_QUERIES
        self.run_compiled(self.table, ptrs, np.array(st, dtype=np.int64), self.steps, qt, self.fl, False,
                          self.order, [self.group] * len(self.order), self.layers[self.order[0]].geometry.token_bytes)

    def _writes(self, info: Layer, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self.write_index is not None and self.step is not None
        idx = self.write_index
        self.check_writes(info.id, self.group, info.geometry, self.step.new_slots[idx], k[idx], v[idx])

    def _reference(self, info: Layer, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                   o: torch.Tensor) -> None:
        """The torch reference: one layer's writes and sampled queries, now."""
        assert self.step is not None
        if k is not None and v is not None:
            self._writes(info, k, v)
        plan = self.plans.get(info.id)
        if plan is not None:
            self.check_queries(plan, self.step, info.geometry, q[plan.token, plan.head], o[plan.token, plan.head],
                               info.rep, info.scale, None, None, self.auditor.tolerance_for(q.dtype))
