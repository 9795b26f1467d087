"""transformers continuous batching: the Steps of a forward, one per layer group, built from the
batch's own metadata (``read_index``, ``write_index``, the requests' lengths)."""

from __future__ import annotations

from typing import Any

import torch

from kvcanary import checks
from kvcanary.engines.token_book import TokenBook
from kvcanary.engines.transformers import hooks as cb_hooks
from kvcanary.engines.transformers.groups import Group
from kvcanary.step import Step


def padding_writes(groups: dict[str, Group], batch: dict, steps: dict[str, Step]) -> dict[str, torch.Tensor]:
    """Each group's slots that the batch's padding tokens write (the write index past the real
    tokens, when the batch is padded to a static size), -1 where they go to the write trash as
    they should. Empty for an unpadded batch (the usual case on a CPU) and on the fast path."""
    out = {}
    if batch.get("block_table") is None:
        for name, step in steps.items():
            g = groups[name]
            write = batch["write_index"][g.index]
            if write.shape[0] > step.num_new:
                pad = write[step.num_new :].long()
                out[name] = torch.where(pad == g.trash, -1, g.compact(pad))
    return out


def build_steps(groups: dict[str, Group], book: TokenBook | None, runner: Any, batch: dict,
                reqs: list | None = None, fused: bool | None = None, builder: Any = None) -> dict[str, Step]:
    """One Step per layer group from a forward's own metadata, on the batch's device.

    ``reqs`` are the batch's requests (default: read from the runner). Shapes come from the
    requests' host-side lengths and the index tensors' own sizes, so no device value is read on
    the host; host-built tensors travel through pinned memory. On a CPU pool with the fused
    backend (``fused=None``: whenever the groups use it) the steps are filled by compiled loops
    (:class:`kvcanary.engines.transformers.compiled.StepBuilder`; ``builder``: the one that keeps
    this protection's buffers between forwards).
    """
    if reqs is None:
        reqs = list(cb_hooks.host_io(runner.inputs_and_outputs).requests_in_batch)
    r = len(reqs)
    if r == 0:
        return {}
    dev = batch["input_ids"].device
    if fused is None:
        fused = dev.type == "cpu" and next(iter(groups.values())).canary.backend == "fused"
    if fused and batch.get("block_table") is None:
        from kvcanary.engines.transformers.compiled import StepBuilder

        return (builder or StepBuilder()).build(groups, book, batch, reqs)
    q_host = torch.tensor([fs.query_length for fs in reqs], dtype=torch.int64)
    past_host = torch.tensor([fs.state.position_offset - fs.query_length for fs in reqs], dtype=torch.int64)
    wrow_host, j = checks.rows_of(q_host)
    total = wrow_host.shape[0]
    width = max(1, int((past_host + q_host).max()))
    wpos_host = past_host[wrow_host] + j
    erows_host = exp_tok = None
    if book is not None:  # the steps read the book's record in place, a copy of it on a CUDA pool's device
        erows_host = torch.tensor(book.update([fs.state for fs in reqs], (past_host + q_host).tolist()))
    past, wrow, wpos, erows = cb_hooks.to_device(dev, past_host, wrow_host, wpos_host, erows_host)
    exp_new = None
    if book is not None:
        exp_tok = book.on(dev)
        exp_new = exp_tok[erows[wrow], wpos]  # positions below the rows' lengths: inside the record
    if batch.get("block_table") is not None:
        return fast_path_steps(groups, batch, past, exp_tok, erows, exp_new, r)
    cu_q = batch["cu_seq_lens_q"][: r + 1].long()
    q = cu_q[1:] - cu_q[:-1]
    tokens = batch["input_ids"][0, :total]
    positions = batch["position_ids"][0, :total]
    steps = {}
    for name, g in groups.items():
        cu_k = batch["cu_seq_lens_k"]
        cu_k = (cu_k[name] if isinstance(cu_k, dict) else cu_k)[: r + 1].long()
        read = batch["read_index"][g.index]
        # row r and column width are scratch: entries that are not cached reads land there
        table = torch.full((r + 1, width + 1), -1, dtype=torch.int64, device=dev)
        ncached = torch.zeros_like(q)
        if read.numel():
            ncached = cu_k[1:] - cu_k[:-1] - q
            e = torch.arange(read.shape[0], device=dev)
            rrow = torch.searchsorted(cu_k, e, right=True) - 1  # r past the last row's reads
            rr = rrow.clamp(max=r - 1)
            j = e - cu_k[rr]
            cached = (rrow < r) & (j < ncached[rr])
            pos = past[rr] - ncached[rr] + j
            table[torch.where(cached, rr, r), torch.where(cached, pos, width)] = g.compact(read)
        write = batch["write_index"][g.index][:total].long()
        wslot = torch.where(write == g.trash, -1, g.compact(write))
        table[wrow, wpos] = wslot
        steps[name] = Step(
            slot_table=table, cached_lens=past, read_starts=past - ncached, new_offsets=cu_q,
            new_tokens=tokens, new_positions=positions, new_slots=wslot,
            expected_tokens=exp_tok, expected_rows=erows, expected_new_tokens=exp_new,
        )
    return steps


def fast_path_steps(groups: dict[str, Group], batch: dict, past: torch.Tensor, exp_tok: torch.Tensor | None,
                    erows: torch.Tensor | None, exp_new: torch.Tensor | None, r: int) -> dict[str, Step]:
    """The steps of a decode fast-path forward (one new token per request; flash attention reads
    and writes the cache through ``batch["block_table"]``, int32 ``[groups, >= R, max_blocks]`` of
    page indices, -1 where unused; the read and write indices are stale there and not used).

    Each group's step is a block-table step over its compact slots: the block of a page index is
    ``index // (block_physical_stride // tokens_per_page)`` (a page index counts pages of
    ``tokens_per_page`` rows), and the new token of row ``r`` goes to
    position ``past[r]`` of its table.
    """
    tokens = batch["input_ids"][0, :r]
    positions = batch["position_ids"][0, :r]
    rows = torch.arange(r, device=past.device)
    steps = {}
    for name, g in groups.items():
        blocks = g.pages.blocks_of_pages(batch["block_table"][g.index][:r])
        bs = g.block_size
        col = torch.div(past, bs, rounding_mode="floor").clamp(max=blocks.shape[1] - 1)
        slot = blocks[rows, col] * bs + past % bs
        steps[name] = Step(
            block_table=blocks, block_size=bs, cached_lens=past, new_offsets=torch.arange(r + 1, device=past.device),
            new_tokens=tokens, new_positions=positions, new_slots=torch.where(blocks[rows, col] >= 0, slot, -1),
            expected_tokens=exp_tok, expected_rows=erows, expected_new_tokens=exp_new,
        )
    return steps
