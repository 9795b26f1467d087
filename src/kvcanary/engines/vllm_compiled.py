"""vLLM on a CPU pool with the fused backend: a forward's rows and steps filled by compiled loops.

Equal, field for field, to :func:`kvcanary.engines.vllm_steps.match_rows` and
:func:`~kvcanary.engines.vllm_steps.build_step`'s torch construction (``tests/test_vllm_steps.py``
compares them on random batches with windows, drafts, padding rows and landed KV). The host work
left per forward is one dict lookup per row (matching rows to the scheduler's request records) and
the token book's new tokens; the token window, each group's new-token fields and where its reads of
this step's own writes start are compiled loops over the metadata's own arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcanary.fused._core import JIT
from kvcanary.fused.cache import njit
from kvcanary.step import Step


@njit(**JIT)
def fill_window(book, book_rows, upto, out):  # type: ignore[no-untyped-def]
    """``out[r]``: row ``book_rows[r]`` of the token book up to ``upto[r]``, then -1 (a row with
    ``book_rows[r] < 0`` is all -1)."""
    width = out.shape[1]
    for r in range(out.shape[0]):
        u = min(upto[r], width) if book_rows[r] >= 0 else 0
        u = min(u, book.shape[1])
        for p in range(u):
            out[r, p] = book[book_rows[r], p]
        for p in range(u, width):
            out[r, p] = -1


@njit(**JIT)
def fill_new(qsl, seq, slot_mapping, tokens, valid, cached, new_tokens, new_positions, new_slots):  # type: ignore[no-untyped-def]
    """Each row's cached length and each new token's id (from ``tokens``, the rows' streams),
    position and slot (-1 in a padding row), as :func:`kvcanary.engines.base.step_from_block_table`."""
    r = cached.shape[0]
    width = tokens.shape[1]
    for row in range(r):
        q = qsl[row + 1] - qsl[row]
        c = np.int64(seq[row]) - q
        cached[row] = c
        for t in range(qsl[row], qsl[row + 1]):
            pos = c + (t - qsl[row])
            new_positions[t] = pos
            new_tokens[t] = tokens[row, min(max(pos, 0), width - 1)] if width else -1
            new_slots[t] = slot_mapping[t] if valid[row] else -1


def rows_of(md: Any, reqs: list, book: Any) -> tuple[list, list[str], torch.Tensor]:
    """:func:`~kvcanary.engines.vllm_steps.match_rows`' matching and token window: each row's request
    record (None: padding), id, and token streams ``[R, width]``."""
    qsl = md.query_start_loc.numpy()
    r = qsl.shape[0] - 1
    n = int(md.num_actual_tokens)
    seq = md.seq_lens.numpy()[:r].astype(np.int64)
    by_slot = {x.first_slot: x for x in reqs}
    if n:
        first = md.slot_mapping.numpy()[:n][np.minimum(qsl[:-1], n - 1)].tolist()
        rows = [by_slot.get(s) if q > 0 else None for s, q in zip(first, np.diff(qsl).tolist())]
    else:
        rows = [None] * r
    rids = [x.req_id if x is not None else "" for x in rows]
    book_rows = np.fromiter((book.row.get(rid, -1) if rid else -1 for rid in rids), dtype=np.int64, count=r)
    width = max(int(seq.max()) if r else 1, 1)
    tokens = torch.empty((r, width), dtype=torch.int64)
    fill_window(book.buf.numpy(), book_rows, seq, tokens.numpy())
    return rows, rids, tokens


def step_of(md: Any, tokens: torch.Tensor, valid: torch.Tensor, block_size: int, window: int | None,
            landed: np.ndarray) -> Step:
    """:func:`~kvcanary.engines.vllm_steps.build_step` for one group's metadata ``md`` (``landed``: per
    row, where KV another connector lands starts; -1: none)."""
    from kvcanary.engines.vllm_steps import read_starts
    from kvcanary.fused.steps import written_from

    qsl = md.query_start_loc
    r = qsl.shape[0] - 1
    n = int(md.num_actual_tokens)
    cached = torch.empty(r, dtype=torch.int64)
    new_tokens, new_positions, new_slots = (torch.empty(n, dtype=torch.int64) for _ in range(3))
    fill_new(qsl.numpy(), md.seq_lens.numpy(), md.slot_mapping.numpy(), tokens.numpy(), valid.numpy(),
             cached.numpy(), new_tokens.numpy(), new_positions.numpy(), new_slots.numpy())
    wf = torch.empty(r, dtype=torch.int64)
    step = Step(cached_lens=cached, new_offsets=qsl[: r + 1], new_tokens=new_tokens, new_positions=new_positions,
                new_slots=new_slots, block_table=md.block_table[:r], block_size=block_size, row_valid=valid,
                expected_tokens=tokens, read_starts=read_starts(cached, window), written_from=wf)
    written_from(step, wf)  # in place: the step's checked shapes and descriptor carry over to the canary
    np.minimum(wf.numpy(), np.where(landed >= 0, landed, cached.numpy()), out=wf.numpy())
    return step
