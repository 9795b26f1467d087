"""vLLM (CPU build): the write check and the read audit (:mod:`kvcanary.audit`) inside each
attention layer's forward.

vLLM's CPU attention writes a layer's new K and V into its cache (``do_kv_cache_update``) before
the layer's attention runs (``CPUAttentionBackendImpl.forward``). One class-level patch of that
forward, installed by the worker-side connector, runs the engine's attention, then, for the
layers of the KV cache groups the canary covers:

- compares the K and V the layer computed (the forward's ``key`` and ``value``, the inputs of the
  cache-write op) bit for bit with the cache rows at the new tokens' slots (``slot_mapping``);
- recomputes the forward's sampled queries of that layer in fp32 from the cache at the slots of the
  group's verified step table, with the layer's own scale, window, soft-cap and sinks, and compares
  them with the engine's output rows.

The cache is read through typed views of the CPU kernels' layouts (``vec``/``vec16``: K stored
``[D, block]`` and V ``[block, D]`` per block and head; ``amx``: bf16 in 16-token tiles). Layers
the canary does not cover, draft-model layers, KV-sharing layers (no write of their own) and
non-causal or ALiBi attention are passed through unchecked.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import time
from typing import Any, Callable

import numpy as np
import torch

from kvcanary.audit import (DTYPES, Auditor, ForwardAudit, LayerPlan, Query, Writes, cache_desc, check_layer, plan_layers,
                            rows_desc, write_mismatch)

log = logging.getLogger("kvcanary")
REGISTRY: dict[str, "VllmAudit"] = {}  # layer name -> the audit of the canary that covers it
# fault injection only (kvcanary.faults.vllm): wraps every layer's attention, audited or not, as
# tap(original, impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
TAPS: dict[str, Callable[..., Any]] = {}
_ORIGINAL: dict[str, Callable[..., Any]] = {}


def install() -> None:
    """Patch ``CPUAttentionBackendImpl.forward`` once per process (idempotent)."""
    if _ORIGINAL:
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    _ORIGINAL["forward"] = CPUAttentionBackendImpl.forward

    def forward(impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: Any = None, *args: Any, **kwargs: Any) -> Any:
        original = _ORIGINAL["forward"]
        tap = TAPS.get("forward")
        if tap is not None:
            original = functools.partial(tap, original)
        audit = REGISTRY.get(getattr(layer, "layer_name", ""))
        if audit is None or attn_metadata is None or audit.fa is None:
            return original(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        return audit.layer(original, impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)

    CPUAttentionBackendImpl.forward = forward


def kv_views(kv: torch.Tensor, isa: str) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """Readers of one layer's cache ``[blocks, Hkv, block, 2D]``: ``k(slots)`` and ``v(slots)``
    give the rows ``[*slots.shape, Hkv, D]`` of those slots in the cache dtype, and ``k(slots,
    heads)`` (``heads`` shaped as ``slots``) each slot's row of its head, ``[*slots.shape, D]``."""
    nb, hkv, bs, two_d = kv.shape
    d = two_d // 2
    s0, s1, base = kv.stride(0), kv.stride(1), kv.storage_offset()
    if kv.stride(2) != two_d or kv.stride(3) != 1:
        raise ValueError(f"vLLM CPU KV cache: expected rows of 2 * head_dim contiguous elements, got strides {kv.stride()}")
    every = slice(None)
    if isa in ("vec", "vec16"):
        kview = kv.as_strided((nb, hkv, d, bs), (s0, s1, bs, 1), base)  # K: [D, block] per block and head
        vview = kv.as_strided((nb, hkv, bs, d), (s0, s1, d, 1), base + bs * d)  # V: [block, D] after it

        def k(slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
            return kview[torch.div(slots, bs, rounding_mode="floor"), every if heads is None else heads, :, slots % bs]

        def v(slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
            return vview[torch.div(slots, bs, rounding_mode="floor"), every if heads is None else heads, slots % bs, :]

        return k, v
    if isa == "amx":  # bf16: K in 16-token tiles of dimension pairs, V in 16-dimension strips of token pairs
        kview = kv.as_strided((nb, hkv, bs // 16, 16, d // 2, 2), (s0, s1, 16 * d, 2, 32, 1), base)
        vview = kv.as_strided((nb, hkv, bs // 2, 2, d // 16, 16), (s0, s1, 32, 1, 16 * bs, 2), base + bs * d)

        def k(slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
            b, t = torch.div(slots, bs, rounding_mode="floor"), slots % bs
            rows = kview[b, every if heads is None else heads, torch.div(t, 16, rounding_mode="floor"), t % 16]
            return rows.reshape(*slots.shape, *(() if heads is not None else (hkv,)), d)

        def v(slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
            b, t = torch.div(slots, bs, rounding_mode="floor"), slots % bs
            rows = vview[b, every if heads is None else heads, torch.div(t, 2, rounding_mode="floor"), t % 2]
            return rows.reshape(*slots.shape, *(() if heads is not None else (hkv,)), d)

        return k, v
    raise ValueError(f"vLLM CPU attention kernels {isa!r}: expected 'vec', 'vec16' or 'amx'")


class VllmAudit:
    """The write check and read audit of one worker's connector.

    """

    def __init__(self, conn: Any, heads: int) -> None:
        cfg = conn.config
        self.conn = conn
        self.auditor = Auditor(cfg.audit_queries, cfg.audit_tolerance)
        self.write_check = cfg.write_check
        self.on = cfg.mode != "off" and (cfg.write_check or cfg.audit_queries > 0)
        self.heads = max(1, heads)
        self.fa: ForwardAudit | None = None
        self.groups: dict[str, Any] = {}  # layer name -> its _Group
        self.isa: dict[str, str] = {}
        self.plans: dict[int, LayerPlan] = {}  # by the layer's index
        self.write_tokens: tuple[np.ndarray, torch.Tensor] | None = None
        self.failed = 0
        self._views: dict[tuple[int, str], tuple[Callable[..., Any], ...]] = {}
        self.index: dict[str, int] = {}  # layer name -> its number in the records' "layer" field
        self._cdesc: dict[str, tuple[int, np.ndarray]] = {}
        self._wturn = 0

    def register(self, groups: list[Any], isa_of: Callable[[torch.Tensor], str], kv_caches: dict[str, torch.Tensor]) -> None:
        """The covered groups' layers, checked from now on (``isa_of``: a cache's CPU kernels)."""
        if not self.on:
            return
        install()
        for g in groups:
            for name in g.plan.layers:
                if name in kv_caches:
                    self.groups[name] = g
                    found = re.search(r"layers\.(\d+)\.", name)
                    self.index[name] = int(found.group(1)) if found else len(self.index)
                    self.isa[name] = isa_of(kv_caches[name])
                    REGISTRY[name] = self

    def begin(self, live: list[Any], rows: Any) -> None:
        """Plan this forward's write checks and audited queries from the steps' host values."""
        self.fa, self.plans, self.write_tokens = None, {}, None
        if not self.on or not live:
            return
        step = live[0].step
        qsl = step.new_offsets.long().numpy()
        cached = step.cached_lens.long().numpy()
        q = qsl[1:] - qsl[:-1]
        valid = np.asarray(rows.valid.numpy(), dtype=bool)[: len(q)]
        total = int(qsl[-1])
        layers = [n for g in live for n in g.plan.layers if n in self.groups]
        queries: list[Query] = []
        for li, r, off, head in self.auditor.pick(list(range(len(layers))), (q * valid).tolist(), self.heads):
            name = layers[li]
            queries.append(Query(self.index[name], r, int(qsl[r] + off), head, int(cached[r] + off), int(cached[r]),
                                 self.groups[name].name))
        windows = {self.index[n]: self.groups[n].plan.window for n in layers}
        self.plans = plan_layers(queries, windows, torch.device("cpu"))
        s = len(queries)
        self.fa = self.auditor.begin(ForwardAudit(
            self.conn.forwards, qsl, cached, {g.name: g.step.new_slots for g in live}, queries,
            np.full(s, -1.0), np.zeros(s, dtype=np.int64), np.zeros(s)))  # type: ignore[arg-type]
        if self.write_check and total:
            n = total
            budget = self.conn.config.budget_for("cpu")
            if budget is not None:
                row = max(g.canary.layout.sources[0].row_bytes * 2 for g in live if g.canary.layout.sources)
                n = min(total, max(1, budget // (row * max(1, len(layers)))))
            toks = (self._wturn + np.arange(n)) % total
            self._wturn = int((self._wturn + n) % total)
            self.write_tokens = (toks, torch.from_numpy(toks))

    def end(self) -> None:
        self.fa = None

    def drain(self) -> list:
        return self.auditor.drain()

    # ---- inside the forward -----------------------------------------------------------------------

    def layer(self, original: Callable[..., Any], impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, kv_cache: torch.Tensor, md: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(impl, layer, query, key, value, kv_cache, md, output, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            self._check(impl, layer, query, key, value, kv_cache, md, out if out is not None else output)
        except Exception as e:
            self._failed(e)
        finally:
            self.conn.seconds += time.perf_counter() - t0
        return out

    def _failed(self, e: Exception) -> None:
        """The audit's own failure: this forward's audit is dropped; counted and logged outside
        ``raise`` mode, raised into the forward in it."""
        self.fa = None
        if self.conn.config.mode == "raise":
            self.conn.pending = e
            raise e
        self.failed += 1
        self.conn.internal_errors += 1
        log.error("kvcanary internal error in the attention audit (counted, not raised)",
                  exc_info=e if self.failed <= 3 else None)

    def _check(self, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor, md: Any, output: torch.Tensor) -> None:
        from vllm.v1.attention.backend import AttentionType

        name = layer.layer_name
        g = self.groups.get(name)
        fa = self.fa
        if g is None or fa is None or g.step is None or getattr(impl, "attn_type", None) != AttentionType.DECODER:
            return
        if not getattr(md, "causal", True) or getattr(md, "dynamic_causal", None) is not None:
            return
        key_views = (kv_cache.data_ptr(), self.isa[name])
        views = self._views.get(key_views)
        if views is None:
            views = self._views[key_views] = kv_views(kv_cache, self.isa[name])
        k_at, v_at = views
        fused = g.canary.backend == "fused" and self.isa[name] in ("vec", "vec16") and kv_cache.dtype in DTYPES
        if self.write_tokens is not None and getattr(impl, "kv_sharing_target_layer_name", None) is None:
            host, toks = self.write_tokens
            n = len(host)
            if fused and key.dtype == kv_cache.dtype and value.dtype == kv_cache.dtype:
                half, head = np.empty((1, n), dtype=np.int64), np.empty((1, n), dtype=np.int64)
                es = key.element_size()
                ks, vs = key.stride(), value.stride()
                _loops().write_compare(np.array([[key.data_ptr(), value.data_ptr()]], dtype=np.int64),
                                       np.array([ks[0] * es, ks[1] * es, ks[2] * es, vs[0] * es, vs[1] * es, vs[2] * es],
                                                dtype=np.int64),
                                       self._descs(name, kv_cache)[None], np.zeros(1, dtype=np.int64),
                                       g.step.new_slots.numpy()[host][None], host, es, key.shape[1], key.shape[2], half,
                                       head)
            else:
                slots = g.step.new_slots[toks]
                s = slots.clamp(min=0)
                half_t, head_t = write_mismatch(key[toks], value[toks], k_at(s), v_at(s))
                half, head = torch.where(slots >= 0, half_t, 0)[None], head_t[None]
            fa.writes.append(Writes([self.index[name]], [g.name], host, half, head))
            c = self.auditor.counts
            c["write_slots_checked"] += n
            c["write_bytes_checked"] += n * 2 * key[0].numel() * kv_cache.element_size()
        plan = self.plans.get(self.index[name])
        if plan is None or getattr(impl, "alibi_slopes", None) is not None:
            return
        window = impl.sliding_window if impl.sliding_window and impl.sliding_window > 0 else None
        if window != g.plan.window:  # a layer whose window is not its group's: not audited
            return
        rep = impl.num_heads // impl.num_kv_heads
        out3 = output.view(output.shape[0], impl.num_heads, -1)
        softcap = impl.logits_soft_cap if impl.logits_soft_cap else None
        sinks = impl.sinks.detach() if getattr(impl, "sinks", None) is not None else None
        tol = self.auditor.tolerance_for(query.dtype)
        if fused and query.dtype in DTYPES and out3.dtype == query.dtype:
            qt = np.zeros((len(plan.qt), 11), dtype=np.int64)
            qt[:, [0, 2, 3, 4, 6, 7, 8]] = plan.qt[:, [0, 1, 2, 3, 5, 6, 7]]
            qt[:, 5] = qt[:, 4] // rep
            qt[:, 9] = np.arange(len(qt)) + 4 if sinks is not None else -1
            desc = np.array([self._descs(name, kv_cache).tolist() + rows_desc(query, 0, 1, 2) + rows_desc(out3, 0, 1, 2)
                             + [DTYPES[kv_cache.dtype], DTYPES[query.dtype], query.shape[2],
                                kv_cache.shape[0] * g.plan.block_size - 1, 0, 0]], dtype=np.int64)
            fl = np.zeros(4 + len(qt))
            fl[:4] = float(impl.scale), softcap or 0.0, *tol
            if sinks is not None:
                fl[4:] = sinks.float().numpy()[qt[:, 4]]
            _loops().audit_queries(desc, _loops().step_desc(g.step)[None], qt, fl, fa.err, fa.shift, fa.tol)
            return
        shape = plan.grid.shape
        slots = g.step.lookup(plan.row[:, None].expand(shape).reshape(-1), plan.grid.reshape(-1)).view(shape)
        kvh = (plan.head // rep)[:, None].expand(shape)
        bs = g.plan.block_size
        limit = kv_cache.shape[0] * bs - 1

        def read(slots: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
            s = torch.where(plan.old, slots + shift * bs, slots).clamp(0, limit)
            return k_at(s, kvh), v_at(s, kvh)

        err, sh, tl = torch.from_numpy(fa.err), torch.from_numpy(fa.shift), torch.from_numpy(fa.tol)
        view = dataclasses.replace(fa, err=err, shift=sh, tol=tl)  # the torch reference writes through these
        check_layer(view, plan, slots, query[plan.token, plan.head], out3[plan.token, plan.head], read,
                    float(impl.scale), softcap, sinks[plan.head] if sinks is not None else None, tol)

    def _descs(self, name: str, kv: torch.Tensor) -> np.ndarray:
        """The compiled loops' descriptors of a layer's cache K and V (``vec``/``vec16``), by slot."""
        got = self._cdesc.get(name)
        if got is None or got[0] != kv.data_ptr():
            _, hkv, bs, two_d = kv.shape
            d, es = two_d // 2, kv.element_size()
            s0, s1, base = kv.stride(0) * es, kv.stride(1) * es, kv.data_ptr()
            k = cache_desc(base, bs, s0, es, s1, bs * es)  # K: [D, block] per block and head
            v = cache_desc(base + bs * d * es, bs, s0, d * es, s1, es)  # V: [block, D] after it
            got = self._cdesc[name] = (kv.data_ptr(), np.array(k + v, dtype=np.int64))
        return got[1]

    def stats(self) -> dict[str, int]:
        return self.auditor.stats()

    def close(self) -> None:
        for name in [n for n, a in REGISTRY.items() if a is self]:
            del REGISTRY[name]


def _loops() -> Any:
    """The compiled loops (imported on first use)."""
    from kvcanary.fused import audit

    return audit
