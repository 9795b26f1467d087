"""The object an engine talks to: stamps one KV pool, verifies reads, stamps writes, reports."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from typing import Any, Callable, Iterable, TypeVar

import numpy as np
import torch

from kvcanary import checks, eventlog, ops
from kvcanary.config import CanaryConfig
from kvcanary.diagnosis import annotate
from kvcanary.errors import ConfigError, KvCanaryError, KvCorruptionError, LayoutError, StepError, UnsupportedError
from kvcanary.harm import CheckLedger
from kvcanary.layout import KvLayout
from kvcanary.step import Step
from kvcanary.violations import F_STEP, Check, Counter, Site, Violation, ViolationRing, append_rows, events

log = logging.getLogger("kvcanary")
MAX_SLOTS = 1 << 62  # slot ids and byte offsets are int64
F = TypeVar("F", bound=Callable[..., Any])
_SCRUB_COUNTERS = [int(Counter.SLOTS_SCRUBBED), int(Counter.CONTENT_BYTES_SCRUBBED)]


def _guarded(recover: Callable[..., None] | None = None) -> Callable[[F], F]:
    """Skip in ``off`` mode; in ``log`` and ``quarantine`` mode count and log internal errors
    instead of raising, then run ``recover(self, *args)``: the slots the failed op should have
    stamped become unknown, so the canary's own failure never turns into false reports later."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: "Canary", *args: Any, **kwargs: Any) -> Any:
            if self.config.mode == "off" or self.disabled:
                return None
            if self.config.mode == "raise":
                return fn(self, *args, **kwargs)
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # log mode never raises into the engine
                self.note_internal_error(fn.__name__, e)
                if recover is not None:
                    self._recover(recover, *args)
                return None

        return wrapper  # type: ignore[return-value]

    return deco


def _forget_written(self: "Canary", step: Step, *_: Any) -> None:
    if not isinstance(step, Step):  # which slots the forward wrote is unknown
        self.forget_all()
        return
    slots = step.new_slots.long()
    self._forget(slots[(slots >= 0) & (slots < self.num_slots)])


def _forget_slots(self: "Canary", slots: torch.Tensor, *_: Any) -> None:
    slots = slots.long()
    self._forget(slots[(slots >= 0) & (slots < self.num_slots)])


class Canary:
    """Stamps and checks one pool of ``num_slots`` KV slots.

    Call :meth:`before_forward` with the step before the engine's forward reads the cache,
    :meth:`after_forward` after the forward wrote its new KV, and :meth:`poll` whenever the host
    may sync to drain and report violations. Tell it when the engine frees slots
    (:meth:`release`): a read of a released slot before a new write is ``EMPTY``.

    Parameters
    ----------
    num_slots : slots in the pool (slot ids ``0 .. num_slots - 1``)
    layout : where each slot's KV bytes live; ``None`` or empty for metadata-only checks
    config : see :class:`CanaryConfig`
    device : the pool's device (default: the layout's, else CPU)
    on_violation : callbacks called with each batch of drained violations (quarantine hooks); in
        ``log`` and ``quarantine`` mode a callback that raises is counted as an internal error
    """

    def __init__(
        self,
        num_slots: int,
        layout: KvLayout | None = None,
        config: CanaryConfig | None = None,
        device: torch.device | str | None = None,
        on_violation: Iterable[Callable[[list[Violation]], None]] = (),
    ) -> None:
        if config is not None and not isinstance(config, CanaryConfig):
            raise ConfigError(f"config: expected a CanaryConfig, got {type(config).__name__} {config!r}")
        self.config = config or CanaryConfig()
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or not 0 < num_slots < MAX_SLOTS:
            raise ConfigError(f"num_slots: expected an integer in 1 .. {MAX_SLOTS - 1}, got {num_slots!r}")
        if layout is not None and not isinstance(layout, KvLayout):
            raise ConfigError(f"layout: expected a KvLayout or None, got {type(layout).__name__}")
        layout = layout or KvLayout()
        if (layout.reserved or layout.guards) and not layout.sources:
            which = ", ".join(f"{k}={getattr(layout, k)}" for k in ("reserved", "guards") if getattr(layout, k))
            raise LayoutError(f"layout: expected sources whose bytes the guard slots are checked in, got {which} on "
                              "a layout without sources (metadata only: drop the guard slots, or add the sources)")
        if device is None:
            device = layout.sources[0].tensor.device if layout.sources else torch.device("cpu")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device: expected a torch device or its name, got {device!r} ({e})") from None
        if self.device.type not in ("cpu", "cuda"):
            raise UnsupportedError(f"device: expected cpu or cuda, got {self.device.type}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UnsupportedError(f"device: {self.device} was asked for, but this torch build sees no CUDA device")
        if layout.sources and layout.sources[0].tensor.device != self.device:
            raise ConfigError(f"layout lives on {layout.sources[0].tensor.device}, the canary on {self.device}")
        layout.check_covers(num_slots)
        _check_stamp_memory(num_slots, self.device)
        self.num_slots = num_slots
        self.layout = layout if self.config.content == "all" else KvLayout()
        per_slot = self.layout.content_bytes_per_slot
        budget = self.config.budget_for(self.device.type)
        if budget is not None and 0 < budget < per_slot:
            raise ConfigError(
                f"content_budget_bytes: {budget} is less than one slot's {per_slot} content bytes; "
                f"expected 0 (no per-step content checks) or >= {per_slot}"
            )
        self.content_slots = None if budget is None or not per_slot else budget // per_slot
        self.backend = self._resolve_backend()
        self.validate = self.config.validate if self.config.validate is not None else self.backend != "triton"
        self._ops = ops.load(self.backend)
        self._table = ops.prepare(self.backend, self.layout, self.device)
        self.stamps = checks.new_stamps(num_slots, self.device)
        # each slot's last writer, (step, step row), for the diagnosis; the last row takes invalid writes
        self.writers = torch.full((num_slots + 1, 2), -1, dtype=torch.int64, device=self.device)
        self.ring = ViolationRing(self.config.ring_capacity, self.device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.scrub_cursor = 0
        self.scrub_passes = 0  # complete patrol passes over the pool
        per_slot = self.layout.content_bytes_per_slot
        patrol = self.config.patrol_for(self.device.type)
        # slots per forward of the engine-driven patrol (at least one when there are bytes to check)
        self.patrol_slots = min(num_slots, max(1, patrol // per_slot)) if patrol and per_slot else 0
        # the scrub walk's calls (step, slots) back to the last that reached the slot at its cursor
        self._patrol_visits: collections.deque[tuple[int, int]] = collections.deque()
        self._patrol_walked = 0
        self.forwards = 0  # forwards stamped, counted on the host (the device's STEPS counter needs a sync)
        self._init_guards()
        # page sizes of the paged sources: a block table step must address slots in pages of this size
        self._pages = frozenset(s.page_size for s in self.layout.sources if s.page_size > 1)
        self.internal_errors = 0
        self.disabled = False  # set when even forgetting every stamp failed: nothing is checked after
        self.unknown_possible = False  # some slot may be unknown: stamping seeds such rows from the prefix
        self.history: collections.deque[Violation] = collections.deque(maxlen=self.config.history)
        # the forward each slot's bytes were last fingerprinted, for the harm count: the CPU backends
        # only (it is kept on the host; the Triton path never reads device tensors on the host)
        self.ledger = (CheckLedger(num_slots, every_read=self.content_slots is None)
                       if self.device.type == "cpu" and self.backend != "triton" and self.layout.sources else None)
        self.callbacks = list(on_violation)
        # the fused path's forward hooks as one compiled call each (kvcanary.fused.forward)
        self._fast = None
        if self.backend == "fused":
            from kvcanary.fused.forward import ForwardArgs

            self._fast = ForwardArgs(self)

    def _resolve_backend(self) -> str:
        want = self.config.backend
        if want == "fused" and self.device.type != "cpu":
            raise UnsupportedError(f"backend 'fused' runs on CPU pools; this pool is on {self.device} (use 'triton')")
        if want == "fused" or (want == "auto" and self.device.type == "cpu"):
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
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"):
            raise UnsupportedError(
                "backend 'triton' on a CPU pool runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1 "
                "before kvcanary's kernels are imported, or use backend 'torch'"
            )
        return "triton"

    def _init_guards(self) -> None:
        """The guard slots (:class:`~kvcanary.layout.KvLayout`'s ``reserved`` and ``guards``, and the
        pool's first and last slot): checked against the pool, on the pool's device."""
        lay = self.layout
        for name, ids in (("reserved", lay.reserved), ("guards", lay.guards)):
            bad = [i for i in ids if not 0 <= i < self.num_slots]
            if bad:
                raise ConfigError(f"layout {name}: slot {bad[0]} is outside the pool, expected 0 .. {self.num_slots - 1}")
        reserved = lay.reserved if lay.sources else ()
        guarded = sorted(({0, self.num_slots - 1} | set(lay.guards)) - set(reserved)) if lay.sources else []
        as_slots = lambda ids: torch.tensor(list(ids), dtype=torch.int64, device=self.device)  # noqa: E731
        self._reserved, self._guarded = as_slots(reserved), as_slots(guarded)
        self._guard_all = as_slots(list(reserved) + guarded)  # the fused path checks them in one pass
        n = len(reserved)
        self._reserved_now = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._reserved_base = torch.zeros(n, dtype=torch.int64, device=self.device)  # fingerprints when first seen
        if n:
            self._ops["content"](self._reserved, self._table, self.num_slots, self._reserved_base)
        # a change found since the last drain: the step (-1: none), the fingerprint before and after it
        self._reserved_hit = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        # on a CPU pool, as numpy once: each drain looks at it (a torch call per drain costs tens of
        # microseconds right after an engine's forward)
        self._reserved_hit_host = self._reserved_hit.numpy() if self._reserved_hit.is_cpu else None
        self._reserved_was = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._reserved_got = torch.zeros(n, dtype=torch.int64, device=self.device)

    @property
    def guard_slots(self) -> int:
        """Slots checked on every forward by :meth:`guard` (reserved and guarded live slots)."""
        return int(self._reserved.shape[0] + self._guarded.shape[0])

    @property
    def step_id(self) -> int:
        return int(self.ring.counters[Counter.STEPS])

    # ---- failures of the canary's own ---------------------------------------------------------

    def note_internal_error(self, where: str, e: BaseException) -> None:
        """Count an internal error and log it (the first ones with a traceback, then one line each)."""
        self.internal_errors += 1
        if self.internal_errors <= 3:
            log.error("kvcanary internal error in %s (counted, not raised)", where, exc_info=e)
        else:
            log.error("kvcanary internal error in %s (counted, not raised): %s: %s", where, type(e).__name__, e)

    def _recover(self, recover: Callable[..., None], *args: Any) -> None:
        try:
            recover(self, *args)
        except Exception:
            self.forget_all()

    @_guarded(lambda self, *_: self.forget_all())
    def forget(self, slots: torch.Tensor) -> None:
        """Put ``slots`` (int ``[n]``, in the pool) in the unknown state: their KV was or may have been
        written while the canary was not watching. Reads of them are counted as unverifiable, never
        reported, until the engine writes them again (stamped) or frees them (:meth:`release`)."""
        self._forget(self._slots_arg("slots", slots))

    def _forget(self, slots: torch.Tensor) -> None:
        self.unknown_possible = True
        checks.set_state(self.stamps, slots, checks.UNKNOWN_STAMP)

    def forget_all(self) -> None:
        """Put every slot in the unknown state (after a failure whose damage cannot be bounded)."""
        try:
            self.unknown_possible = True
            checks.set_state(self.stamps, None, checks.UNKNOWN_STAMP)
        except Exception as e:  # the pool cannot even be written: stop checking rather than guess
            self.disabled = True
            log.error("kvcanary: could not reset the stamp pool (%s: %s); this canary stops checking",
                      type(e).__name__, e)

    def _slots_arg(self, name: str, slots: Any) -> torch.Tensor:
        """``slots`` as int64 on the pool's device, checked: a 1-d integer tensor of slots in the pool."""
        if not isinstance(slots, torch.Tensor):
            raise KvCanaryError(f"{name}: expected a 1-d integer torch.Tensor of slot ids, got {type(slots).__name__}")
        if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
            raise KvCanaryError(f"{name}: expected a 1-d integer tensor, got {slots.dtype} {tuple(slots.shape)}")
        if slots.device != self.device:
            raise KvCanaryError(f"{name}: expected slots on {self.device} (the pool's device), got {slots.device}")
        if slots.numel() and (self.validate or slots.device.type == "cpu"):  # a CUDA pool checks when validating
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi >= self.num_slots:
                bad = lo if lo < 0 else hi
                raise KvCanaryError(f"{name}: expected slot ids in [0, {self.num_slots}), got {bad}")
        return slots.long()

    # ---- the forward path ---------------------------------------------------------------------

    def _prepare(self, step: Step) -> None:
        self._check_step(step)
        if self.validate:
            if self.backend == "fused":  # one compiled pass over the rows: cheaper than telling it is unchanged
                from kvcanary.fused.ops import validate

                validate(step, self.num_slots)
            else:
                step.validate_once(self.num_slots)  # again whenever a tensor of the step changed in place

    def _check_step(self, step: Step) -> None:
        """The checks of a step that read no values: its kind, shapes, page size and device."""
        if not isinstance(step, Step):
            raise StepError(f"step: expected a kvcanary.step.Step, got {type(step).__name__}")
        step.validate_shapes()
        if self._pages:
            self._check_pages(step)
        if step.cached_lens.device != self.device:
            raise UnsupportedError(f"step tensors on {step.cached_lens.device}, the canary's pool on {self.device}")

    def _check_pages(self, step: Step) -> None:
        """A block table step's ``block_size`` must be the layout's page size: slot ``b * block_size
        + i`` is then in-page slot ``i`` of page ``b``, and the fingerprints read the bytes the engine
        wrote. Tables of slot ids (a ``slot_table``, or a block table with block size 1) address
        any layout. Checked once per step until a field of it is assigned (:meth:`Step.memo`)."""
        memo = step.memo()
        if memo.get("pages_ok") == self._pages:
            return
        if step.block_table is not None and step.block_size != 1 and self._pages != {step.block_size}:
            raise StepError(f"block_size: expected {' or '.join(map(str, sorted(self._pages)))} (the page size of the "
                            f"layout's paged sources), got {step.block_size}: the content checks would read other "
                            "slots' bytes")
        memo["pages_ok"] = self._pages

    @_guarded()
    def before_forward(self, step: Step) -> None:
        """Verify every cached slot the step's attention will read (position, link, token, content),
        except reads of slots this same step writes (``step.written_from``): those are verified by
        :meth:`after_forward`, once the writes are stamped.

        A ``step`` that is not a :class:`~kvcanary.step.Step`, or whose ``block_size`` is not the
        layout's page size, is a :class:`~kvcanary.errors.StepError`: like every bad argument, raised
        in ``raise`` mode, counted as an internal error (and logged) in ``log`` and ``quarantine``
        mode, which never raise into the engine."""
        if self._fast is not None:
            content = -1 if self.content_slots is None else self.content_slots
            if self._fast.before(self._described(step), content, ops.BEFORE_WRITES, self.validate, self.forwards) < 0:
                self._refuse(step)
            return
        self._prepare(step)
        self._verify(step, ops.BEFORE_WRITES)

    def _described(self, step: Step) -> Any:
        """The fused path's descriptor of ``step``, after the checks of :meth:`_prepare` that do not
        read values (those run inside the compiled entry); both kept in the step's memo."""
        if isinstance(step, Step):
            memo = step.__dict__.get("_memo")
            if memo is not None and memo.get("prepared") is self:
                return memo["fused_desc"]
        self._check_step(step)
        from kvcanary.fused._step import describe

        d = describe(step)
        step.memo()["prepared"] = self
        return d

    def _refuse(self, step: Step) -> None:
        """Raise the worded error of a step whose values the compiled check refused."""
        step.validate_values(self.num_slots)
        raise KvCanaryError("kvcanary internal error: the fused step check refused a step the torch check accepts")

    def _verify(self, step: Step, part: int) -> None:
        window = None
        if self.ledger is not None and self.content_slots:  # the slots whose bytes this verify checks
            window = CheckLedger.window(step, part, int(self.cursor.numpy()[0]), self.content_slots)
        self._ops["verify"](self.stamps, self._table, step, self.ring.counters, self.cursor, self.content_slots,
                            self.ring.rows, part)
        if window is not None:
            self.ledger.mark(window, self.forwards)  # type: ignore[union-attr]

    def _checked(self, slots: torch.Tensor) -> None:
        """``slots``' bytes were fingerprinted now (for the harm count's ledger)."""
        if self.ledger is not None:
            self.ledger.mark(slots, self.forwards)

    @_guarded(_forget_written)
    def after_forward(self, step: Step, padding_slots: torch.Tensor | None = None, patrol: bool = False) -> None:
        """Stamp every slot the step wrote, fingerprinting its KV bytes, and check the writes; then
        verify the reads of slots this step wrote (``step.written_from``).

        ``padding_slots`` (int ``[n]``, optional): the slots the forward's padding tokens wrote,
        where the engine's batch says so and they are not the engine's own padding slot (negative
        ids: not written). One that holds a live sequence's stamp, or is reserved, is reported
        (check ``PADDING_WRITE``); one outside the pool too (with ``BAD_SLOT``). Reads the slots on
        the host: pass them only when there are some.

        A bad ``step`` is handled as in :meth:`before_forward`; in ``log`` and ``quarantine`` mode
        every slot then becomes unknown, since which slots the forward wrote cannot be told.

        ``patrol``: run this forward's share of the patrol scrub too, once the forward is counted
        (as :meth:`patrol` called after it would; on the fused path in the same compiled call)."""
        if self._fast is not None:
            n = self.patrol_slots if patrol else 0
            done = self._fast.after(self._described(step), self.validate, self.forwards, padding_slots is None,
                                    self.scrub_cursor, n)
            if done < 0:
                self._refuse(step)
            if done == 0:  # kvcanary.fused.forward.DONE: the guard, the count and the patrol ran
                self.forwards += 1
                if n:
                    self._walk_patrol(n)
                return
        else:
            self._prepare(step)
            self._stamp(step, self.ring.counters, self.ring.rows)
            self._note_writers(step)
            self._checked(step.new_slots.long())
        if padding_slots is not None:
            self._check_padding(padding_slots)
        wf = step.written_from
        # a row reads what this step wrote only below its cached length: most steps have none
        after = step.split_reads()[1] if wf is not None and bool((wf.long() < step.cached_lens.long()).any()) else None
        if after is not None:
            self._restamp_followers(step)
            self._verify(step, ops.AFTER_WRITES)
            self.ring.counters[Counter.SLOTS_VERIFIED_AFTER_WRITE] += checks.read_counts(after).sum()
        self.guard()  # a failure of its own is counted apart: this step's stamps stand
        self._count(Counter.STEPS, 1)
        self.forwards += 1
        if patrol:
            self.patrol()

    def _count(self, counter: Counter, n: int) -> None:
        """Add ``n`` to a device counter (on the fused CPU path through a numpy view: a torch index op
        costs more than the rest of a small check)."""
        if self.backend == "fused":
            self.ring.counters.numpy()[counter] += n
        else:
            self.ring.counters[counter] += n

    def _check_padding(self, slots: torch.Tensor) -> None:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise KvCanaryError(f"padding_slots: expected a 1-d integer tensor of slot ids, got {slots!r}")
        s = slots.to(self.device, torch.int64)
        s = s[s >= 0]
        inside = s < self.num_slots
        st = self.stamps[torch.where(inside, s, 0)]
        live = inside & (st[:, checks.POSITION] >= 0)
        bad = live | (inside & torch.isin(s, self._reserved)) | ~inside
        flags = torch.where(bad, int(Check.PADDING_WRITE), 0) | torch.where(inside, 0, int(Check.BAD_SLOT))
        st = torch.where(inside[:, None], st, -1)
        m1 = torch.full_like(s, -1)
        cols = [m1, s, st[:, checks.POSITION], m1, st[:, checks.TOKEN], st[:, checks.POSITION], torch.zeros_like(s),
                st[:, checks.LINK], torch.zeros_like(s), st[:, checks.CONTENT], m1]
        append_rows(self.ring.counters, self.ring.rows, checks.pack(Site.WRITE, flags, self.step_id, cols))

    def _stamp(self, step: Step, counters: torch.Tensor, ring: torch.Tensor) -> None:
        self._ops["stamp"](self.stamps, self._table, step, counters, ring, unknown_possible=self.unknown_possible)

    def _note_writers(self, step: Step) -> None:
        """Record this step and each written slot's row as the slot's last writer (device ops only)."""
        if self.backend == "fused":
            from kvcanary.fused.steps import note_writers

            note_writers(step, self.writers, self.num_slots, self.step_id)
            return
        offs = step.new_offsets.long()
        row = torch.repeat_interleave(torch.arange(step.num_rows, device=self.device), offs[1:] - offs[:-1],
                                      output_size=step.num_new)
        slots = step.new_slots.long()
        ok = (slots >= 0) & (slots < self.num_slots) & step.valid_rows()[row]
        idx = torch.where(ok, slots, self.num_slots)
        self.writers[idx, 0] = self.ring.counters[Counter.STEPS]
        self.writers[idx, 1] = row

    def last_writer(self, slot: int) -> tuple[int, int] | None:
        """The step and step row that last wrote ``slot`` (``None``: none this canary saw)."""
        if not 0 <= slot < self.num_slots:
            return None
        step, row = (int(x) for x in self.writers[slot])
        return None if step < 0 else (step, row)

    def _writer_of(self, v: Violation) -> tuple[int, str] | None:
        w = self.last_writer(v.slot)
        return None if w is None else (w[0], f"row {w[1]} of step {w[0]}")

    def _restamp_followers(self, step: Step) -> None:
        """Rows whose chain continues from a slot another row wrote in this step seeded from that
        slot's old stamp: stamp them again from the new one, until their stamps settle (a follower
        of a follower needs one pass more). Reads the step on the host, only for steps with
        ``written_from``; the passes count nothing and report nothing twice."""
        cached = step.cached_lens.long()
        new = step.new_slots.long()
        pred = step.lookup(torch.arange(step.num_rows, device=cached.device), cached - 1)
        follows = (cached > 0) & torch.isin(pred, new) & step.valid_rows()
        if not bool(follows.any()):
            return
        sub = dataclasses.replace(step, row_valid=follows, written_from=None)
        row = checks.rows_of(step.new_offsets[1:].long() - step.new_offsets[:-1].long())[0]
        theirs = new[follows[row] & (new >= 0) & (new < self.num_slots)]
        scratch = torch.zeros_like(self.ring.counters)
        ring = torch.zeros(1, self.ring.rows.shape[1], dtype=torch.int64, device=self.device)
        for _ in range(step.num_rows):
            was = self.stamps[theirs]
            self._stamp(sub, scratch, ring)
            if torch.equal(self.stamps[theirs], was):
                break

    @_guarded()
    def scrub(self, slots: torch.Tensor | None = None) -> None:
        """Re-fingerprint cached slots and compare with their stamps.

        With ``slots``, those slots; otherwise the next ``config.scrub_slots`` slots of a patrol
        that walks the whole pool round-robin (a full pass every ``num_slots / scrub_slots`` calls).
        Unstamped, released and unknown slots are passed over.
        """
        if slots is None:
            slots = self._next_patrol(min(self.config.scrub_slots, self.num_slots))
        else:
            slots = self._slots_arg("slots", slots)
        self._ops["scrub"](self.stamps, self._table, slots, self.ring.counters, self.ring.rows, Site.SCRUB)
        self._checked(slots)

    @_guarded()
    def first_read(self, slots: torch.Tensor) -> None:
        """Re-fingerprint the stamped ``slots`` now, before a forward reads them for the first time on
        behalf of a request that did not write them (a prefix-cache hit): whatever the rotating
        content window says, their bytes are verified before that read (site ``first_read``). Blocks
        restored from another tier or copied by a fork are verified as they land
        (:meth:`import_stamps`)."""
        slots = self._slots_arg("slots", slots)
        self._ops["scrub"](self.stamps, self._table, slots, self.ring.counters, self.ring.rows, Site.FIRST_READ)
        self._checked(slots)

    @_guarded()
    def patrol(self) -> None:
        """One forward's share of the patrol scrub (``config.patrol_budget_bytes``), for engine
        adapters to call after each forward: the next slots of the round-robin walk over the pool
        are re-fingerprinted, so KV that no request reads is re-verified at least once every
        ``patrol_pass_steps`` forwards (:meth:`stats`). Nothing without a content layout."""
        if self.patrol_slots:
            slots = self._next_patrol(self.patrol_slots)
            self._ops["scrub"](self.stamps, self._table, slots, self.ring.counters, self.ring.rows, Site.SCRUB)
            self._checked(slots)

    @_guarded()
    def guard(self) -> None:
        """Check the guard slots (site ``guard``): the reserved slots' bytes against their
        fingerprints when the canary was made (an engine's warm-up writes into them are found
        too), and the guarded live slots (the pool's first and last slot, the layout's
        ``guards``) against their stamps. :meth:`after_forward` runs it at the end of every
        forward (the records carry that forward's step). No host sync: a changed reserved slot is
        recorded on the device and reported at the next drain (one record per slot and drain)."""
        if self.backend == "fused":
            from kvcanary.fused.ops import guard

            if self._guard_all.numel():
                guard(self.stamps, self._table, self._guard_all, self._reserved.shape[0], self._reserved_base,
                      self._reserved_hit, self._reserved_was, self._reserved_got, self.ring.counters, self.ring.rows)
            return
        if self._guarded.numel():  # counted as guard checks, not as scrubbed slots
            scrubbed = self.ring.counters[_SCRUB_COUNTERS].clone()
            self._ops["scrub"](self.stamps, self._table, self._guarded, self.ring.counters, self.ring.rows, Site.GUARD)
            self.ring.counters[_SCRUB_COUNTERS] = scrubbed
        if self._reserved.numel():
            base, now = self._reserved_base, self._reserved_now
            self._ops["content"](self._reserved, self._table, self.num_slots, now)
            new = (now != base) & (self._reserved_hit < 0)
            self._reserved_hit.copy_(torch.where(new, self.ring.counters[Counter.STEPS], self._reserved_hit))
            self._reserved_was.copy_(torch.where(new, base, self._reserved_was))
            self._reserved_got.copy_(torch.where(new, now, self._reserved_got))
            base.copy_(now)
        self.ring.counters[Counter.GUARD_CHECKS] += self.guard_slots

    def _flush_guards(self) -> None:
        """Put the reserved-slot changes recorded since the last drain into the ring (at a drain,
        which syncs anyway)."""
        if not self._reserved.numel():
            return
        if self._reserved_hit_host is not None:
            if max(self._reserved_hit_host.tolist()) < 0:
                return
        elif not bool((self._reserved_hit >= 0).any()):
            return
        hit = self._reserved_hit >= 0
        s = self._reserved[hit]
        m1 = torch.full_like(s, -1)
        cols = [m1, s, m1, m1, m1, m1, torch.zeros_like(s), torch.zeros_like(s), self._reserved_got[hit],
                self._reserved_was[hit], m1]
        rows = checks.pack(Site.GUARD, torch.full_like(s, int(Check.CONTENT)), 0, cols)
        rows[:, F_STEP] = self._reserved_hit[hit]
        append_rows(self.ring.counters, self.ring.rows, rows)
        self._reserved_hit[hit] = -1

    def _next_patrol(self, n: int) -> torch.Tensor:
        """The next ``n`` slots of the round-robin walk over the pool (scrub and patrol share it)."""
        first = self._walk_patrol(n)
        if self.backend == "fused":
            return torch.from_numpy((np.arange(n) + first) % self.num_slots)
        return (torch.arange(n, device=self.device) + first) % self.num_slots

    def _walk_patrol(self, n: int) -> int:
        """Move the walk's cursor past its next ``n`` slots; returns where they start."""
        visits = self._patrol_visits
        visits.append((self.forwards, n))
        self._patrol_walked += n
        while self._patrol_walked - visits[0][1] >= self.num_slots:
            self._patrol_walked -= visits.popleft()[1]  # the slots at the cursor were walked over again since
        first = self.scrub_cursor
        self.scrub_passes += (first + n) // self.num_slots
        self.scrub_cursor = (first + n) % self.num_slots
        return first

    @_guarded(_forget_slots)
    def release(self, slots: torch.Tensor) -> None:
        """Forget the stamps of freed ``slots``: a later read of them before a write is ``EMPTY``."""
        checks.set_state(self.stamps, self._slots_arg("slots", slots), checks.EMPTY_STAMP)

    @_guarded()
    def export_stamps(self, slots: torch.Tensor) -> torch.Tensor | None:
        """A copy of the stamps of ``slots`` (int64 ``[n, 4]``) to travel with their KV to another tier.

        ``None`` where the canary could not read them (an internal error, counted): pass that on
        to :meth:`import_stamps`, which marks the landed slots unknown.
        """
        return self.stamps[self._slots_arg("slots", slots)]  # an index gather: already a copy

    @_guarded(_forget_slots)
    def import_stamps(self, slots: torch.Tensor, stamps: torch.Tensor | None) -> None:
        """Install stamps that travelled with KV now landed in ``slots``, and verify the landed bytes.

        Every landed slot is re-fingerprinted at once, so a copy that landed nothing, landed
        torn, or landed another block's bytes is reported (site ``transfer``). ``stamps=None``
        (stamps that could not travel) puts the slots in the unknown state: the canary lost
        track of them, which is not evidence of corruption.
        """
        slots = self._slots_arg("slots", slots)
        if stamps is None:
            self._forget(slots)
            return
        if not isinstance(stamps, torch.Tensor) or stamps.shape != (slots.shape[0], 4):
            got = tuple(stamps.shape) if isinstance(stamps, torch.Tensor) else type(stamps).__name__
            raise KvCanaryError(f"stamps: expected shape ({slots.shape[0]}, 4), got {got}")
        stamps = stamps.to(self.device, torch.int64)
        if not self.unknown_possible:  # a copy of slots the canary lost track of stays unknown
            self.unknown_possible = bool((stamps[:, checks.POSITION] == checks.UNKNOWN_POS).any())
        self.stamps[slots] = stamps
        self._ops["scrub"](self.stamps, self._table, slots, self.ring.counters, self.ring.rows, Site.TRANSFER)
        self._checked(slots)

    # ---- reporting ----------------------------------------------------------------------------

    def drain(self) -> list[Violation]:
        """Decode the violations recorded since the last drain and keep them in ``history``; reports
        nothing (engine adapters that annotate records before reporting use this, then :func:`report`)."""
        if self.config.mode == "off" or self.disabled:
            return []
        try:
            self._flush_guards()
            found = self.ring.drain()
            # the drain synced already; one more look at the pool (the fused stamp reads each row's
            # seed whatever this flag says: no scan of the pool there)
            if self.unknown_possible and self.backend != "fused":
                self.unknown_possible = bool((self.stamps[:, checks.POSITION] == checks.UNKNOWN_POS).any())
        except Exception as e:
            if self.config.mode == "raise":
                raise
            self.note_internal_error("drain", e)
            return []
        self.history.extend(found)
        return found

    def poll(self) -> list[Violation]:
        """Drain the violations recorded since the last poll, report them and return them.

        ``log`` and ``quarantine`` mode log one line per event (step and row) and call the
        ``on_violation`` callbacks; ``raise`` mode calls them, then raises
        :class:`KvCorruptionError` carrying the records.
        """
        lost_before = self.ring.lost
        found = self.drain()
        lost = self.ring.lost - lost_before
        errors = report(found, lost, self.config.mode, self.callbacks, self.config.violations_log,
                        writer_of=self._writer_of, engine="canary")
        self.internal_errors += errors
        return found

    def stats(self) -> dict[str, int]:
        """Counters (slots verified and stamped, bytes fingerprinted, violations, unverifiable reads, ...)."""
        out = self.ring.counter_values()
        out["violations_lost"] = self.ring.lost
        out["internal_errors"] = self.internal_errors
        out["scrub_passes"] = self.scrub_passes
        out["scrub_position"] = self.scrub_cursor
        out["num_slots"] = self.num_slots
        # the patrol's worst-case re-verification latency for a slot no request reads, in forwards
        out["patrol_pass_steps"] = -(-self.num_slots // self.patrol_slots) if self.patrol_slots else 0
        out["unverified_age_max_steps"] = self.unverified_age_max()
        out["guard_slots"] = self.guard_slots
        return out

    def unverified_age_max(self) -> int:
        """At most how many forwards ago any stamped slot's bytes were last fingerprinted (stamped,
        verified before a read, or scrubbed): the forwards since the scrub walk last passed the
        slot at its cursor, or since the canary's first forward while no walk has covered the pool."""
        if self._patrol_walked >= self.num_slots:
            return self.forwards - self._patrol_visits[0][0]
        return self.forwards

    def coverage(self) -> dict[str, float]:
        """How much the checks covered, as shares: of read slots, those whose bytes were
        re-fingerprinted (``content_verified``) and those in the unknown state
        (``unverifiable``); the bound on how many forwards ago a stamped slot's bytes were last
        fingerprinted (``unverified_age_max_steps``); the patrol scrub's passes over the pool (``scrub_passes``, with the
        fraction of the current one)."""
        return coverage_of(self.stats())


def coverage_of(stats: dict[str, int]) -> dict[str, float]:
    """:meth:`Canary.coverage` from (summed) stats."""
    read = stats.get("slots_verified", 0)
    share = (lambda k: stats.get(k, 0) / read) if read else (lambda k: 0.0)
    pool = stats.get("num_slots", 0)
    return {"content_verified": share("content_slots_verified"), "unverifiable": share("slots_unverifiable"),
            "scrub_passes": stats.get("scrub_passes", 0) + (stats.get("scrub_position", 0) / pool if pool else 0.0),
            "unverified_age_max_steps": float(stats.get("unverified_age_max_steps", 0))}


def report(found: list[Violation], lost: int, mode: str,
           callbacks: Iterable[Callable[[list[Violation]], None]] = (), log_path: str | None = None,
           writer_of: Callable[[Violation], tuple[int, str] | None] | None = None,
           holders_of: Callable[[Violation], list[str] | None] | None = None, **context: Any) -> int:
    """Report drained violations: appended to the JSONL violation log (``log_path``, one line per
    event, with ``context`` such as the engine and rank), then the callbacks, then one log line
    per event, or in ``raise`` mode :class:`KvCorruptionError`. Every sink runs even when one
    before it fails. Returns how many sinks failed (counted as internal errors by the caller); in
    ``raise`` mode the :class:`KvCorruptionError` is raised all the same, carrying the sinks'
    exceptions (``sink_errors``, the first as its ``__cause__``)."""
    if not found and not lost:
        return 0
    try:  # a diagnosis that fails leaves the events undiagnosed, never unreported
        evs = annotate(events(found), writer_of, holders_of)
    except Exception:
        log.exception("kvcanary: diagnosing violations failed (reported without a diagnosis)")
        evs = events(found)
    failed: list[Exception] = []
    sinks: list[Callable[[], object]] = [lambda: eventlog.append(log_path, evs, **context)] if log_path else []
    sinks += [functools.partial(cb, found) for cb in callbacks]
    for sink in sinks:
        try:
            sink()
        except Exception as e:  # the violations are reported all the same, by the other sinks and the error
            failed.append(e)
            log.error("kvcanary: a violation sink (log file or on_violation callback) failed (%s)",
                      "attached to the KvCorruptionError" if mode == "raise" else "counted, not raised", exc_info=e)
    if mode == "raise":
        err = KvCorruptionError(found, lost, sink_errors=failed)
        if failed:
            raise err from failed[0]
        raise err
    for ev in evs:
        log.warning("kvcanary violation %s", ev.describe())
    if lost:
        log.warning("kvcanary: %d violations overflowed the ring before they were drained", lost)
    return len(failed)


def _check_stamp_memory(num_slots: int, device: torch.device) -> None:
    """Refuse a stamp pool that cannot fit, before allocating it."""
    need = num_slots * 4 * 8
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # all of it: page cache is reclaimable
        except (ValueError, OSError, AttributeError):
            return
    if need > free:
        raise ConfigError(
            f"num_slots: {num_slots} slots need {need / 2**30:.1f} GiB of stamps (32 bytes a slot); "
            f"{device} has {free / 2**30:.1f} GiB {'free' if device.type == 'cuda' else 'in all'}"
        )
