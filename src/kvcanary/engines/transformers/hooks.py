"""transformers continuous batching: the class-level patches that bracket each forward, and the
small runtime helpers the protection uses (which IO holds the batch, host-to-device transfer,
the forward's stream). transformers is imported inside functions only.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import torch


def host_io(io: Any) -> Any:
    """The IO object holding the current batch's host-side state (async batching keeps a pair)."""
    return io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io


def to_device(dev: torch.device, *tensors: torch.Tensor | None) -> tuple[Any, ...]:
    """Host tensors on ``dev``: through pinned memory and without waiting, on an accelerator."""
    if dev.type == "cpu":
        return tensors
    return tuple(None if t is None else t.pin_memory().to(dev, non_blocking=True) for t in tensors)


class canary_work:
    """Around the canary's work in a forward (a context manager): on the forward's own stream (so it is
    ordered with the forward, drains of the ring included), on one intra-op thread.

    The continuous-batching forward runs in a worker thread, where a small op fanned out to the
    intra-op pool costs several times its work (76 us instead of 10 us for a 2k-element
    repeat_interleave on the 2-core machines here). The forward itself is not running meanwhile.
    Where the process already runs one intra-op thread on a CPU (no stream), nothing is set: a
    class, not a generator, since it brackets every hook of every forward (4 us a use as a
    generator, called in a loop).
    """

    __slots__ = ("stream", "threads", "ctx")

    def __init__(self, stream: Any) -> None:
        self.stream, self.threads = stream, 1
        self.ctx: Any = None

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        if self.threads != 1:
            torch.set_num_threads(1)
        if self.stream is not None:
            self.ctx = torch.cuda.stream(self.stream)
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.ctx is not None:
                self.ctx.__exit__(*exc)
                self.ctx = None
        finally:
            if self.threads != 1:
                torch.set_num_threads(self.threads)


# ---- class-level patches (the CB processor is built inside its worker thread) ---------------

ACTIVE: dict[int, Any] = {}  # model id -> Protection
BY_CACHE: dict[int, Any] = {}  # by the KV pool's storage, which the cache and its allocators share
BY_POOL: dict[int, Any] = {}  # by the id of the cache's block pool (the CPU tier has a pool of its own)
AUDITED: dict[int, Any] = {}  # by the id of a protected model's attention module: its CbAudit
# the forward whose every layer's computed K and V are kept for the write check after it (set by
# CbAudit.begin, cleared when its checks end): the cache tensor it protects, the dict the references go
# into, and the seconds the cache update's direct path spends, in a one-element list the audit adds to
# its counters after the forward. The direct path takes a layer's references without looking its
# protection up or calling into the audit: inside a forward each object touched is a cache miss, and
# that lookup and call cost a layer several microseconds more than the references themselves
KEEP: list[tuple[torch.Tensor, dict, list[float]] | None] = [None]
# the attention wrapper's direct path, likewise: the ids of the attention modules of the forward being
# checked (CbAudit.begin sets them) that it needs nothing of (no audited query of theirs, or no audit
# this forward), whose attention goes straight to the engine, and the clock its seconds go on
# (the third item: every protected module is in the set, so the attention function the model looks up is
# handed out unwrapped for this forward, and no wrapper runs at all)
PASS: list[tuple[set[int], list[float], bool] | None] = [None]


def pool_key(cache_tensor: torch.Tensor) -> int:
    return int(cache_tensor.untyped_storage().data_ptr())


# the protection of a cache tensor, by the tensor's id (with a weak reference that says it is the same
# tensor): each layer's cache update looks its protection up, and the pool key (a storage object made
# and asked for its address) costs a microsecond or two inside a layer; emptied whenever BY_CACHE changes
_BY_TENSOR: dict[int, tuple[Any, Any]] = {}


def protect_cache(cache_tensor: torch.Tensor, prot: Any) -> None:
    """``prot`` protects the pool of ``cache_tensor`` (``None``: nothing does any more)."""
    _BY_TENSOR.clear()
    if prot is None:
        BY_CACHE.pop(pool_key(cache_tensor), None)
    else:
        BY_CACHE[pool_key(cache_tensor)] = prot


def _by_tensor(cache_tensor: torch.Tensor) -> Any:
    """:func:`_by_cache`, remembered by the tensor."""
    got = _BY_TENSOR.get(id(cache_tensor))
    if got is not None and got[0]() is cache_tensor:
        return got[1]
    prot = _by_cache(cache_tensor)
    _BY_TENSOR[id(cache_tensor)] = (weakref.ref(cache_tensor), prot)
    return prot


_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _targets() -> dict[str, tuple[Any, str]]:
    """Every patched method: key -> (class, attribute)."""
    from transformers.generation.continuous_batching import continuous_api
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.modeling_utils import AttentionInterface
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import CacheAllocator
    from transformers.generation.continuous_batching.cache_allocators.cache_pool import CachePool
    from transformers.generation.continuous_batching.model_runner import ModelRunner
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    return {
        "compute_batch": (ModelRunner, "compute_batch"),
        "offload": (OffloadingManager, "_offload_to_cpu"),
        "restore": (OffloadingManager, "restore_scheduled_requests"),
        "copy_blocks": (CacheAllocator, "copy_blocks"),
        "free_blocks": (CachePool, "free_blocks"),
        "pool_reset": (CachePool, "reset"),
        "update_batch": (continuous_api.ContinuousBatchProcessor, "update_batch"),
        "generate_batch": (continuous_api.ContinuousMixin, "generate_batch"),
        "cache_update": (PagedAttentionCache, "update"),
        "get_interface": (AttentionInterface, "get_interface"),
    }


def _by_cache(cache_tensor: Any) -> Any:
    return BY_CACHE.get(pool_key(cache_tensor))


def _compute_batch(self: Any, model: Any, batch_data: dict) -> None:
    prot = ACTIVE.get(id(model))
    steps = None
    if prot is not None:
        prot.stream = getattr(self.inputs_and_outputs, "compute_stream", None)  # the forward's (None on a CPU)
        steps = prot.before(self, batch_data)
    _ORIGINAL["compute_batch"](self, model, batch_data)
    if prot is not None:
        prot.after(steps)


def _offload(self: Any, victims: list, victim_block_tables: dict) -> set:
    rids = _ORIGINAL["offload"](self, victims, victim_block_tables)
    prot = _by_cache(self.cache.cache_tensor)
    if prot is not None and rids:
        prot.offloaded(self.cache, rids, victim_block_tables)
    return rids  # type: ignore[no-any-return]


def _restore(self: Any, requests_in_batch: list) -> None:
    rids = [fs.state.request_id for fs in requests_in_batch if fs.state.is_cpu_offloaded]
    _ORIGINAL["restore"](self, requests_in_batch)
    prot = _by_cache(self.cache.cache_tensor)
    if prot is not None and rids:
        prot.restored(self.cache, rids)


def _copy_blocks(self: Any, source_block_ids: list[int], dest_block_ids: list[int]) -> None:
    _ORIGINAL["copy_blocks"](self, source_block_ids, dest_block_ids)
    prot = _by_cache(self.cache_tensor)
    if prot is not None and source_block_ids:
        prot.copied(self, source_block_ids, dest_block_ids)


def _free_blocks(self: Any, index: int, block_ids: list[int]) -> None:
    _ORIGINAL["free_blocks"](self, index, block_ids)
    prot = BY_POOL.get(id(self))
    if prot is not None and block_ids:
        prot.free_later(index, block_ids)  # released at its next hook, with the others freed until then


def _pool_reset(self: Any) -> None:
    _ORIGINAL["pool_reset"](self)
    prot = BY_POOL.get(id(self))
    if prot is not None:
        prot.pool_reset()


def _update_batch(self: Any) -> None:
    prot = _by_cache(self.cache.cache_tensor)
    if prot is None or prot.config.mode not in ("quarantine", "repair"):
        return _ORIGINAL["update_batch"](self)  # type: ignore[no-any-return]
    return prot.quarantine.around_update(self, _ORIGINAL["update_batch"])  # type: ignore[no-any-return]


def _generate_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
    out = _ORIGINAL["generate_batch"](self, *args, **kwargs)
    prot = ACTIVE.get(id(self))
    if prot is not None:
        if prot.frees:
            prot.released()
        prot.raise_pending()  # raise mode: the error that stopped the engine, in the caller's thread
    return out


def _cache_update(self: Any, key_states: Any, value_states: Any, layer_idx: int, kwargs: dict) -> Any:
    t0 = time.perf_counter()  # the canary's time from here (CbAudit.update, or the direct path, charges it)
    keep = KEEP[0]
    if keep is not None and keep[0] is self.cache_tensor:  # the forward keeps every layer's K and V
        keep[1][layer_idx] = (key_states, value_states)
        keep[2][0] += time.perf_counter() - t0
        return _ORIGINAL["cache_update"](self, key_states, value_states, layer_idx, kwargs)
    prot = _by_tensor(self.cache_tensor)
    if prot is None:
        return _ORIGINAL["cache_update"](self, key_states, value_states, layer_idx, kwargs)
    return prot.audit.update(_ORIGINAL["cache_update"], self, key_states, value_states, layer_idx, kwargs, t0)


_AUDITED_FN: dict[Any, Callable[..., Any]] = {}  # attention function -> its audited wrapper


def _get_interface(self: Any, attn_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
    fn = _ORIGINAL["get_interface"](self, attn_implementation, default)
    skip = PASS[0]
    if skip is not None and skip[2]:  # the forward's checks need nothing of any layer's attention
        return fn
    wrapped = _AUDITED_FN.get(fn)
    if wrapped is None:
        def wrapped(module: Any, query: Any, key: Any, value: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
            # the engine's attention called here, its keywords handed on once (every layer, every forward)
            t0 = time.perf_counter()
            skip = PASS[0]
            if skip is not None and id(module) in skip[0]:  # a layer the forward's checks need nothing of
                skip[1][0] += time.perf_counter() - t0
                return fn(module, query, key, value, mask, *args, **kwargs)
            audit = AUDITED.get(id(module))
            if audit is None:
                return fn(module, query, key, value, mask, *args, **kwargs)
            tap = audit.taps.get("attention")
            out = (tap(fn, module, query, key, value, mask, *args, **kwargs) if tap is not None
                   else fn(module, query, key, value, mask, *args, **kwargs))
            audit.attended(module, query, out)
            return out

        _AUDITED_FN[fn] = wrapped
    return wrapped


_PATCHES: dict[str, Callable[..., Any]] = {
    "compute_batch": _compute_batch, "offload": _offload, "restore": _restore, "copy_blocks": _copy_blocks,
    "free_blocks": _free_blocks, "pool_reset": _pool_reset, "update_batch": _update_batch,
    "generate_batch": _generate_batch, "cache_update": _cache_update, "get_interface": _get_interface,
}


def install() -> None:
    if _ORIGINAL:
        return
    for key, (cls, attr) in _targets().items():
        _ORIGINAL[key] = getattr(cls, attr)
        setattr(cls, attr, _PATCHES[key])


def uninstall() -> None:
    if not _ORIGINAL:
        return
    for key, (cls, attr) in _targets().items():
        setattr(cls, attr, _ORIGINAL.pop(key))
