"""The checks of a canary's arguments: a step's kind, shapes, page size and device (no values read),
then its values where the canary validates, and on the fused path the step's descriptor, made once
per step and canary; and the slot lists, block lists and travelling stamps the engine hands over."""

from __future__ import annotations

from typing import Any

import torch

from kvcanary.errors import KvCanaryError, StepError, UnsupportedError
from kvcanary.step import Step


def check_step(step: Step, pages: frozenset[int], device: torch.device) -> None:
    """The checks of a step that read no values: its kind, shapes, page size and device."""
    if not isinstance(step, Step):
        raise StepError(f"step: expected a kvcanary.step.Step, got {type(step).__name__}")
    step.validate_shapes()
    if pages:
        check_pages(step, pages)
    if step.cached_lens.device != device:
        raise UnsupportedError(f"step tensors on {step.cached_lens.device}, the canary's pool on {device}")


def check_pages(step: Step, pages: frozenset[int]) -> None:
    """A block table step's ``block_size`` must be the layout's page size (``pages``: the page sizes of
    its paged sources): slot ``b * block_size + i`` is then in-page slot ``i`` of page ``b``, and the
    fingerprints read the bytes the engine wrote. Tables of slot ids (a ``slot_table``, or a block
    table with block size 1) address any layout. Checked once per step until a field of it is
    assigned (:meth:`Step.memo`)."""
    memo = step.memo()
    if memo.get("pages_ok") == pages:
        return
    if step.block_table is not None and step.block_size != 1 and pages != {step.block_size}:
        raise StepError(f"block_size: expected {' or '.join(map(str, sorted(pages)))} (the page size of the "
                        f"layout's paged sources), got {step.block_size}: the content checks would read other "
                        "slots' bytes")
    memo["pages_ok"] = pages


def prepare(step: Step, pages: frozenset[int], device: torch.device, num_slots: int, validate: bool,
            fused: bool) -> None:
    """:func:`check_step`, then (``validate``) the values: on the fused path one compiled pass over the
    rows (cheaper than telling it is unchanged), else once until a tensor of the step changes."""
    check_step(step, pages, device)
    if validate:
        if fused:
            from kvcanary.fused.steps import validate as fused_validate

            fused_validate(step, num_slots)
        else:
            step.validate_once(num_slots)


def described(step: Step, owner: Any, pages: frozenset[int], device: torch.device) -> Any:
    """The fused path's descriptor of ``step``, after the checks of :func:`check_step` (those that read
    values run inside the compiled entry); both kept in the step's memo for ``owner`` (a canary)."""
    from kvcanary.fused._step import describe

    if isinstance(step, Step):
        memo = step.memo()
        if memo.get("prepared") is owner:
            return describe(step)  # (with the entries of a field assigned through Step.assign_new remade)
    check_step(step, pages, device)

    d = describe(step)
    step.memo()["prepared"] = owner
    return d


def checked_slots(name: str, slots: Any, device: torch.device, num_slots: int, validate: bool) -> torch.Tensor:
    """``slots`` as int64 on the pool's device, checked: a 1-d integer tensor of slots in the pool
    (the values read on a CPU pool, and on a CUDA pool when validating)."""
    if not isinstance(slots, torch.Tensor):
        raise KvCanaryError(f"{name}: expected a 1-d integer torch.Tensor of slot ids, got {type(slots).__name__}")
    if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
        raise KvCanaryError(f"{name}: expected a 1-d integer tensor, got {slots.dtype} {tuple(slots.shape)}")
    if slots.device != device:
        raise KvCanaryError(f"{name}: expected slots on {device} (the pool's device), got {slots.device}")
    if slots.numel() and (validate or slots.device.type == "cpu"):
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_slots:
            bad = lo if lo < 0 else hi
            raise KvCanaryError(f"{name}: expected slot ids in [0, {num_slots}), got {bad}")
    return slots.long()


def check_blocks(blocks: list[int], block_size: Any, num_slots: int) -> None:
    """Block ids (non-empty) of ``block_size`` slots each, in a pool of ``num_slots``."""
    if not isinstance(block_size, int) or block_size <= 0 or num_slots % block_size:
        raise KvCanaryError(f"block_size: expected a positive int dividing the pool's {num_slots} slots, "
                            f"got {block_size!r}")
    lo, hi = min(blocks), max(blocks)
    if lo < 0 or hi >= num_slots // block_size:
        raise KvCanaryError(f"blocks: expected block ids in [0, {num_slots // block_size}), got {lo if lo < 0 else hi}")


def checked_stamps(stamps: Any, n: int, device: torch.device) -> torch.Tensor:
    """Stamps that travelled with ``n`` slots' KV (int ``[n, 4]``), as int64 on the pool's ``device``."""
    if not isinstance(stamps, torch.Tensor) or stamps.shape != (n, 4):
        got = tuple(stamps.shape) if isinstance(stamps, torch.Tensor) else type(stamps).__name__
        raise KvCanaryError(f"stamps: expected shape ({n}, 4), got {got}")
    return stamps.to(device, torch.int64)


def refuse(step: Step, num_slots: int) -> None:
    """Raise the worded error of a step whose values the compiled check refused."""
    step.validate_values(num_slots)
    raise KvCanaryError("kvcanary internal error: the fused step check refused a step the torch check accepts")
