"""vLLM on a CPU pool with the fused backend: a forward's rows and steps filled by compiled loops,
into buffers kept from one forward to the next.

Equal, field for field, to :func:`kvcanary.engines.vllm.steps.match_rows` and
:func:`~kvcanary.engines.vllm.steps.build_step`'s torch construction (``tests/test_vllm_steps.py``
compares them on random batches with windows, drafts, padding rows and landed KV, and over runs of
forwards that reuse the kept buffers). The host work left per forward is one dict lookup per row
(matching rows to the scheduler's request records) and the token book's new tokens; the new tokens'
ids, each group's new-token fields and where its reads of this step's own writes start are compiled
loops over the metadata's own arrays. The steps read the token book's record in place: nothing is
copied per cached position.

With a :class:`~kvcanary.engines.vllm.steps.Kept` (the connector's), the rows' and each group's
step's buffers, and the :class:`~kvcanary.step.Step` over them, are made again only when the
forward's shape (rows, new tokens) or the metadata's buffers change: vLLM refills its metadata's
buffers in place, so in a run of forwards of one shape the canary's checked shapes and compiled
descriptors carry over (values are checked on every use). A step built on one is refilled by the
next forward's build: use it within its forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcanary.fused.block_steps import fill_new, fill_tokens
from kvcanary.fused.steps import written_from
from kvcanary.step import Step


class _KeptStep:
    """One group's step over buffers of its own and views of the metadata's buffers, with the numpy
    views its compiled fill takes, for forwards whose ``key`` (:func:`_key`) is the same (a step
    made for one forward only has none)."""

    def __init__(self, key: tuple[Any, ...], md: Any, rows: Any, r: int, n: int, block_size: int,
                 window: int | None) -> None:
        self.key = key
        e64 = lambda k: torch.empty(k, dtype=torch.int64)  # noqa: E731
        cached, new_positions, new_slots, self.wf = e64(r), e64(n), e64(n), e64(r)
        self.window = window
        self.starts = None if window is None else e64(r)
        self.step = Step(cached_lens=cached, new_offsets=md.query_start_loc[: r + 1], new_tokens=rows.new_tokens,
                         new_positions=new_positions, new_slots=new_slots, block_table=md.block_table[:r],
                         block_size=block_size, row_valid=rows.valid, expected_tokens=rows.record,
                         expected_rows=rows.record_rows, read_starts=self.starts, written_from=self.wf)
        self.fill = (md.query_start_loc.numpy(), md.seq_lens.numpy(), md.slot_mapping.numpy(), rows.valid.numpy(),
                     cached.numpy(), new_positions.numpy(), new_slots.numpy())

    def refill(self) -> Step:
        """The step with this forward's values (the metadata's buffers hold them)."""
        fill_new(*self.fill)
        step = self.step
        if self.starts is not None and self.window is not None:  # kvcanary.engines.block_table.read_starts, in place
            c = self.fill[4]
            np.minimum(np.maximum(c - (self.window - 1), 0), np.maximum(c - 1, 0), out=self.starts.numpy())
        # the positions the model is given are this forward's (kvcanary.engines.vllm.entry.model_positions)
        step.assign_new("expected_new_positions", None)
        return step


def _key(md: Any, rows: Any, r: int, n: int, block_size: int, window: int | None) -> tuple[Any, ...]:
    """What a kept step is made for: the shape, the metadata's buffers (address, size, dtype; the
    table's row stride and width) and the rows' tensors (by identity: the kept step holds them)."""
    qsl, seq, sm, bt = md.query_start_loc, md.seq_lens, md.slot_mapping, md.block_table
    return (r, n, block_size, window, *(x for t in (qsl, seq, sm, bt) for x in (t.data_ptr(), t.shape, t.stride(),
                                                                               t.dtype)),
            id(rows.new_tokens), id(rows.valid), id(rows.record), id(rows.record_rows))


def rows_of(md: Any, reqs: list, book: Any, qsl: np.ndarray, seq: np.ndarray, kept: Any = None
            ) -> tuple[list, list[str], np.ndarray, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`~kvcanary.engines.vllm.steps.match_rows`' matching and new tokens: each row's request
    record (None: padding), id and row of the token book, each new token's id from the book (the
    drafts are laid over it after), and on a ``kept`` the rows' validity and book rows in its
    buffers (else ``None``: the caller makes them). ``qsl`` and ``seq``: the metadata's query
    starts and sequence lengths as numpy."""
    r = qsl.shape[0] - 1
    n = int(md.num_actual_tokens)
    by_slot = {x.first_slot: x for x in reqs}
    if n:
        # the rows' starts as Python ints (one conversion): right after the engine's forward each numpy
        # call costs microseconds (cold caches), a builtin on a short list less
        starts = qsl.tolist()
        first = md.slot_mapping.numpy()[[min(a, n - 1) for a in starts[:-1]]].tolist()
        rows = [by_slot.get(s) if b > a else None for s, a, b in zip(first, starts, starts[1:])]
    else:
        rows = [None] * r
    rids = [x.req_id if x is not None else "" for x in rows]
    blank, row_of = book.BLANK, book.row
    brows = [row_of.get(rid, blank) if rid else blank for rid in rids]
    if kept is None:
        book_rows = np.array(brows, dtype=np.int64)
        new, valid, brows_t = torch.empty(n, dtype=torch.int64), None, None
        new_np = new.numpy()
    else:
        new, valid, brows_t = kept.rows(r, n)
        new_np, valid_np, book_rows = kept.np
        book_rows[:] = brows
        valid_np[:] = [x is not None for x in rows]
    fill_tokens(qsl, seq, book.buf.numpy(), book_rows, new_np)
    return rows, rids, book_rows, new, valid, brows_t


def step_of(md: Any, rows: Any, block_size: int, window: int | None, landed: np.ndarray | None,
            kept: Any = None, group: int = 0) -> Step:
    """:func:`~kvcanary.engines.vllm.steps.build_step` for one group's metadata ``md`` (``rows``: the
    forward's :class:`~kvcanary.engines.vllm.steps.Rows`; ``landed``: per row, where KV another
    connector lands starts, -1: none; ``None``: no row's), on ``kept``'s step of KV cache group
    ``group`` where its key holds (else a new one kept there)."""
    qsl = md.query_start_loc
    r = qsl.shape[0] - 1
    n = int(md.num_actual_tokens)
    if kept is None:  # this forward's own buffers
        got = _KeptStep((), md, rows, r, n, block_size, window)
    else:
        key = _key(md, rows, r, n, block_size, window)
        got = kept.steps.get(group)
        if got is None or got.key != key:
            got = kept.steps[group] = _KeptStep(key, md, rows, r, n, block_size, window)
        else:
            kept.reused += 1
    step, wf = got.refill(), got.wf
    written_from(step, wf)  # in place: the step's checked shapes and descriptor carry over to the canary
    w, c = wf.numpy(), step.cached_lens.numpy()
    np.minimum(w, c if landed is None else np.where(landed >= 0, landed, c), out=w)
    return step
