"""Steps from paged-attention metadata: a block table, sequence lengths, query start offsets and a slot
mapping (vLLM's attention metadata; transformers' decode fast path).

Imports nothing of any engine's: the tests build steps from stand-in metadata.
"""

from __future__ import annotations

import torch

from kvcanary.step import Step

FAR = 1 << 62  # beyond every slot and position


def step_from_block_table(block_table: torch.Tensor, block_size: int, query_start: torch.Tensor,
                          seq_lens: torch.Tensor, slot_mapping: torch.Tensor, tokens: torch.Tensor,
                          valid: torch.Tensor, read_starts: torch.Tensor | None = None,
                          expected_rows: torch.Tensor | None = None, new_tokens: torch.Tensor | None = None) -> Step:
    """A step from paged-attention metadata: ``R`` rows, ``T`` new tokens.

    Parameters
    ----------
    block_table : int ``[>= R, max_blocks]`` each row's blocks
    query_start : int ``[R + 1]`` cumulative new-token counts
    seq_lens : int ``[>= R]`` each row's length after this step (cached + new)
    slot_mapping : int ``[T]`` the slot each new token is written to
    tokens : int ``[R, width]`` each row's known token stream, -1 where unknown (the new tokens'
        ids are read from it); with ``expected_rows``, a token record whose row ``expected_rows[r]``
        is row ``r``'s stream
    new_tokens : int ``[T]`` the new tokens' ids, where they are not all in ``tokens`` (drafts)
    valid : bool ``[R]`` rows the adapter matched to a request (others are padding)
    read_starts : int ``[R]`` the first position each row's attention reads (a sliding window;
        ``None``: position 0)

    Reads of slots the step itself writes start ``written_from`` (verified after the writes).
    """
    qsl = query_start.long()
    r = qsl.shape[0] - 1
    q = qsl[1:] - qsl[:-1]
    cached = seq_lens[:r].long() - q
    n = int(slot_mapping.shape[0])
    row = torch.repeat_interleave(torch.arange(r, device=qsl.device), q, output_size=n)
    pos = cached[row] + (torch.arange(n, device=qsl.device) - qsl[:-1][row])
    if new_tokens is None:
        trow = row if expected_rows is None else expected_rows.long()[row]
        new_tokens = torch.where(pos < tokens.shape[1], tokens[trow, pos.clamp(max=tokens.shape[1] - 1)], -1)
    step = Step(
        cached_lens=cached, new_offsets=qsl, new_tokens=new_tokens,
        new_positions=pos, new_slots=torch.where(valid[row], slot_mapping.long(), -1),
        block_table=block_table[:r], block_size=block_size, row_valid=valid, expected_tokens=tokens,
        expected_rows=expected_rows, read_starts=read_starts,
    )
    step.written_from = written_from(step)
    return step


def written_from(step: Step, fused: bool | None = None) -> torch.Tensor:
    """Per row, the first position it reads (``read_starts`` on) whose slot this step writes
    (``cached_len`` if none).
    On a CPU step with the fused path available (``fused=None``: whenever it is), one compiled pass
    over the table entries; on a block-table step on another device, a search of the table's blocks
    that reads nothing back (:func:`written_from_blocks`); otherwise a ``[rows, max cached]`` lookup
    and ``isin``."""
    if fused is None and step.cached_lens.device.type != "cpu" and step.block_table is not None:
        return written_from_blocks(step)
    if fused is None:
        from kvcanary.fused import available

        fused = step.cached_lens.device.type == "cpu" and available() is None
    if fused:
        from kvcanary.fused.steps import written_from as fused_written_from

        return fused_written_from(step)
    cached = step.cached_lens.long()
    width = max(1, int(cached.max()) if cached.numel() else 1)
    pos = torch.arange(width, device=cached.device)
    rows = torch.arange(step.num_rows, device=cached.device)
    read = step.lookup(rows.repeat_interleave(width), pos.repeat(step.num_rows)).view(step.num_rows, width)
    inside = (pos[None, :] < cached[:, None]) & (pos[None, :] >= step.starts()[:, None])
    hit = torch.isin(read, step.new_slots[step.new_slots >= 0]) & inside
    first = torch.where(hit, pos[None, :], width).min(dim=1).values
    return torch.minimum(first, cached)


def read_starts(cached: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """The first position each row's attention reads: ``None`` (all of them) without a window; with
    a sliding ``window`` the kernel reads positions ``p - window + 1 .. p`` for a query at ``p``, so a
    row whose first new token is at ``cached`` reads from ``cached - window + 1`` (at most
    ``cached - 1``: the first new token's link chains from there)."""
    if window is None:
        return None
    lo = (cached - window + 1).clamp(min=0)
    return torch.minimum(lo, (cached - 1).clamp(min=0))


def written_from_blocks(step: Step) -> torch.Tensor:
    """Per row, the first position it reads (``read_starts`` on, before ``cached_lens``) whose slot
    this step writes, else ``cached_lens``: for each table entry, the smallest written slot at or
    past the entry's first read slot, if it falls inside the entry's read span."""
    bs = step.block_size
    assert step.block_table is not None and bs is not None
    table = step.block_table.long()
    cached, starts = step.cached_lens.long(), step.starts()
    written = torch.where(step.new_slots >= 0, step.new_slots.long(), FAR)
    ordered = torch.cat([torch.sort(written).values, torch.full((1,), FAR, dtype=torch.int64, device=table.device)])
    lo_block = torch.arange(table.shape[1], device=table.device) * bs  # each entry's first position
    lo = torch.maximum(lo_block[None, :], starts[:, None])
    hi = torch.minimum(lo_block[None, :] + bs, cached[:, None])
    base = table * bs - lo_block[None, :]  # slot = base + position, inside the entry
    hit = ordered[torch.searchsorted(ordered, (base + lo).contiguous())]
    inside = (hi > lo) & (table >= 0) & (hit < base + hi)
    first = torch.where(inside, hit - base, FAR).amin(dim=1) if table.shape[1] else cached
    return torch.minimum(first, cached)
