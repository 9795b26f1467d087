"""Every op the canary runs, and each op's three implementations, in one table.

========  ==========================  ========================  ============================
op        torch reference             fused CPU (numba)         Triton kernel
========  ==========================  ========================  ============================
verify    ``checks.verify``           ``fused.ops.verify``      ``kernels.verify.verify``
stamp     ``checks.stamp``            ``fused.ops.stamp``       ``kernels.stamp.stamp``
content   ``KvLayout.fingerprint``    ``fused.scrub.content``   ``kernels.content.content``
scrub     ``checks.scrub``            ``fused.scrub.scrub``     ``kernels.scrub.scrub``
========  ==========================  ========================  ============================

Every implementation of an op has one signature (below), so the canary dispatches, the parity
tests compare and the benchmarks time by iterating :data:`OPS`; each backend also says how it
prepares a layout (:data:`PREPARE`). ``table`` is that prepared layout: the
:class:`~kvcanary.layout.KvLayout` itself (torch), a :class:`kvcanary.fused.fold.SourceTable`
(fused) or a :class:`kvcanary.kernels._common.SourceTable` (Triton).

- ``verify(stamps, table, step, counters, cursor, content_slots, ring, part)``: verify the step's
  reads (``part``: all of them, or those before / after its own writes, see
  :meth:`kvcanary.step.Step.split_reads`); returns nothing.
- ``stamp(stamps, table, step, counters, ring, unknown_possible)``: stamp and check the writes
  (``unknown_possible=False`` lets a backend skip looking for rows that follow an unknown slot).
- ``content(slots, table, num_slots, out)``: fingerprint ``slots`` into ``out``; a slot outside
  the pool gives 0.
- ``scrub(stamps, table, slots, counters, ring, site)``: re-fingerprint the stamped ``slots``.

Each writes violation rows into ``ring`` and counts in ``counters`` exactly as the others do.
Adding a backend is one column here and one module; adding an op is one row and three functions.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvcanary import checks
from kvcanary.errors import UnsupportedError
from kvcanary.layout import KvLayout
from kvcanary.step import Step
from kvcanary.violations import NUM_COUNTERS, NUM_FIELDS, Site, append_rows

log = logging.getLogger("kvcanary")
BACKENDS = ("torch", "fused", "triton")
ALL, BEFORE_WRITES, AFTER_WRITES = 0, 1, 2  # verify's ``part``


@dataclass(frozen=True)
class Op:
    """One op: what it does, and where each backend implements it (``module:function``)."""

    name: str
    doc: str
    impls: dict[str, str]

    def impl(self, backend: str) -> Callable[..., Any]:
        mod, fn = self.impls[backend].split(":")
        return getattr(importlib.import_module(mod), fn)


OPS: dict[str, Op] = {op.name: op for op in (
    Op("verify", "verify every slot a step reads: position, link, token, content within the budget",
       {"torch": "kvcanary.ops:torch_verify", "fused": "kvcanary.fused.ops:verify",
        "triton": "kvcanary.ops:triton_verify"}),
    Op("stamp", "stamp every slot a step wrote, fingerprint its bytes, and check the writes",
       {"torch": "kvcanary.ops:torch_stamp", "fused": "kvcanary.fused.ops:stamp",
        "triton": "kvcanary.ops:triton_stamp"}),
    Op("content", "the content fingerprint of a list of slots",
       {"torch": "kvcanary.ops:torch_content", "fused": "kvcanary.fused.scrub:content",
        "triton": "kvcanary.kernels.content:content"}),
    Op("scrub", "re-fingerprint stamped slots and compare with their stamps",
       {"torch": "kvcanary.ops:torch_scrub", "fused": "kvcanary.fused.scrub:scrub",
        "triton": "kvcanary.kernels.scrub:scrub"}),
)}

PREPARE: dict[str, str] = {
    "torch": "kvcanary.ops:torch_prepare",
    "fused": "kvcanary.fused.fold:SourceTable",
    "triton": "kvcanary.ops:triton_prepare",
}


def prepare(backend: str, layout: KvLayout, device: torch.device) -> Any:
    """The layout as ``backend``'s ops take it."""
    mod, fn = PREPARE[backend].split(":")
    return getattr(importlib.import_module(mod), fn)(layout, device)


def resolve_backend(want: str, device: torch.device) -> str:
    """The backend a canary on ``device`` runs for the configured ``want`` (``"auto"``: fused on a
    CPU pool where numba works, else torch; Triton on a GPU where it is installed)."""
    if want == "fused" and device.type != "cpu":
        raise UnsupportedError(f"backend 'fused' runs on CPU pools; this pool is on {device} (use 'triton')")
    if want == "fused" or (want == "auto" and device.type == "cpu"):
        from kvcanary.fused import available

        why = available()
        if why is None:
            return "fused"
        if want == "fused":
            raise UnsupportedError(f"backend 'fused' needs numba: {why}")
        log.warning("kvcanary: the fused CPU path is unavailable (%s); using the slower torch path", why)
        return "torch"
    if want == "torch":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        if want == "triton":
            raise UnsupportedError("backend 'triton' needs the triton package (pip install triton)") from None
        return "torch"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"):
        raise UnsupportedError(
            "backend 'triton' on a CPU pool runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1 "
            "before kvcanary's kernels are imported, or use backend 'torch'"
        )
    return "triton"


def load(backend: str) -> dict[str, Callable[..., Any]]:
    """Every op's implementation for ``backend`` (imports the backend's modules)."""
    return {name: op.impl(backend) for name, op in OPS.items()}


def restamp_followers(stamp: Callable[..., None], stamps: torch.Tensor, table: Any, step: Step,
                      unknown_possible: bool) -> None:
    """Rows whose chain continues from a slot another row wrote in this step seeded from that
    slot's old stamp: stamp them again (``stamp``: a backend's stamp op) from the new one, until
    their stamps settle (a follower of a follower needs one pass more). Reads the step on the
    host, for steps with ``written_from`` only; the passes count nothing and report nothing twice."""
    cached = step.cached_lens.long()
    new = step.new_slots.long()
    num_slots = stamps.shape[0]
    pred = step.lookup(torch.arange(step.num_rows, device=cached.device), cached - 1)
    follows = (cached > 0) & torch.isin(pred, new) & step.valid_rows()
    if not bool(follows.any()):
        return
    sub = dataclasses.replace(step, row_valid=follows, written_from=None)
    row = checks.rows_of(step.new_offsets[1:].long() - step.new_offsets[:-1].long())[0]
    theirs = new[follows[row] & (new >= 0) & (new < num_slots)]
    scratch = torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=stamps.device)
    ring = torch.zeros(1, NUM_FIELDS, dtype=torch.int64, device=stamps.device)
    for _ in range(step.num_rows):
        was = stamps[theirs]
        stamp(stamps, table, sub, scratch, ring, unknown_possible=unknown_possible)
        if torch.equal(stamps[theirs], was):
            break


def part_of(step: Step, part: int) -> Step | None:
    """The reads of ``step`` that verify's ``part`` names (``None``: none)."""
    if part == ALL:
        return step
    return step.split_reads()[part - 1] if step.written_from is not None else (step if part == BEFORE_WRITES
                                                                                   else None)


# ---- the torch reference, in the ops' signatures -------------------------------------------------


def torch_prepare(layout: KvLayout, device: torch.device) -> KvLayout:
    return layout


def _step_id(counters: torch.Tensor) -> int:
    return int(counters[0])


def torch_verify(stamps: torch.Tensor, table: KvLayout, step: Step, counters: torch.Tensor, cursor: torch.Tensor,
                 content_slots: int | None, ring: torch.Tensor, part: int = ALL) -> None:
    sub = part_of(step, part)
    if sub is not None:
        append_rows(counters, ring, checks.verify(stamps, table, sub, counters, cursor, content_slots,
                                                  _step_id(counters)))


def torch_stamp(stamps: torch.Tensor, table: KvLayout, step: Step, counters: torch.Tensor, ring: torch.Tensor,
                unknown_possible: bool = True) -> None:
    append_rows(counters, ring, checks.stamp(stamps, table, step, counters, _step_id(counters)))


def torch_content(slots: torch.Tensor, table: KvLayout, num_slots: int, out: torch.Tensor) -> None:
    s = slots.long()
    inside = (s >= 0) & (s < num_slots)
    out.copy_(torch.where(inside, table.fingerprint(torch.where(inside, s, 0)), 0))


def torch_scrub(stamps: torch.Tensor, table: KvLayout, slots: torch.Tensor, counters: torch.Tensor,
                ring: torch.Tensor, site: Site = Site.SCRUB) -> None:
    s = slots.long()
    s = s[(s >= 0) & (s < stamps.shape[0])]
    append_rows(counters, ring, checks.scrub(stamps, table, s, counters, _step_id(counters), site))


# ---- the Triton kernels' wrappers where their signature is the op's with extras -------------------


def dense(step: Step) -> Step:
    """``step`` with every tensor contiguous (the kernels index a tensor by its shape; an engine may
    hand over views, such as a slice of a wider persistent block table). No copy when already so."""
    loose = {f: v.contiguous() for f, v in vars(step).items() if isinstance(v, torch.Tensor) and not v.is_contiguous()}
    return dataclasses.replace(step, **loose) if loose else step  # type: ignore[arg-type]


def triton_prepare(layout: KvLayout, device: torch.device) -> Any:
    from kvcanary.kernels._common import source_table

    return source_table(layout, device)


def triton_verify(stamps: torch.Tensor, table: Any, step: Step, counters: torch.Tensor, cursor: torch.Tensor,
                  content_slots: int | None, ring: torch.Tensor, part: int = ALL) -> None:
    from kvcanary.kernels import verify

    sub = part_of(step, part)
    if sub is not None:
        verify.verify(stamps, table, dense(sub), counters, cursor, content_slots, ring)


def triton_stamp(stamps: torch.Tensor, table: Any, step: Step, counters: torch.Tensor, ring: torch.Tensor,
                 unknown_possible: bool = True) -> None:
    from kvcanary.kernels import stamp

    # while unknown slots may exist, a torch prologue works out the seeds of rows that follow one
    # (it reads the step on the host); otherwise the kernel seeds every row itself
    seeds = checks.canonical_seeds(stamps, step) if unknown_possible else None
    stamp.stamp(stamps, table, dense(step), counters, ring, seeds=seeds)
