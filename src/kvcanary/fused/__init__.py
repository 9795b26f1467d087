"""The fused CPU path: each op of :mod:`kvcanary.ops` as one compiled loop (numba), bit for bit the
torch reference. Importing this package imports nothing heavy; :func:`available` says whether the
compiled loops can be used here, compiling them first where they are not cached yet (in
:func:`kvcanary.fused.cache.directory`; ``kvcanary warmup`` does it ahead of time)."""

from __future__ import annotations

from typing import Any

_why: list[str | None] = []
_warm: list[dict[str, list[Any]]] = []  # each loop's signatures once the warm-up ran


def available() -> str | None:
    """``None`` when the fused path works on this machine, else why not (checked once per process,
    by running every compiled loop once on a tiny pool: compiling them, or loading them from the
    disk cache, happens here, when a canary is made, and not in an engine's first forwards)."""
    if not _why:
        try:
            _warm_up()
            _warm.append({k: list(d.signatures) for k, d in loops().items()})
            _why.append(None)
        except Exception as e:  # an absent or broken numba: the torch path takes over
            _why.append(f"{type(e).__name__}: {e}")
        else:
            from kvcanary.fused import cache

            if not cache.is_warm():  # every loop is in the cache now: the next warm-up says so at once
                cache.mark_warm()
    return _why[0]


def loops() -> dict[str, Any]:
    """Every compiled loop called from Python (numba dispatchers by ``module.name``): what
    :func:`available` compiles or loads. Imports the compiled modules."""
    from numba.core.dispatcher import Dispatcher

    from kvcanary.fused import _core, _step, audit, block_steps, forward, index_steps, keep, ops, scrub, steps

    modules = (_core, _step, ops, scrub, steps, forward, index_steps, block_steps, audit, keep)
    return {f"{m.__name__}.{k}": v for m in modules for k, v in vars(m).items()
            if isinstance(v, Dispatcher) and v.targetoptions.get("inline") != "always"
            and v.py_func.__module__ == m.__name__}


def signatures() -> int:
    """Signatures the compiled loops hold in this process (compiled or loaded)."""
    return sum(len(d.signatures) for d in loops().values())


def added_since_warm_up() -> list[str] | None:
    """The signatures (``loop(argument types)``) this process's engine use added beyond the
    warm-up's (``None``: no warm-up ran): each was compiled or loaded in an engine's forward rather
    than ahead of it."""
    if not _warm:
        return None
    return [f"{k}{tuple(map(str, sig))}" for k, d in loops().items() for sig in d.signatures
            if sig not in _warm[0].get(k, ())]


def compiled() -> int:
    """Signatures compiled in this process because the disk cache did not hold them."""
    return sum(sum(d.stats.cache_misses.values()) for d in loops().values())


def loaded() -> int:
    """Signatures loaded from the disk cache in this process."""
    return sum(sum(d.stats.cache_hits.values()) for d in loops().values())


def _warm_up() -> None:
    """Every compiled loop once, with every argument type the canary and the engine adapters pass
    (the loops take tensors as descriptors: one signature each; the transformers adapter's step
    building takes the engine's own index tensors: int64 indices, int32 cumulative lengths)."""
    import numpy as np
    import torch

    from kvcanary.fused import ops, scrub, steps
    from kvcanary.fused.fold import SourceTable
    from kvcanary.layout import KvLayout
    from kvcanary.source import ByteSource
    from kvcanary.step import Step
    from kvcanary.violations import NUM_COUNTERS, NUM_FIELDS

    kv = torch.zeros(2, 4, 16, dtype=torch.int64)
    table = SourceTable(KvLayout((ByteSource.from_tensor("w", kv, page_size=4),)))
    stamps = torch.full((8, 4), -1, dtype=torch.int64)
    counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64)
    ring = torch.zeros(4, NUM_FIELDS, dtype=torch.int64)
    one = torch.ones(1, dtype=torch.int64)
    step = Step(cached_lens=one, new_offsets=torch.tensor([0, 1]), new_tokens=one, new_positions=one,
                new_slots=one, block_table=torch.zeros(1, 2, dtype=torch.int64), block_size=4)
    step.validate_shapes()
    steps.validate(step, 8)
    ops.stamp(stamps, table, step, counters, ring)
    ops.verify(stamps, table, step, counters, torch.zeros(1, dtype=torch.int64), None, ring)
    scrub.scrub(stamps, table, one, counters, ring)
    scrub.content(one, table, 8, torch.zeros(1, dtype=torch.int64))
    base, hit, was, got = (torch.zeros(1, dtype=torch.int64) for _ in range(4))
    scrub.guard(stamps, table, torch.tensor([0, 7]), 1, base, hit, was, got, counters, ring)
    steps.written_from(step)
    steps.note_writers(step, torch.full((9, 2), -1, dtype=torch.int64), 8, 0)
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    i32 = lambda *v: np.array(v, dtype=np.int32)  # noqa: E731
    from kvcanary.fused.index_steps import fill_common, fill_group

    e2 = np.zeros((0, 0), dtype=np.int64)
    # the engine's int32 query starts, input ids and positions
    fill_common(i64(1), i64(0), e2, i64(), i32(0, 1), i32(5), i32(0), i64(0, 0), i64(0), i64(0), i64(), i64())
    for table_dtype in (np.int32, np.int64):  # int32 slot tables unless a pool's slot numbers need int64
        fill_group(i64(), i32(0, 1), i64(1), i64(0), i64(0), 8, 8, -1, np.zeros((2, 2), dtype=table_dtype), i64(0),
                   i64(0))
    from kvcanary.fused.block_steps import fill_new, fill_tokens
    from kvcanary.fused import forward
    from kvcanary.fused._step import describe

    # vLLM's metadata: int32 query starts and block tables, int64 slot mapping; sequence lengths int32 to
    # fill_new, int64 to fill_tokens (engines/vllm/steps.py matches the token book's rows with them)
    fill_tokens(i32(0, 1), i64(1), np.zeros((1, 1), dtype=np.int64), i64(0), i64(0))
    fill_new(i32(0, 1), i32(1), i64(0), np.ones(1, dtype=np.bool_), i64(0), i64(0), i64(0))

    cursor = torch.zeros(1, dtype=torch.int64)  # held: the loop writes through its address
    record = np.zeros(forward.CANARY_FIELDS, dtype=np.int64)
    record[[forward.C_STAMPS, forward.C_NUM_SLOTS, forward.C_COUNTERS, forward.C_CURSOR, forward.C_RING, forward.C_CAP,
            forward.C_BPS]] = (stamps.data_ptr(), 8, counters.data_ptr(), cursor.data_ptr(), ring.data_ptr(), 4,
                               table.bytes_per_slot)
    forward.warm_up(describe(step), record, (table.src, table.runs, table.keys), np.full((9, 2), -1, dtype=np.int64))
    _warm_audit(describe(step))


def _warm_audit(desc: Any) -> None:
    """The write check and read audit's loops with the tables the engine adapters pass, empty: their
    types, not their sizes or the cache's dtype, make each one's signature. The one call
    (:func:`kvcanary.fused.audit.check_forward`, :meth:`kvcanary.engines.audit.EngineAudit.run_compiled`)
    and vLLM's per-layer ones (:mod:`kvcanary.fused.keep`)."""
    import numpy as np

    from kvcanary.audit.tables import LAYER_COLUMNS, QUERY_COLUMNS, STRIDE_COLUMNS
    from kvcanary.fused.fold import NUM_SRC_FIELDS
    from kvcanary.fused.audit import check_forward
    from kvcanary.fused.keep import keep_layer, keep_layer_at, keep_queries, keep_tables

    layers = np.zeros((0, LAYER_COLUMNS), dtype=np.int64)
    half = np.zeros((0, 0), dtype=np.int64)
    one = np.zeros((1, LAYER_COLUMNS), dtype=np.int64)
    tables = (one, np.zeros(STRIDE_COLUMNS, dtype=np.int64), desc[None], np.zeros(0, dtype=np.int64), half,
              np.zeros_like(half), np.zeros((0, NUM_SRC_FIELDS), dtype=np.int64), np.zeros(1, dtype=np.int64),
              np.zeros(1, dtype=np.uint64), np.zeros((1, 2), dtype=np.int64), np.zeros((0, 3), dtype=np.int64),
              np.zeros(1, dtype=np.uint64), np.zeros((0, 0), dtype=np.uint64), np.zeros((0, 0), dtype=np.int64))
    keep_layer(tables[0], 0, 0, 0, 0, *tables[1:])
    at = keep_tables(*tables)
    keep_layer_at(at.__array_interface__["data"][0], 0, 0, 0, 0)
    keep_queries(one, 0, 0, 0, np.zeros(STRIDE_COLUMNS, dtype=np.int64), np.zeros((0, QUERY_COLUMNS), dtype=np.int64),
                 np.zeros((1, 2, 2), dtype=np.uint8))
    for gathered in (False, True):
        check_forward(layers, np.zeros((0, 4), dtype=np.int64), np.zeros(STRIDE_COLUMNS, dtype=np.int64), desc[None],
                      np.zeros(0, dtype=np.int64), np.zeros((0, QUERY_COLUMNS), dtype=np.int64), np.zeros(4),
                      half, np.zeros_like(half), np.full(0, -1.0), np.zeros(0, dtype=np.int64), np.zeros(0), gathered)
