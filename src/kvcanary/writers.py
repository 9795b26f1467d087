"""Each slot's last writer, ``(step, step row)``, for the diagnosis' owner lookup: an int64
``[num_slots + 1, 2]`` table on the pool's device, whose last row takes the writes that fell
outside the pool (device ops only; the fused path fills it in its compiled stamp)."""

from __future__ import annotations

import torch

from kvcanary.step import Step


def new_writers(num_slots: int, device: torch.device) -> torch.Tensor:
    """A table with no writer yet (-1)."""
    return torch.full((num_slots + 1, 2), -1, dtype=torch.int64, device=device)


def note_writers(writers: torch.Tensor, step: Step, step_id: int | torch.Tensor, fused: bool) -> None:
    """Record ``step_id`` and each written slot's row of ``step`` as the slot's last writer."""
    num_slots = writers.shape[0] - 1
    if fused:
        from kvcanary.fused.steps import note_writers as fused_note_writers

        fused_note_writers(step, writers, num_slots, int(step_id))
        return
    offs = step.new_offsets.long()
    row = torch.repeat_interleave(torch.arange(step.num_rows, device=writers.device), offs[1:] - offs[:-1],
                                  output_size=step.num_new)
    slots = step.new_slots.long()
    ok = (slots >= 0) & (slots < num_slots) & step.valid_rows()[row]
    idx = torch.where(ok, slots, num_slots)
    writers[idx, 0] = step_id
    writers[idx, 1] = row


def last_writer(writers: torch.Tensor, slot: int) -> tuple[int, int] | None:
    """The step and step row that last wrote ``slot`` (``None``: none recorded)."""
    if not 0 <= slot < writers.shape[0] - 1:
        return None
    step, row = (int(x) for x in writers[slot])
    return None if step < 0 else (step, row)
