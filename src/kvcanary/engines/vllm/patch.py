"""vLLM (CPU build): the one class-level patch of ``CPUAttentionBackendImpl.forward`` through which
the write check and read audit (:mod:`kvcanary.engines.vllm.audit`) see each attention layer, and
the registries it reads: the audit that covers each layer (by name), the forward whose plan checks
its layers (by object), the engine's own forward, and fault injection's taps.

A layer the forward's plan has seen in an earlier forward and that writes its own KV without audited
queries takes the plain path (its write check and fold, then the engine's attention); another layer
the plan has seen goes to the plan (:func:`kvcanary.engines.vllm.wide.attend` through
:meth:`~kvcanary.engines.vllm.wide.WideForward.attend`); any other covered layer to its audit by name
(:meth:`~kvcanary.engines.vllm.audit.VllmAudit.layer`); the rest straight to the engine's attention.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

if TYPE_CHECKING:
    from kvcanary.engines.vllm.wide import WideForward


class LayerAudit(Protocol):
    """What the patch asks of a layer's audit (:class:`~kvcanary.engines.vllm.audit.VllmAudit`)."""

    fa: Any  # this forward's audit (None: no forward planned; the layer runs unchecked)

    def layer(self, t0: float, original: Callable[..., Any], impl: Any, layer: Any, query: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, md: Any, output: Any, *args: Any,
              **kwargs: Any) -> Any: ...


REGISTRY: dict[str, LayerAudit] = {}  # layer name -> the audit of the canary that covers it
# fault injection only (kvcanary.faults.vllm): wraps every layer's attention, audited or not, as
# tap(original, impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
TAPS: dict[str, Callable[..., Any]] = {}
ORIGINAL: dict[str, Callable[..., Any]] = {}
# the forward whose checks run in one call after it (VllmAudit.begin sets it, finish clears it): the
# patch hands the layers it has seen by object straight to it, without the lookup by name
ACTIVE: list[WideForward | None] = [None]


def install() -> None:
    """Patch ``CPUAttentionBackendImpl.forward`` once per process (idempotent)."""
    if ORIGINAL:
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    ORIGINAL["forward"] = CPUAttentionBackendImpl.forward

    def forward(impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: Any = None, output_scale: Any = None,
                output_block_scale: Any = None, *args: Any, **kwargs: Any) -> Any:
        # vLLM passes output, output_scale and output_block_scale by keyword: named here, so that the
        # common call (no scales) reaches the engine's attention without a dict of keywords built
        # on the way, twice per layer and forward
        t0 = time.perf_counter()  # the canary's time from here (kvcanary.engines.vllm.wide.attend charges it)
        plan = ACTIVE[0]
        if (plan is not None and attn_metadata is not None and output_scale is None and output_block_scale is None
                and not args and not kwargs and not TAPS):
            # the plain path: a layer that writes its own KV (seen in an earlier forward), not yet seen in
            # this one, without audited queries, with the metadata, K and V strides and dtypes of the layers
            # before it (WideForward.before set them at the forward's first layer): its write check and fold
            # only, with as few Python calls as there can be (each one's code and objects are cache
            # misses after the layer's matrix products, 30 times a forward)
            li = plan.plain_by_layer.get(layer)
            if li is not None and plan.open[li] and attn_metadata is plan.md_plain and output is not None:
                plain = False
                try:
                    if (key.stride() == plan.kst and value.stride() == plan.vst and key.dtype is plan.kdt
                            and value.dtype is plan.vdt):
                        plan.open[li] = 0
                        plan.seen[li] = 1
                        plain = True
                        plan.keep_written(li, key, value)
                except Exception as e:  # the canary's own failure: the plan is withdrawn, the engine runs on
                    plan.audit.failed(e)
                if plain:
                    plan.clock[0] += time.perf_counter() - t0
                    attention: Any = plan.original  # (the engine's, set when the plan was made)
                    return attention(impl, layer, query, key, value, kv_cache, attn_metadata, output)
            got = plan.by_layer.get(layer)
            if got is not None and output is not None and plan.live:  # a layer the plan has seen: checked as planned
                return plan.attend(got, t0, impl, layer, query, key, value, kv_cache, attn_metadata, output)
        original = ORIGINAL["forward"]
        tap = TAPS.get("forward")
        if tap is not None:
            original = functools.partial(tap, original)
        if output_scale is not None or output_block_scale is not None:
            kwargs = {"output_scale": output_scale, "output_block_scale": output_block_scale, **kwargs}
        audit = REGISTRY.get(getattr(layer, "layer_name", ""))
        if audit is None or attn_metadata is None or audit.fa is None:
            return original(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if args or kwargs:
            return audit.layer(t0, original, impl, layer, query, key, value, kv_cache, attn_metadata, output, *args,
                               **kwargs)
        return audit.layer(t0, original, impl, layer, query, key, value, kv_cache, attn_metadata, output)

    CPUAttentionBackendImpl.forward = forward
