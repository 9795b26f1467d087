"""A forward's steps from vLLM's attention metadata where it lives, on the device, without the host
waiting: the GPU counterpart of :func:`~kvcanary.engines.vllm.steps.match_rows` and
:func:`~kvcanary.engines.vllm.steps.build_step`, equal to them field for field
(``tests/test_vllm_device_steps.py``). Imports nothing of vLLM's.

The host knows only what the scheduler side sent (each scheduled request's first new slot, token
book row, drafts and landed KV); it lays those out once per forward, sorted by first slot, and
sends them with one non-blocking copy. The device matches each metadata row to its request by the
slot of its first new token (a binary search), reads the new tokens' ids from the token book's
device copy with the drafts laid over them, and finds, per row, the first read position whose
slot this step writes by a binary search of the table's blocks among the written slots: a
``[rows, table width]`` search in place of the host path's ``[rows, longest context]`` lookup,
and no value read back. Every shape is fixed by the metadata's shapes and the host's own counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcanary.engines.block_table import FAR, read_starts, written_from_blocks
from kvcanary.engines.token_book import TokenBook
from kvcanary.engines.vllm.steps import ReqStep, Rows
from kvcanary.step import Step



@dataclass
class DeviceRows:
    """A forward's rows matched to their requests on the device (every tensor on the metadata's device).

    ``req`` is each row's index into the host's ``reqs`` sorted by first slot (-1: padding); the
    host reads it only after the forward, when it needs request ids (diagnosis), never inside.
    """

    order: list[ReqStep]  # the scheduled requests, by first slot
    req: torch.Tensor  # int64 [R]
    valid: torch.Tensor  # bool [R]
    record: torch.Tensor  # int64 [book rows, capacity]: the token book's device copy
    record_rows: torch.Tensor  # int64 [R]
    new_tokens: torch.Tensor  # int64 [T]
    landed: torch.Tensor  # int64 [R]: where KV another connector lands starts (-1: none)


def _host_table(reqs: list[ReqStep], book: TokenBook) -> tuple[list[ReqStep], np.ndarray, np.ndarray]:
    """The requests by first slot; per request ``[first slot, book row, first draft position, drafts,
    landed from]`` and its drafts ``[M, max drafts]`` (-1 pad)."""
    order = sorted(reqs, key=lambda x: x.first_slot)
    k = max([len(x.drafts) for x in order] + [1])
    cols = np.empty((len(order), 5), dtype=np.int64)
    drafts = np.full((len(order), k), -1, dtype=np.int64)
    for i, x in enumerate(order):
        cols[i] = (x.first_slot, book.row.get(x.req_id, book.BLANK), x.computed + x.scheduled - len(x.drafts),
                   len(x.drafts), x.landed_from)
        drafts[i, : len(x.drafts)] = x.drafts
    return order, cols, drafts


def _sent(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.clone() if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def device_rows(md: Any, reqs: list[ReqStep], book: TokenBook) -> DeviceRows:
    """Match the rows of the primary group's metadata ``md`` to ``reqs`` on ``md``'s device."""
    dev = md.query_start_loc.device
    order, cols, drafts = _host_table(reqs, book)
    m = len(order)
    c, d = _sent(np.concatenate([cols, np.full((1, 5), FAR, dtype=np.int64)]), dev), _sent(drafts, dev)
    qsl = md.query_start_loc.long()
    r, n = qsl.shape[0] - 1, int(md.num_actual_tokens)  # the host's own count, not a device value
    q = qsl[1:] - qsl[:-1]
    first = md.slot_mapping[:n].long()[qsl[:-1].clamp(max=max(n - 1, 0))] if n else torch.full_like(q, -1)
    k = torch.searchsorted(c[:, 0].contiguous(), first).clamp(max=m)
    valid = (q > 0) & (c[k, 0] == first)
    req = torch.where(valid, k, -1)
    record = book.on(dev)
    record_rows = torch.where(valid, c[k, 1], book.BLANK)
    row = torch.repeat_interleave(torch.arange(r, device=dev), q, output_size=n)
    cached = md.seq_lens[:r].long() - q
    pos = cached[row] + (torch.arange(n, device=dev) - qsl[:-1][row])
    width = record.shape[1]
    tokens = torch.where(pos < width, record[record_rows[row], pos.clamp(max=width - 1)], -1)
    kt = k[row]  # each new token's request (m: none)
    j = pos - c[kt, 2]
    drafted = valid[row] & (j >= 0) & (j < c[kt, 3])
    if m:
        tokens = torch.where(drafted, d[kt.clamp(max=m - 1), j.clamp(0, d.shape[1] - 1)], tokens)
    landed = torch.where(valid, c[k, 4], -1)
    return DeviceRows(order, req, valid, record, record_rows, tokens, landed)


def device_step(md: Any, rows: DeviceRows, block_size: int, window: int | None) -> Step:
    """One KV cache group's step from its metadata ``md``, as
    :func:`~kvcanary.engines.vllm.steps.build_step` builds it, on the device."""
    qsl = md.query_start_loc.long()
    r, n = qsl.shape[0] - 1, int(md.num_actual_tokens)
    dev = qsl.device
    q = qsl[1:] - qsl[:-1]
    cached = md.seq_lens[:r].long() - q
    row = torch.repeat_interleave(torch.arange(r, device=dev), q, output_size=n)
    pos = cached[row] + (torch.arange(n, device=dev) - qsl[:-1][row])
    step = Step(cached_lens=cached, new_offsets=qsl, new_tokens=rows.new_tokens, new_positions=pos,
                new_slots=torch.where(rows.valid[row], md.slot_mapping[:n].long(), -1),
                block_table=md.block_table[:r], block_size=block_size, row_valid=rows.valid,
                expected_tokens=rows.record, expected_rows=rows.record_rows, read_starts=read_starts(cached, window))
    landed = torch.where(rows.landed >= 0, rows.landed, cached)
    step.written_from = torch.minimum(written_from_blocks(step), landed)
    return step


def resolve(rows: DeviceRows) -> Rows:
    """The rows' requests read back on the host, once the forward ran: the :class:`Rows` the host
    path matches before the forward (a draft the scheduler had not filled in makes ``unknown_new``)."""
    per = [rows.order[k] if k >= 0 else None for k in rows.req.tolist()]
    rids = [x.req_id if x is not None else "" for x in per]
    unknown = any(d < 0 for x in per if x is not None for d in x.drafts)
    return Rows(per, rids, rows.valid, rows.record, rows.record_rows, rows.new_tokens, unknown)
