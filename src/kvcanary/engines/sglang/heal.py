"""What SGLang's scheduler does with a forward's violations, through its own abort path.

A request that SGLang's scheduler marks ``to_finish = FINISH_ABORT(...)`` during a forward finishes
when that forward's results are processed, and its slots go back through the engine's usual
release. kvcanary marks:

- ``quarantine``: every request that read corrupted KV in this forward (the violation's request;
  for a record of no request, such as the patrol's or a guard's, every row of the batch whose table
  holds the slot). Its caller gets the output so far with ``finish_reason`` ``abort`` and the
  evidence as its message; the rest of the batch goes on. Slots found corrupted stay in the radix
  cache: every later request that reads them has its first read verified byte for byte, and is
  failed in that forward too.
- ``raise``: every request of the forward, with status 500, so that each caller's ``generate``
  raises in its own thread with the canary's error (SGLang answers a scheduler that raises by
  killing the whole process tree, its caller's included, so the canary never raises there).

Both happen in the forward that found the corruption; the token sampled in that forward is the
last one such a request gets.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from kvcanary.step import Step
from kvcanary.violations import Violation

HEAL_MODES = ("quarantine",)
ERROR_TYPE = "KvCorruptionError"


def hurt(found: Iterable[Violation], step: Step | None, rids: Sequence[str]) -> set[str]:
    """The requests of this forward that read the KV these violations report: each record's request,
    and for a record of no request, every row whose table holds its slot (at the positions it
    reads or writes this forward)."""
    out: set[str] = set()
    unnamed: list[int] = []
    for v in found:
        if v.request:
            out.add(v.request)
        elif v.slot >= 0:
            unnamed.append(v.slot)
    if unnamed and step is not None and step.slot_table is not None:
        for r in holders(step, torch.tensor(unnamed, dtype=torch.int64)):
            if rids[r]:
                out.add(rids[r])
    return out


def holders(step: Step, slots: torch.Tensor) -> list[int]:
    """The rows of ``step`` whose table holds one of ``slots`` among the positions it reaches."""
    assert step.slot_table is not None
    rows = step.table_rows.long() if step.table_rows is not None else torch.arange(step.num_rows)
    ends = step.cached_lens.long() + (step.new_offsets[1:] - step.new_offsets[:-1]).long()
    width = max(1, int(ends.max()) if ends.numel() else 1)
    table = step.slot_table[rows, :width].long()
    inside = torch.arange(width)[None, :] < ends[:, None]
    hit = (torch.isin(table, slots) & inside).any(dim=1)
    return [int(r) for r in hit.nonzero().flatten()]


def fail(reqs: Sequence[Any], rids: set[str] | None, message: str, status_code: int | None) -> list[str]:
    """Mark the requests of ``reqs`` whose id is in ``rids`` (``None``: all of them) to finish with an
    abort carrying ``message``, through SGLang's own ``to_finish``; returns the ids marked."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    marked = []
    for req in reqs:
        if (rids is None or req.rid in rids) and not req.finished():
            req.to_finish = FINISH_ABORT(message, status_code, ERROR_TYPE)
            marked.append(str(req.rid))
    return marked
