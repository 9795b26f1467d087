"""The canary's steps of one vLLM forward, one per KV cache group, from vLLM's attention metadata and
what the scheduler side sent. Imports nothing of vLLM's: the tests build steps from stand-in metadata.

A forward's rows are the runner's batch order, the same in every KV cache group; each row is matched
once to its scheduled request by the slot of its first new token in the primary group. Each group
then gets its own step from its own metadata (block table, slot mapping) with its read window: a
sliding-window group's kernel reads only the last ``window`` positions before each query token, so
its step reads from ``cached - window + 1`` (vLLM frees and hands out again the blocks below that).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvcanary.engines.block_table import read_starts, step_from_block_table
from kvcanary.engines.token_book import TokenBook
from kvcanary.geometry import base as geometry
from kvcanary.step import Step


@dataclass
class ReqStep:
    """One scheduled request in one step, as the scheduler sees it."""

    req_id: str
    computed: int  # tokens already in the cache (read this step)
    scheduled: int  # tokens written this step, drafts included
    first_slot: int  # the slot of its first new token in the primary group (matches the worker's row)
    start: int  # position of the first token in ``tokens``
    tokens: list[int]  # committed token ids from ``start`` on that the worker has not been sent yet
    # draft tokens this forward writes after the committed ones (speculative decoding; -1: not known)
    drafts: list[int] = field(default_factory=list)
    # > computed: positions [computed, rollback) were written by an earlier forward and no longer hold
    # the sequence's KV (rejected drafts rolled back); their slots are released before this forward
    rollback: int = 0
    landed_from: int = -1  # another connector lands positions [landed_from, computed) this step
    prompt_len: int = 0
    # healing modes only: the scheduler's primary-group blocks of the computed positions, and the
    # index of the first of them no other request holds
    blocks: list[int] = field(default_factory=list)
    private_from: int = 0


@dataclass
class Rows:
    """A forward's rows matched to their requests (shared by every KV cache group's step)."""

    reqs: list[ReqStep | None]  # per row; None: no scheduled request (padding)
    rids: list[str]  # per row; "" for padding
    valid: torch.Tensor  # bool [R]
    # the token book's record (int64 [book rows, capacity], on the metadata's device) and each row's
    # row of it (int64 [R]; the book's blank row for padding and requests it does not know): the
    # steps read the committed tokens in place
    record: torch.Tensor
    record_rows: torch.Tensor
    new_tokens: torch.Tensor  # int64 [T]: each new token's id (committed, or a draft), -1 unknown
    unknown_new: bool  # a new token's id is not known (a draft the scheduler had not filled in)


class Kept:
    """One connector's rows' buffers (new token ids, rows' validity and book rows) and each KV cache
    group's kept step, from one forward to the next (:mod:`kvcanary.engines.vllm.compiled`)."""

    def __init__(self) -> None:
        self.shape: tuple[int, int] | None = None  # the rows' buffers' (rows, new tokens)
        self.new = self.valid = self.book_rows = torch.empty(0, dtype=torch.int64)
        self.np: tuple[np.ndarray, ...] = ()  # their numpy views
        self.steps: dict[int, Any] = {}  # by group index (kvcanary.engines.vllm.compiled's kept steps)
        self.reused = 0  # steps refilled in place

    def clear(self) -> None:
        """Drop every kept buffer and step (the next forward makes them anew)."""
        self.shape, self.steps = None, {}

    def rows(self, r: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' buffers for ``r`` rows and ``n`` new tokens: the new tokens' ids (int64 ``[n]``),
        each row's validity (bool ``[r]``) and book row (int64 ``[r]``); made again (and the kept
        steps dropped) where the shape differs from the last forward's."""
        if self.shape != (r, n):
            self.shape = (r, n)
            self.new, self.book_rows = torch.empty(n, dtype=torch.int64), torch.empty(r, dtype=torch.int64)
            self.valid = torch.empty(r, dtype=torch.bool)
            self.np = (self.new.numpy(), self.valid.numpy(), self.book_rows.numpy())  # for the compiled fill
            self.steps = {}
        return self.new, self.valid, self.book_rows


def group_metadata(by_layer: Any, plans: list[Any], index: int) -> Any:
    """KV cache group ``index``'s attention metadata in this forward (``None``: none), from the
    forward context's per-layer metadata (``plans``: the groups' plans, with their layers' names). A
    layer whose metadata was rebuilt into per-chunk virtual rows (chunked local attention sharing a
    group with other layers) is passed over."""
    if not isinstance(by_layer, dict):
        return by_layer
    names = (plans[index].layers + plans[index].draft_layers) if index < len(plans) else tuple(by_layer)
    for n in names:
        md = by_layer.get(n)
        if md is not None and not hasattr(md, "make_virtual_batches_block_table"):
            return md
    return None


def match_rows(md: Any, reqs: list[ReqStep], book: TokenBook, fused: bool | None = None,
               kept: Kept | None = None) -> Rows:
    """Match the rows of the primary group's metadata ``md`` to ``reqs`` by the slot of each row's first
    new token, and give each new token its id: a committed one from ``book``, or the draft the
    forward writes there. On CPU metadata with the fused path available (``fused=None``: whenever it
    is) the new tokens are a compiled loop (:mod:`kvcanary.engines.vllm.compiled`); elsewhere they
    are laid out on the host (a forward's new tokens) and sent with the rows' book rows: nothing is
    sent per cached position. ``kept``: the fused path's buffers kept across forwards
    (:class:`Kept`), where the rows' tensors are filled."""
    if _fused(md, fused):  # (CPU metadata: numpy views of it as it is)
        from kvcanary.engines.vllm.compiled import rows_of

        qsl_np = md.query_start_loc.numpy()
        r = qsl_np.shape[0] - 1
        seq = md.seq_lens.numpy()[:r].astype(np.int64)  # (the compiled loops' signature kvcanary warmup makes)
        rows, rids, brows, new, valid_t, brows_t = rows_of(md, reqs, book, qsl_np, seq, kept)
    else:
        qsl_np = md.query_start_loc.cpu().numpy()
        r = qsl_np.shape[0] - 1
        seq = md.seq_lens[:r].cpu().numpy().astype(np.int64)
        valid_t = brows_t = None
        n = int(md.num_actual_tokens)
        first = md.slot_mapping[:n].long()[md.query_start_loc[:-1].long().clamp(max=max(n - 1, 0))].tolist() if n else [-1] * r
        by_slot = {x.first_slot: x for x in reqs}
        q = np.diff(qsl_np).astype(np.int64)
        rows = [by_slot.get(s) if k > 0 else None for s, k in zip(first, q.tolist())]
        rids = [x.req_id if x is not None else "" for x in rows]
        brows = np.array([book.row.get(rid, book.BLANK) if rid else book.BLANK for rid in rids], dtype=np.int64)
        row = np.repeat(np.arange(r), q)
        pos = (seq - q)[row] + (np.arange(int(q.sum())) - qsl_np[:-1][row])
        buf = book.buf.numpy()
        inside = (pos >= 0) & (pos < buf.shape[1])
        new = torch.from_numpy(np.where(inside, buf[brows[row], np.where(inside, pos, 0)], -1).astype(np.int64))
    unknown = False
    drafting = [(i, x) for i, x in enumerate(rows) if x is not None and x.drafts]
    if drafting:  # (most forwards: none, and no array made)
        arr, width = new.numpy(), max(int(seq.max()) if r else 1, 1)
    for i, x in drafting:
        # the drafts the forward writes at positions [d0, d0 + k), over the row's new tokens
        d0 = x.computed + x.scheduled - len(x.drafts)
        k = max(0, min(len(x.drafts), width - d0))
        drafts = np.asarray(x.drafts[:k], dtype=np.int64)
        lo, hi = int(qsl_np[i]), int(qsl_np[i + 1])
        c = int(seq[i]) - (hi - lo)
        a, b = max(d0, c), min(d0 + k, c + hi - lo)
        if b > a:
            arr[lo + a - c : lo + b - c] = drafts[a - d0 : b - d0]
        unknown |= bool((drafts < 0).any())
    valid = valid_t if valid_t is not None else torch.from_numpy(
        np.fromiter((x is not None for x in rows), dtype=np.bool_, count=len(rows)))
    dev = md.query_start_loc.device
    record = book.on(dev)
    if brows_t is None:
        brows_t = torch.from_numpy(brows)
    if dev.type != "cpu":
        valid, brows_t, new = (t.pin_memory().to(dev, non_blocking=True) for t in (valid, brows_t, new))
    return Rows(rows, rids, valid, record, brows_t, new, unknown)


def _fused(md: Any, fused: bool | None) -> bool:
    if fused is None:
        fused = md.query_start_loc.is_cpu and _fused_available()
    return fused


@functools.lru_cache(maxsize=1)
def _fused_available() -> bool:
    from kvcanary.fused import available

    return available() is None


def build_step(md: Any, rows: Rows, block_size: int, window: int | None, fused: bool | None = None,
               kept: Kept | None = None, group: int = 0) -> Step:
    """One KV cache group's step of the forward, from that group's metadata ``md``: reads of the
    positions the kernel reads before the forward; reads of slots the step itself writes, and of KV
    another connector lands this step, from ``written_from``. On CPU metadata with the fused path
    (``fused=None``: whenever it is available) built by compiled loops, on ``kept``'s buffers for KV
    cache group ``group`` where given (the rows matched on the same ``kept``)."""
    # the rows another connector lands KV for, where any does (most forwards: none, and no array made)
    landing = any(x is not None and x.landed_from >= 0 for x in rows.reqs)
    lands = np.fromiter((x.landed_from if x is not None and x.landed_from >= 0 else -1 for x in rows.reqs),
                        dtype=np.int64, count=len(rows.reqs)) if landing else None
    if _fused(md, fused):
        from kvcanary.engines.vllm.compiled import step_of

        return step_of(md, rows, block_size, window, lands, kept, group)
    if lands is None:
        lands = np.full(len(rows.reqs), -1, dtype=np.int64)
    qsl = md.query_start_loc.long()
    r = qsl.shape[0] - 1
    n = int(md.num_actual_tokens)
    seq = md.seq_lens[:r].long()
    cached = seq - (qsl[1:] - qsl[:-1])
    step = step_from_block_table(md.block_table, block_size, qsl, seq, md.slot_mapping[:n].long(), rows.record,
                                 rows.valid, read_starts(cached, window), expected_rows=rows.record_rows,
                                 new_tokens=rows.new_tokens)
    landed = torch.from_numpy(lands)
    if cached.device.type != "cpu":
        landed = landed.pin_memory().to(cached.device, non_blocking=True)
    assert step.written_from is not None
    # landed KV is read once it has landed
    step.written_from = torch.minimum(step.written_from, torch.where(landed >= 0, landed, cached))
    return step


def positions_slots(step: Step, row: int, lo: int, hi: int, block_size: int) -> torch.Tensor:
    """The slots of positions ``[lo, hi)`` of ``row`` in ``step``'s table, leaving out positions
    outside the table and the null block (block 0, which tables pad with)."""
    dev = step.cached_lens.device
    if hi <= lo:
        return torch.empty(0, dtype=torch.int64, device=dev)
    pos = torch.arange(lo, hi, device=dev)
    slots = step.lookup(torch.full_like(pos, row), pos)
    return slots[slots >= block_size]


def rolled_back(step: Step, rows: Rows, block_size: int) -> list[tuple[int, torch.Tensor]]:
    """Per row whose request rolled back (rejected drafts, or a recompute from an earlier block):
    the row and the slots of its positions ``[computed, rollback)`` in ``step``'s table, to be
    released before the forward, so that a read of one before it is written again is reported."""
    return [(i, positions_slots(step, i, x.computed, x.rollback, block_size))
            for i, x in enumerate(rows.reqs) if x is not None and x.rollback > x.computed]


def written_by(slots: torch.Tensor, writers: torch.Tensor, history: dict[int, list[str]], rid: str) -> torch.Tensor:
    """The ``slots`` whose last writer (``writers``: a canary's ``[num_slots + 1, 2]`` step and row
    record) was request ``rid`` (``history``: each remembered step's rows' request ids). A table
    that points elsewhere must not release another request's stamps."""
    if not slots.numel():
        return slots
    w = writers[slots]
    keep = torch.zeros(slots.shape[0], dtype=torch.bool, device=slots.device)
    for step in torch.unique(w[:, 0]).tolist():
        rids = history.get(int(step))
        if rids is None:
            continue
        mine = torch.tensor([r == rid for r in rids] + [False], dtype=torch.bool, device=slots.device)
        at = w[:, 0] == step
        keep |= at & mine[w[:, 1].clamp(0, len(rids))]
    return slots[keep]


def block_slots(blocks: list[int], block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Every slot of ``blocks``, int64 ``[len(blocks) * block_size]`` on ``device`` (the pool's),
    sent without the host waiting."""
    slots = geometry.block_slots(blocks, block_size)
    if torch.device(device).type == "cpu":
        return slots
    return slots.pin_memory().to(device, non_blocking=True)  # no wait: a step's blocks, on the way to the pool
