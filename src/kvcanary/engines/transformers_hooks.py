"""transformers continuous batching: the class-level patches that bracket each forward, and the
small runtime helpers the protection uses (which IO holds the batch, host-to-device transfer,
the forward's stream). transformers is imported inside functions only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch


def host_io(io: Any) -> Any:
    """The IO object holding the current batch's host-side state (async batching keeps a pair)."""
    return io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io


def to_device(dev: torch.device, *tensors: torch.Tensor | None) -> tuple[Any, ...]:
    """Host tensors on ``dev``: through pinned memory and without waiting, on an accelerator."""
    if dev.type == "cpu":
        return tensors
    return tuple(None if t is None else t.pin_memory().to(dev, non_blocking=True) for t in tensors)


@contextlib.contextmanager
def canary_work(stream: Any) -> Iterator[None]:
    """Around the canary's work in a forward: on the forward's own stream (so it is ordered with
    the forward, drains of the ring included), on one intra-op thread.

    The continuous-batching forward runs in a worker thread, where a small op fanned out to the
    intra-op pool costs several times its work (76 us instead of 10 us for a 2k-element
    repeat_interleave on the 2-core machines here). The forward itself is not running meanwhile.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            yield
    finally:
        torch.set_num_threads(threads)


# ---- class-level patches (the CB processor is built inside its worker thread) ---------------

ACTIVE: dict[int, Any] = {}  # model id -> Protection
BY_CACHE: dict[int, Any] = {}  # by the KV pool's storage, which the cache and its allocators share


def pool_key(cache_tensor: torch.Tensor) -> int:
    return int(cache_tensor.untyped_storage().data_ptr())


_ORIGINAL: dict[str, Callable[..., Any]] = {}


def install() -> None:
    if _ORIGINAL:
        return
    from transformers.generation.continuous_batching.model_runner import ModelRunner
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import CacheAllocator

    _ORIGINAL["compute_batch"] = ModelRunner.compute_batch
    _ORIGINAL["offload"] = OffloadingManager._offload_to_cpu
    _ORIGINAL["restore"] = OffloadingManager.restore_scheduled_requests
    _ORIGINAL["copy_blocks"] = CacheAllocator.copy_blocks

    def compute_batch(self: Any, model: Any, batch_data: dict) -> None:
        prot = ACTIVE.get(id(model))
        steps = prot.before(self, batch_data) if prot is not None else None
        _ORIGINAL["compute_batch"](self, model, batch_data)
        if prot is not None:
            prot.after(steps)

    def offload(self: Any, victims: list, victim_block_tables: dict) -> set:
        rids = _ORIGINAL["offload"](self, victims, victim_block_tables)
        prot = BY_CACHE.get(pool_key(self.cache.cache_tensor))
        if prot is not None and rids:
            prot.offloaded(self.cache, rids, victim_block_tables)
        return rids  # type: ignore[no-any-return]

    def restore(self: Any, requests_in_batch: list) -> None:
        rids = [fs.state.request_id for fs in requests_in_batch if fs.state.is_cpu_offloaded]
        _ORIGINAL["restore"](self, requests_in_batch)
        prot = BY_CACHE.get(pool_key(self.cache.cache_tensor))
        if prot is not None and rids:
            prot.restored(self.cache, rids)

    def copy_blocks(self: Any, source_block_ids: list[int], dest_block_ids: list[int]) -> None:
        _ORIGINAL["copy_blocks"](self, source_block_ids, dest_block_ids)
        prot = BY_CACHE.get(pool_key(self.cache_tensor))
        if prot is not None and source_block_ids:
            prot.copied(self, source_block_ids, dest_block_ids)

    setattr(ModelRunner, "compute_batch", compute_batch)
    setattr(OffloadingManager, "_offload_to_cpu", offload)
    setattr(OffloadingManager, "restore_scheduled_requests", restore)
    setattr(CacheAllocator, "copy_blocks", copy_blocks)


def uninstall() -> None:
    if not _ORIGINAL:
        return
    from transformers.generation.continuous_batching.model_runner import ModelRunner
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import CacheAllocator

    setattr(CacheAllocator, "copy_blocks", _ORIGINAL.pop("copy_blocks"))
    setattr(ModelRunner, "compute_batch", _ORIGINAL.pop("compute_batch"))
    setattr(OffloadingManager, "_offload_to_cpu", _ORIGINAL.pop("offload"))
    setattr(OffloadingManager, "restore_scheduled_requests", _ORIGINAL.pop("restore"))
