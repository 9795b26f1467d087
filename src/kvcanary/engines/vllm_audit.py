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
    """The write check and read audit of one worker's connector."""

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
        self.token_bytes: dict[str, int] = {}  # layer -> a token's K and V bytes in its cache
        self.plans: dict[int, LayerPlan] = {}  # by the layer's index
        self.write_tokens: tuple[np.ndarray, torch.Tensor] | None = None
        self._views: dict[tuple[int, str], tuple[Callable[..., Any], ...]] = {}
        self.index: dict[str, int] = {}  # layer name -> its number in the records' "layer" field
        self._cdesc: dict[str, tuple[int, np.ndarray]] = {}
        self._rows: dict[str, tuple[int, np.ndarray]] = {}
        self._consts: dict[str, tuple[Any, ...]] = {}  # layer -> (rep, scale, soft-cap, tolerance, sinks), once seen
        self._tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # this forward's compiled tables by layer
        self._step_descs: dict[str, np.ndarray] = {}
        self._strides: dict[tuple[Any, ...], np.ndarray] = {}
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
                    # a token's K and V bytes in this layer's cache (its tensor holds every slot of the group)
                    kv = kv_caches[name]
                    self.token_bytes[name] = kv.numel() * kv.element_size() // max(1, g.canary.num_slots)
                    REGISTRY[name] = self

    def begin(self, live: list[Any], rows: Any) -> None:
        """Plan this forward's write checks and audited queries from the steps' host values."""
        self.fa, self.plans, self.write_tokens = None, {}, None
        self._tables, self._step_descs = {}, {}
        if not self.on or not live or self.conn.forwards % self.conn.config.audit_every:
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
        if any(g.canary.backend == "fused" for g in live):  # the compiled loop's tables, for each layer's call
            self._step_descs = {g.name: _loops().step_desc(g.step)[None] for g in live}
            for name in (n for n in layers if self.index[n] in self.plans):
                known = self._consts.get(name)
                if known is not None:
                    self._tables[name] = _table(self.plans[self.index[name]].qt, *known)
        s = len(queries)
        self.fa = self.auditor.begin(ForwardAudit(
            self.conn.forwards, qsl, cached, {g.name: g.step.new_slots for g in live}, queries,
            np.full(s, -1.0), np.zeros(s, dtype=np.int64), np.zeros(s)))  # type: ignore[arg-type]
        if self.write_check and total:
            n = total
            budget = self.conn.config.budget_for("cpu")
            if budget is not None:
                # the engine's own K and V bytes per token (the canary's content layout reads none
                # with content="none")
                row = max([self.token_bytes.get(name, 0) for name in layers] + [1])
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
        self.fa = None  # this forward's audit is dropped
        self.auditor.failed(self.conn, e)

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
        write = self.write_tokens is not None and getattr(impl, "kv_sharing_target_layer_name", None) is None
        plan = self.plans.get(self.index[name])
        window = impl.sliding_window if impl.sliding_window and impl.sliding_window > 0 else None
        # a layer whose window is not its group's is not audited, nor ALiBi
        if plan is not None and (getattr(impl, "alibi_slopes", None) is not None or window != g.plan.window):
            plan = None
        rep = impl.num_heads // impl.num_kv_heads
        out3 = output.view(output.shape[0], impl.num_heads, -1)
        softcap = impl.logits_soft_cap if impl.logits_soft_cap else None
        sinks = impl.sinks.detach() if getattr(impl, "sinks", None) is not None else None
        tol = self.auditor.tolerance_for(query.dtype)
        dt = kv_cache.dtype
        if (g.canary.backend == "fused" and self.isa[name] in ("vec", "vec16") and dt in DTYPES
                and key.dtype == value.dtype == query.dtype == out3.dtype == dt):
            self._compiled(name, g, kv_cache, key, value, query, out3, write, plan, rep, softcap, sinks, tol,
                           float(impl.scale))
            return
        k_at, v_at = self._readers(name, kv_cache)  # the torch reference's typed views
        if write:
            host, toks = self.write_tokens  # type: ignore[misc]
            slots = g.step.new_slots[toks]
            s = slots.clamp(min=0)
            half_t, head_t = write_mismatch(key[toks], value[toks], k_at(s), v_at(s))
            fa.writes.append(Writes([self.index[name]], [g.name], host, torch.where(slots >= 0, half_t, 0)[None],
                                    head_t[None]))
            self._count_writes(len(host), key, kv_cache)
        if plan is None:
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

    def _readers(self, name: str, kv_cache: torch.Tensor) -> tuple[Callable[..., Any], ...]:
        key = (kv_cache.data_ptr(), self.isa[name])
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = kv_views(kv_cache, self.isa[name])
        return views

    def _count_writes(self, n: int, key: torch.Tensor, kv_cache: torch.Tensor) -> None:
        c = self.auditor.counts
        c["write_slots_checked"] += n
        c["write_bytes_checked"] += n * 2 * key[0].numel() * kv_cache.element_size()

    def _compiled(self, name: str, g: Any, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  query: torch.Tensor, out3: torch.Tensor, write: bool, plan: LayerPlan | None, rep: int,
                  softcap: float | None, sinks: torch.Tensor | None, tol: tuple[float, float], scale: float) -> None:
        """One layer's write check and audited queries in one compiled call
        (:func:`kvcanary.fused.audit.check_forward`, one layer)."""
        fa = self.fa
        assert fa is not None
        host = self.write_tokens[0] if write and self.write_tokens is not None else _NO_TOKENS
        consts = (rep, scale, softcap or 0.0, tol, None if sinks is None else sinks.float().numpy())
        self._consts[name] = consts
        qt, fl = _NO_QUERIES, np.array([scale, softcap or 0.0, *tol])
        if plan is not None:
            qt, fl = self._tables.get(name) or _table(plan.qt, *consts)
        ptrs = np.array([[key.data_ptr() if write else 0, value.data_ptr() if write else 0,
                          query.data_ptr() if plan is not None else 0, out3.data_ptr() if plan is not None else 0]],
                        dtype=np.int64)
        shape = (key.stride(), value.stride(), query.stride(), out3.stride(), key.element_size())
        strides = self._strides.get(shape)
        if strides is None:
            strides = self._strides[shape] = np.array(_strides(key) + _strides(value) + _strides(query)
                                                      + _strides(out3), dtype=np.int64)
        half = np.zeros((1, len(host)), dtype=np.int64)
        head = np.zeros_like(half)
        steps = self._step_descs.get(g.name)
        if steps is None:
            steps = _loops().step_desc(g.step)[None]
        _loops().check_forward(self._layer_row(name, g, kv_cache), ptrs, strides, steps, host, qt, fl, half, head,
                               fa.err, fa.shift, fa.tol, False)
        if write:
            fa.writes.append(Writes([self.index[name]], [g.name], host, half, head))
            self._count_writes(len(host), key, kv_cache)

    def _layer_row(self, name: str, g: Any, kv: torch.Tensor) -> np.ndarray:
        """The compiled loop's constants of a layer (``layers`` of :func:`kvcanary.fused.audit.check_forward`)."""
        got = self._rows.get(name)
        if got is None or got[0] != kv.data_ptr():
            _, hkv, bs, two_d = kv.shape
            code = DTYPES[kv.dtype]
            row = self._descs(name, kv).tolist() + [0, code, kv.element_size(), hkv, two_d // 2,
                                                    kv.shape[0] * bs - 1, code]
            got = self._rows[name] = (kv.data_ptr(), np.array([row], dtype=np.int64))
        return got[1]

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


def _table(qt8: np.ndarray, rep: int, scale: float, softcap: float, tol: tuple[float, float],
           sinks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """One layer's query table and floats for :func:`kvcanary.fused.audit.check_forward` from its
    plan's (:class:`kvcanary.audit.LayerPlan`) and the layer's constants."""
    n = len(qt8)
    qt = np.empty((n, 11), dtype=np.int64)
    qt[:, 0] = qt8[:, 0]
    qt[:, 1] = 0
    qt[:, 2:5] = qt8[:, 1:4]
    qt[:, 5] = qt8[:, 3] // rep
    qt[:, 6:9] = qt8[:, 5:8]
    qt[:, 9] = np.arange(4, 4 + n) if sinks is not None else -1
    qt[:, 10] = np.arange(n)
    fl = np.empty(4 + (n if sinks is not None else 0))
    fl[:4] = scale, softcap, *tol
    if sinks is not None:
        fl[4:] = sinks[qt8[:, 3]]
    return qt, fl


_NO_TOKENS = np.zeros(0, dtype=np.int64)
_NO_QUERIES = np.zeros((0, 11), dtype=np.int64)


def _strides(t: torch.Tensor) -> list[int]:
    """A ``[tokens, heads, dim]`` tensor's strides in bytes."""
    es = t.element_size()
    return [x * es for x in t.stride()]


def _loops() -> Any:
    """The compiled loops (imported on first use)."""
    from kvcanary.fused import audit

    return audit
