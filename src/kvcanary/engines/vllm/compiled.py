"""vLLM on a CPU pool with the fused backend: a forward's rows and steps filled by compiled loops.

Equal, field for field, to :func:`kvcanary.engines.vllm.steps.match_rows` and
:func:`~kvcanary.engines.vllm.steps.build_step`'s torch construction (``tests/test_vllm_steps.py``
compares them on random batches with windows, drafts, padding rows and landed KV). The host work
left per forward is one dict lookup per row (matching rows to the scheduler's request records) and
the token book's new tokens; the new tokens' ids, each group's new-token fields and where its reads
of this step's own writes start are compiled loops over the metadata's own arrays. The steps read
the token book's record in place: nothing is copied per cached position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcanary.engines.block_table import read_starts
from kvcanary.fused.block_steps import fill_new, fill_tokens
from kvcanary.fused.steps import written_from
from kvcanary.step import Step


def rows_of(md: Any, reqs: list, book: Any, qsl: np.ndarray, seq: np.ndarray) -> tuple[list, list[str], np.ndarray,
                                                                                        torch.Tensor]:
    """:func:`~kvcanary.engines.vllm.steps.match_rows`' matching and new tokens: each row's request
    record (None: padding), id and row of the token book, and each new token's id from the book
    (the drafts are laid over it after). ``qsl`` and ``seq``: the metadata's query starts and
    sequence lengths as numpy."""
    r = qsl.shape[0] - 1
    n = int(md.num_actual_tokens)
    by_slot = {x.first_slot: x for x in reqs}
    if n:
        first = md.slot_mapping.numpy()[:n][np.minimum(qsl[:-1], n - 1)].tolist()
        rows = [by_slot.get(s) if q > 0 else None for s, q in zip(first, np.diff(qsl).tolist())]
    else:
        rows = [None] * r
    rids = [x.req_id if x is not None else "" for x in rows]
    blank, row_of = book.BLANK, book.row
    book_rows = np.fromiter((row_of.get(rid, blank) if rid else blank for rid in rids), dtype=np.int64, count=r)
    new = torch.empty(n, dtype=torch.int64)
    fill_tokens(qsl, seq, book.buf.numpy(), book_rows, new.numpy())
    return rows, rids, book_rows, new


def step_of(md: Any, rows: Any, block_size: int, window: int | None, landed: np.ndarray | None) -> Step:
    """:func:`~kvcanary.engines.vllm.steps.build_step` for one group's metadata ``md`` (``rows``: the
    forward's :class:`~kvcanary.engines.vllm.steps.Rows`; ``landed``: per row, where KV another
    connector lands starts, -1: none; ``None``: no row's)."""
    qsl = md.query_start_loc
    r = qsl.shape[0] - 1
    n = int(md.num_actual_tokens)
    cached = torch.empty(r, dtype=torch.int64)
    new_positions, new_slots = (torch.empty(n, dtype=torch.int64) for _ in range(2))
    fill_new(qsl.numpy(), md.seq_lens.numpy(), md.slot_mapping.numpy(), rows.valid.numpy(), cached.numpy(),
             new_positions.numpy(), new_slots.numpy())
    wf = torch.empty(r, dtype=torch.int64)
    step = Step(cached_lens=cached, new_offsets=qsl[: r + 1], new_tokens=rows.new_tokens, new_positions=new_positions,
                new_slots=new_slots, block_table=md.block_table[:r], block_size=block_size, row_valid=rows.valid,
                expected_tokens=rows.record, expected_rows=rows.record_rows, read_starts=read_starts(cached, window),
                written_from=wf)
    written_from(step, wf)  # in place: the step's checked shapes and descriptor carry over to the canary
    w, c = wf.numpy(), cached.numpy()
    np.minimum(w, c if landed is None else np.where(landed >= 0, landed, c), out=w)
    return step
