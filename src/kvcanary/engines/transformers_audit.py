"""transformers continuous batching: the write check and the read audit (:mod:`kvcanary.audit`)
inside each protected forward.

Two class-level patches feed it: the paged cache's ``update`` (each layer's computed K and V,
before the cache write) and the attention function the model looks up (each layer's query and
attention output, after the cache was written and read). For each layer, after its attention ran:

- the new tokens' K and V are compared with the cache rows at their slots;
- the forward's sampled queries of that layer are recomputed from the cache at the slots of the
  group's verified step table, with the module's own scale, window, sinks and soft-capping (where
  the attention implementation applies them: transformers' ``sdpa`` and ``paged|eager`` kernels
  leave Gemma2's logit soft-capping out, and ``sdpa`` leaves attention sinks out, which is said
  once at the first forward).

The decode fast path (flash attention reading through a block table, on GPUs) is not audited yet:
its forwards are counted apart (``audit_forwards_skipped``) and said once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from kvcanary.audit import Auditor, ForwardAudit, LayerPlan, Query, Writes, check_layer, plan_layer, to_device, write_mismatch

log = logging.getLogger("kvcanary")
Tap = Callable[..., Any]


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
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layer_group: dict[int, Any] = {}
        self.plans: dict[int, LayerPlan] = {}
        self.modules: dict[int, Any] = {}  # layer index -> its attention module
        self.write_tokens: tuple[np.ndarray, torch.Tensor] | None = None
        self.taps: dict[str, Tap] = {}
        self.skipped = 0  # forwards of the decode fast path, not audited
        self.failed = 0  # forwards whose audit failed (an internal error, counted)
        self._wturn = 0
        self._said: set[str] = set()

    # ---- per forward ----------------------------------------------------------------------------

    def groups_changed(self, groups: dict[str, Any]) -> None:
        self.layer_group = {layer: g for g in groups.values() for layer in g.allocator.layer_indices}

    def begin(self, steps: dict[str, Any], reqs: list, batch: dict) -> None:
        """Plan this forward's write checks and audited queries (host work from the requests' lengths)."""
        self.fa, self.plans, self.write_tokens = None, {}, None
        self.stash.clear()
        if not self.on or not steps:
            return
        if batch.get("block_table") is not None:
            self.skipped += 1
            self._say("fast_path", "kvcanary: the decode fast path (attention through a block table) is not audited; "
                      "its forwards are counted as audit_forwards_skipped")
            return
        q = np.array([fs.query_length for fs in reqs], dtype=np.int64)
        past = np.array([fs.state.position_offset - fs.query_length for fs in reqs], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(q)])
        total = int(cu[-1])
        rows = np.repeat(np.arange(len(reqs)), q)
        positions = past[rows] + (np.arange(total) - cu[rows])
        self.steps = steps
        layers = sorted(self.layer_group)
        heads = int(self.prot.model.config.num_attention_heads)
        queries = []
        by_layer: dict[int, list[int]] = {}
        for layer, r, off, head in self.auditor.pick(layers, q.tolist(), heads):
            g = self.layer_group[layer]
            if self.window(layer) is not None:
                off = int(q[r]) - 1  # a window group caches only a prefill's last tokens: the last one's reads
            queries.append(Query(layer, r, int(cu[r] + off), head, int(past[r] + off), int(past[r]), g.name))
            by_layer.setdefault(layer, []).append(len(queries) - 1)
        dev = next(iter(steps.values())).cached_lens.device
        self.plans = {layer: plan_layer(queries, picked, self.window(layer), dev) for layer, picked in by_layer.items()}
        s = len(queries)
        self.fa = self.auditor.begin(ForwardAudit(
            self.prot.forwards, rows, positions, {name: st.new_slots for name, st in steps.items()}, queries,
            torch.full((s,), -1.0, device=dev), torch.zeros(s, dtype=torch.int64, device=dev),
            torch.zeros(s, device=dev)))
        if self.write_check and total:
            n = total
            budget = self.prot.config.budget_for(dev.type)
            if budget is not None:
                row = max(g.canary.layout.sources[0].row_bytes * 2 for g in self.layer_group.values())
                n = min(total, max(1, budget // (row * max(1, len(layers)))))
            toks = (self._wturn + np.arange(n)) % total
            self._wturn = int((self._wturn + n) % total)
            self.write_tokens = (toks, to_device(dev, [toks])[0])

    def window(self, layer: int) -> int | None:
        """The sliding window layer ``layer`` declares: on its module (Gemma, GPT-OSS), else its layer
        group's (Mistral); ``None`` for full attention."""
        m = self.modules.get(layer)
        g = self.layer_group.get(layer)
        return getattr(m, "sliding_window", None) or getattr(getattr(g, "allocator", None), "sliding_window", None)

    def end(self) -> None:
        self.fa = None
        self.stash.clear()
        self.steps = {}

    def drain(self) -> list:
        return self.auditor.drain()

    # ---- inside the forward -----------------------------------------------------------------------

    def update(self, original: Callable[..., Any], cache: Any, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int, kwargs: dict) -> Any:
        """Around the cache update of one layer: keep its computed K and V for the write check."""
        if self.fa is not None:
            self.stash[layer_idx] = (key, value)
        tap = self.taps.get("update")
        if tap is not None:
            return tap(original, cache, key, value, layer_idx, kwargs)
        return original(cache, key, value, layer_idx, kwargs)

    def attention(self, original: Callable[..., Any], module: Any, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, mask: Any, *args: Any, **kwargs: Any) -> Any:
        """Around the attention of one layer: the engine's own, then this layer's checks."""
        tap = self.taps.get("attention")
        out = (tap(original, module, query, key, value, mask, *args, **kwargs) if tap is not None
               else original(module, query, key, value, mask, *args, **kwargs))
        if self.fa is not None:
            t0 = time.perf_counter()
            try:
                with self.prot.work_context():
                    self._layer(module, query, out[0])
            except Exception as e:
                self._failed(e)
            finally:
                self.prot.seconds += time.perf_counter() - t0
        return out

    def _failed(self, e: Exception) -> None:
        """The audit's own failure: this forward's audit is dropped (no stamp depends on it); counted
        and logged outside ``raise`` mode, raised (in the caller's thread too) in it."""
        self.fa = None
        if self.prot.config.mode == "raise":
            self.prot.pending = e
            raise e
        self.failed += 1
        self.prot.internal_errors += 1
        log.error("kvcanary internal error in the attention audit (counted, not raised)",
                  exc_info=e if self.failed <= 3 else None)

    def _layer(self, module: Any, query: torch.Tensor, out: torch.Tensor) -> None:
        layer = int(module.layer_idx)
        g = self.layer_group.get(layer)
        fa = self.fa
        if g is None or fa is None or g.name not in self.steps:
            return
        step = self.steps[g.name]
        k_view, v_view = g.allocator._kv_token_views[layer]  # [physical slots, Hkv, D]
        if self.write_tokens is not None and layer in self.stash:
            self._write(layer, g, step, k_view, v_view)
        plan = self.plans.get(layer)
        if plan is not None:
            self._audit(module, query, out, plan, g, step, k_view, v_view)

    def _physical(self, g: Any, slots: torch.Tensor) -> torch.Tensor:
        s = slots.clamp(min=0)
        return torch.div(s, g.tpp, rounding_mode="floor") * g.stride + s % g.tpp

    def _write(self, layer: int, g: Any, step: Any, k_view: torch.Tensor, v_view: torch.Tensor) -> None:
        assert self.write_tokens is not None and self.fa is not None
        host, toks = self.write_tokens
        k, v = self.stash.pop(layer)
        src_k, src_v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [T, Hkv, D]
        slots = step.new_slots[toks]
        phys = self._physical(g, slots)
        half, head = write_mismatch(src_k[toks], src_v[toks], k_view[phys], v_view[phys])
        self.fa.writes.append(Writes(layer, g.name, host, torch.where(slots >= 0, half, 0), head))
        c = self.auditor.counts
        c["write_slots_checked"] += len(host)
        c["write_bytes_checked"] += len(host) * 2 * k_view[0].numel() * k_view.element_size()

    def _audit(self, module: Any, query: torch.Tensor, out: torch.Tensor, plan: LayerPlan, g: Any, step: Any,
               k_view: torch.Tensor, v_view: torch.Tensor) -> None:
        assert self.fa is not None
        impl = str(getattr(self.prot.model.config, "_attn_implementation", ""))
        softcap = getattr(module, "attn_logit_softcapping", None)
        if softcap is not None and "flash" not in impl:
            self._say("softcap", f"kvcanary: the {impl} attention of {type(module).__name__} leaves the model's logit "
                      f"soft-capping ({softcap}) out; the audit checks the attention it computes, without it")
            softcap = None
        sinks = getattr(module, "sinks", None)
        if sinks is not None and impl == "sdpa":
            self._say("sinks", f"kvcanary: the sdpa attention of {type(module).__name__} leaves the model's attention "
                      "sinks out; the audit checks the attention it computes, without them")
            sinks = None
        shape = plan.grid.shape
        slots = step.lookup(plan.row[:, None].expand(shape).reshape(-1), plan.grid.reshape(-1)).view(shape)
        kvh = (plan.head // (query.shape[1] // k_view.shape[1]))[:, None].expand(shape)
        n = min(k_view.shape[0], v_view.shape[0])
        phys = self._physical(g, slots)

        def read(slots: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
            p = torch.where(plan.old, phys + shift * g.stride, phys).clamp(0, n - 1)
            return k_view[p, kvh], v_view[p, kvh]

        sink = sinks.detach()[plan.head] if sinks is not None else None
        check_layer(self.fa, plan, slots, query[0, plan.head, plan.token], out[0, plan.token, plan.head], read,
                    float(module.scaling), softcap, sink, self.auditor.tolerance_for(query.dtype))

    def _say(self, key: str, text: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(text)

    def stats(self) -> dict[str, int]:
        out = self.auditor.stats()
        out["audit_forwards_skipped"] = self.skipped
        return out
