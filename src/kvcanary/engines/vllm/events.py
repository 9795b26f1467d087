"""Counting what a vLLM engine of this process did that matters to the canary, so a clean run can
assert that the events it claims to exercise really happened: preemptions, speculative drafts
scheduled, accepted and rejected, blocks a sliding window freed and blocks handed out again after
that. :func:`watch` wraps the scheduler's own methods (once per process, before the engine starts);
:func:`kv_cache_layout` and :func:`compilation` read what an engine built (its KV cache groups and
pool, whether its model runs compiled).

A multiprocess engine schedules in its engine-core process: with ``KVCANARY_EVENTS_FILE=PATH`` set,
kvcanary's vLLM plugin watches in every vLLM process and each writes its counts to ``PATH.<pid>``
as they change (:func:`record_to`); :func:`collect` sums them.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Callable

EVENTS = ("preemptions", "drafts", "drafts_accepted", "window_freed_blocks", "window_reused_blocks")


def watch(changed: Callable[[dict[str, int]], None] = lambda counts: None) -> dict[str, int]:
    """Start counting; returns the live counts (a dict keyed by :data:`EVENTS`). ``changed`` is
    called with them whenever one grows."""
    from vllm.v1.core import block_pool, single_type_kv_cache_manager as stm
    from vllm.v1.core.sched import scheduler

    counts = dict.fromkeys(EVENTS, 0)
    freed: set[int] = set()
    sch = scheduler.Scheduler
    preempt, spec = sch._preempt_request, sch.make_spec_decoding_stats

    def add(**by: int) -> None:
        if any(by.values()):
            for k, v in by.items():
                counts[k] += v
            changed(counts)

    def count_preempt(self: Any, *a: Any, **k: Any) -> Any:
        add(preemptions=1)
        return preempt(self, *a, **k)

    def count_spec(self: Any, stats: Any, num_draft_tokens: int, num_accepted_tokens: int, *a: Any, **k: Any) -> Any:
        add(drafts=num_draft_tokens, drafts_accepted=num_accepted_tokens)
        return spec(self, stats, num_draft_tokens, num_accepted_tokens, *a, **k)

    sch._preempt_request = count_preempt
    sch.make_spec_decoding_stats = count_spec
    window = stm.SlidingWindowManager
    remove = window.remove_skipped_blocks

    def count_remove(self: Any, request_id: str, *a: Any, **k: Any) -> Any:
        before = {b.block_id for b in self.req_to_blocks.get(request_id, ()) if b.block_id}
        out = remove(self, request_id, *a, **k)
        after = {b.block_id for b in self.req_to_blocks.get(request_id, ()) if b.block_id}
        freed.update(before - after)
        add(window_freed_blocks=len(before - after))
        return out

    window.remove_skipped_blocks = count_remove
    pool = block_pool.BlockPool
    get_new = pool.get_new_blocks

    def count_reuse(self: Any, *a: Any, **k: Any) -> Any:
        blocks = get_new(self, *a, **k)
        again = freed & {b.block_id for b in blocks}
        freed.difference_update(again)
        add(window_reused_blocks=len(again))
        return blocks

    pool.get_new_blocks = count_reuse
    return counts


def kv_cache_layout(llm: Any) -> dict[str, Any] | None:
    """The KV cache groups (spec class, block size, layers) and the pool's blocks of an in-process
    engine (``None`` when its engine core is another process)."""
    try:
        cfg = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.kv_cache_config
    except AttributeError:
        return None
    groups = [{"spec": type(g.kv_cache_spec).__name__, "block_size": int(g.kv_cache_spec.block_size),
               "layers": list(g.layer_names)} for g in cfg.kv_cache_groups]
    return {"groups": groups, "num_blocks": int(cfg.num_blocks)}


def compilation(llm: Any) -> str:
    """How the engine runs its model, as its vLLM configuration says: the compilation mode's name
    (``NONE``: eager, ``--enforce-eager``), or ``"unknown"`` where the configuration does not say."""
    try:
        c = llm.llm_engine.vllm_config.compilation_config
    except AttributeError:
        return "unknown"
    mode = getattr(c, "mode", None)
    if mode is None:
        mode = getattr(c, "level", None)
    return "unknown" if mode is None else str(getattr(mode, "name", mode))


def record_to(path: str) -> None:
    """Watch this process's engine and keep its counts in ``path.<pid>`` (rewritten on each change)."""
    out = f"{path}.{os.getpid()}"

    def write(counts: dict[str, int]) -> None:
        with open(out + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(counts, fh)
        os.replace(out + ".tmp", out)

    watch(write)


def collect(path: str) -> dict[str, int]:
    """The counts of every process that recorded to ``path``, summed."""
    total = dict.fromkeys(EVENTS, 0)
    for f in glob.glob(glob.escape(path) + ".*[0-9]"):
        with open(f, encoding="utf-8") as fh:
            for k, v in json.load(fh).items():
                total[k] = total.get(k, 0) + int(v)
    return total
