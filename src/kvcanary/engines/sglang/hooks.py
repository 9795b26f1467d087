"""The SGLang methods the adapter wraps: class-level wraps installed once per process
(:func:`wrap_all`), doing work only in the scheduler process (where, with one tensor-parallel rank,
the model runner, the KV pool, the ``req_to_token`` table and the radix cache live).

================================================ =================================================
SGLang method                                    what the canary does there
================================================ =================================================
``TpModelWorker.forward_batch_generation``       takes the forward's ``ScheduleBatch``: its
                                                 requests, in the order of the batch's rows
``ModelRunner.forward`` (the target runner)      before: the step from the ``ForwardBatch`` and
                                                 ``req_to_token`` (:mod:`.steps`), every read slot
                                                 verified (a request's first read of cached KV
                                                 byte for byte), the audit planned; after: the
                                                 written slots stamped and fingerprinted, reads of
                                                 them verified, the patrol's share, then report,
                                                 and the hurt requests named (:mod:`.heal`)
``TorchNativeAttnBackend.forward_extend`` and    after each layer's attention: its write check and
``.forward_decode``                              audited queries (:mod:`.audit`)
``Scheduler.process_batch_result``               ``quarantine`` and ``repair``: the hurt requests'
                                                 outputs dropped, each failed or retracted to be
                                                 computed again, poisoned slots evicted from the
                                                 radix cache (:mod:`.heal`)
``TokenToKVPoolAllocator.free`` / ``.clear``     freed slots released (a free group counted once,
                                                 when it ends): a read before a new write is EMPTY
``ReqToTokenPool.free``                          the request left its row: its stream goes
================================================ =================================================

A hook that raises (``raise`` mode only: the others never raise) fails the forward's requests in
their callers' threads (:meth:`~kvcanary.engines.sglang.entry.SglangCanary.deliver`), never SGLang's
scheduler.
"""

from __future__ import annotations

from typing import Any, Callable

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def wrap_all(ad: Any) -> None:
    """Wrap SGLang's methods for adapter ``ad`` (once per process)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.model_runner import ModelRunner

    wrap(TpModelWorker, "forward_batch_generation", taking_batch(ad))
    wrap(ModelRunner, "forward", checking_forward(ad))
    wrap(TorchNativeAttnBackend, "forward_extend", auditing(ad))
    wrap(TorchNativeAttnBackend, "forward_decode", auditing(ad))
    wrap(Scheduler, "process_batch_result", settling(ad))
    wrap(TokenToKVPoolAllocator, "free", lambda orig: after(orig, ad, ad.on_free))
    wrap(TokenToKVPoolAllocator, "clear", lambda orig: after(orig, ad, ad.on_clear))
    wrap(ReqToTokenPool, "free", lambda orig: before_row_free(orig, ad))


def wrap(cls: type, name: str, make: Wrapper) -> None:
    orig = getattr(cls, name)
    fn = make(orig)
    fn.__wrapped__ = orig  # type: ignore[attr-defined]
    fn.__name__ = name
    setattr(cls, name, fn)


def delivered(ad: Any, fn: Callable[..., Any], *args: Any) -> None:
    """Run a hook; what it raises (``raise`` mode only) goes to the forward's callers."""
    try:
        fn(*args)
    except Exception as e:
        ad.deliver(e)


def taking_batch(ad: Any) -> Wrapper:
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def forward_batch_generation(self: Any, batch: Any = None, *a: Any, **k: Any) -> Any:
            ad.batch = batch
            try:
                return orig(self, batch, *a, **k)
            finally:
                ad.batch = None

        return forward_batch_generation

    return make


def checking_forward(ad: Any) -> Wrapper:
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def forward(self: Any, forward_batch: Any, *a: Any, **k: Any) -> Any:
            if not ad.watches(self):
                return orig(self, forward_batch, *a, **k)
            delivered(ad, ad.before_forward, forward_batch)
            out = orig(self, forward_batch, *a, **k)
            delivered(ad, ad.after_forward)
            return out

        return forward

    return make


def auditing(ad: Any) -> Wrapper:
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def forward(self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True,
                    *a: Any, **kw: Any) -> Any:
            o = orig(self, q, k, v, layer, forward_batch, save_kv_cache, *a, **kw)
            if ad.step is not None:
                delivered(ad, ad.attention, layer, q, k, v, o, bool(save_kv_cache))
            return o

        return forward

    return make


def settling(ad: Any) -> Wrapper:
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def process_batch_result(self: Any, batch: Any, result: Any, *a: Any, **k: Any) -> Any:
            return ad.settle(self, batch, lambda: orig(self, batch, result, *a, **k))

        return process_batch_result

    return make


def after(orig: Callable[..., Any], ad: Any, then: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, *a: Any, **k: Any) -> Any:
        out = orig(self, *a, **k)
        delivered(ad, then, self, *a)
        return out

    return wrapper


def before_row_free(orig: Callable[..., Any], ad: Any) -> Callable[..., Any]:
    def free(self: Any, req: Any, *a: Any, **k: Any) -> Any:
        delivered(ad, ad.on_row_free, req)
        return orig(self, req, *a, **k)

    return free
