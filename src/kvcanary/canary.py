"""The object an engine talks to: stamps one KV pool, verifies reads, stamps writes, reports.

A :class:`Canary` orchestrates; what it runs lives beside it: its arguments' checks
(:mod:`kvcanary.canary_args`), the ops and their backends
(:mod:`kvcanary.ops`), the step checks (:mod:`kvcanary.step_check`), the patrol's walk
(:mod:`kvcanary.patrol`), the guard slots and padding writes (:mod:`kvcanary.guards`), what its
own failures recover (:mod:`kvcanary.canary_guard`) and the sinks of drained violations
(:mod:`kvcanary.reporting`).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Iterable

import numpy as np
import torch

from kvcanary import canary_args, checks, ops, step_check
from kvcanary.canary_guard import forget_blocks, forget_slots, forget_written, guarded
from kvcanary.config import CanaryConfig
from kvcanary.guards import GuardSlots
from kvcanary.harm import CheckLedger
from kvcanary.layout import KvLayout
from kvcanary.patrol import PatrolWalk
from kvcanary.reporting import coverage_of, report
from kvcanary.step import Step
from kvcanary.violations import Counter, Site, Violation, ViolationRing
from kvcanary.writers import last_writer, new_writers, note_writers

log = logging.getLogger("kvcanary")


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
    healer : the engine adapter that fails or recomputes the requests a violation hurt (set by the
        adapters; ``quarantine`` and ``repair`` modes need one)
    """

    def __init__(
        self,
        num_slots: int,
        layout: KvLayout | None = None,
        config: CanaryConfig | None = None,
        device: torch.device | str | None = None,
        on_violation: Iterable[Callable[[list[Violation]], None]] = (),
        *,
        healer: str | None = None,
    ) -> None:
        self.config = canary_args.checked_config(config, healer)
        num_slots = canary_args.checked_num_slots(num_slots)
        layout = canary_args.checked_layout(layout, self.config.content)
        self.device = canary_args.pool_device(device, layout)
        layout.check_covers(num_slots)
        canary_args.check_stamp_memory(num_slots, self.device)
        self.num_slots = num_slots
        self.layout = layout if self.config.content == "all" else KvLayout()
        per_slot = self.layout.content_bytes_per_slot
        self.content_slots = canary_args.content_slots(self.config.budget_for(self.device.type), per_slot)
        self.backend = ops.resolve_backend(self.config.backend, self.device)
        self.validate = self.config.validate if self.config.validate is not None else self.backend != "triton"
        self._ops = ops.load(self.backend)
        self.table = ops.prepare(self.backend, self.layout, self.device)
        self.stamps = checks.new_stamps(num_slots, self.device)
        self.writers = new_writers(num_slots, self.device)  # each slot's last writer (kvcanary.writers)
        self.ring = ViolationRing(self.config.ring_capacity, self.device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.walk = PatrolWalk(num_slots)
        patrol = self.config.patrol_for(self.device.type)
        # slots per forward of the engine-driven patrol (at least one when there are bytes to check)
        self.patrol_slots = min(num_slots, max(1, patrol // per_slot)) if patrol and per_slot else 0
        self.forwards = 0  # forwards stamped, counted on the host (the device's STEPS counter needs a sync)
        self.guards = GuardSlots(self.layout, num_slots, self.device, self._ops["content"], self.table)
        # page sizes of the paged sources: a block table step must address slots in pages of this size
        self.pages = frozenset(s.page_size for s in self.layout.sources if s.page_size > 1)
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

    @property
    def guard_slots(self) -> int:
        """Slots checked on every forward by :meth:`guard` (reserved and guarded live slots)."""
        return self.guards.count

    @property
    def step_id(self) -> int:
        return self.ring.count(Counter.STEPS)

    @property
    def scrub_cursor(self) -> int:
        """Where the patrol's walk over the pool continues."""
        return self.walk.cursor

    @property
    def scrub_passes(self) -> int:
        """Complete patrol passes over the pool."""
        return self.walk.passes

    # ---- failures of the canary's own ---------------------------------------------------------

    def note_internal_error(self, where: str, e: BaseException) -> None:
        """Count an internal error and log it (the first ones with a traceback, then one line each)."""
        self.internal_errors += 1
        if self.internal_errors <= 3:
            log.error("kvcanary internal error in %s (counted, not raised)", where, exc_info=e)
        else:
            log.error("kvcanary internal error in %s (counted, not raised): %s: %s", where, type(e).__name__, e)

    @guarded(lambda self, *_: self.forget_all())
    def forget(self, slots: torch.Tensor) -> None:
        """Put ``slots`` (int ``[n]``, in the pool) in the unknown state: their KV was or may have been
        written while the canary was not watching. Reads of them are counted as unverifiable, never
        reported, until the engine writes them again (stamped) or frees them (:meth:`release`)."""
        self.forget_known(self._slots_arg("slots", slots))

    def forget_known(self, slots: torch.Tensor) -> None:
        """:meth:`forget` of ``slots`` already checked (int64, in the pool)."""
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
        return step_check.checked_slots(name, slots, self.device, self.num_slots, self.validate)

    # ---- the forward path ---------------------------------------------------------------------

    def _prepare(self, step: Step) -> None:
        step_check.prepare(step, self.pages, self.device, self.num_slots, self.validate, self.backend == "fused")

    def _described(self, step: Step) -> Any:
        return step_check.described(step, self, self.pages, self.device)

    @guarded()
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
                step_check.refuse(step, self.num_slots)
            return
        self._prepare(step)
        self._verify(step, ops.BEFORE_WRITES)

    def _verify(self, step: Step, part: int) -> None:
        window = None
        if self.ledger is not None and self.content_slots:  # the slots whose bytes this verify checks
            window = CheckLedger.window(step, part, int(self.cursor.numpy()[0]), self.content_slots)
        self._ops["verify"](self.stamps, self.table, step, self.ring.counters, self.cursor, self.content_slots,
                            self.ring.rows, part)
        if window is not None:
            self.ledger.mark(window, self.forwards)  # type: ignore[union-attr]

    def _checked(self, slots: torch.Tensor) -> None:
        """``slots``' bytes were fingerprinted now (for the harm count's ledger)."""
        if self.ledger is not None:
            self.ledger.mark(slots, self.forwards)

    @guarded(forget_written)
    def after_forward(self, step: Step, padding_slots: torch.Tensor | None = None, patrol: bool = False,
                      folded: tuple[np.ndarray, np.ndarray] | None = None) -> None:
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
        (as :meth:`patrol` called after it would; on the fused path in the same compiled call).

        ``folded`` (fused path): the new tokens' fingerprints an engine's per-layer hook folded while
        each layer wrote (uint64 and int64 ``[step.num_new]``: each token's sum and how many of the
        layout's sources it covers, :func:`kvcanary.fused.keep.keep_layer`); a token they cover
        whole is stamped with it, any other is fingerprinted from the cache here."""
        if self._fast is not None:
            n = self.patrol_slots if patrol else 0
            done = self._fast.after(self._described(step), self.validate, self.forwards, padding_slots is None,
                                    self.walk.cursor, n, folded)
            if done < 0:
                step_check.refuse(step, self.num_slots)
            if done == 0:  # kvcanary.fused.forward.DONE: the guard, the count and the patrol ran
                self.forwards += 1
                if n:
                    self.walk.walk(n, self.forwards)
                return
        else:
            self._prepare(step)
            self._stamp(step, self.ring.counters, self.ring.rows)
            note_writers(self.writers, step, self.ring.counters[Counter.STEPS], self.backend == "fused")
            self._checked(step.new_slots.long())
        if padding_slots is not None:
            self.guards.check_padding(padding_slots, self.stamps, self.ring.counters, self.ring.rows, self.step_id)
        wf = step.written_from
        # a row reads what this step wrote only below its cached length: most steps have none
        after = step.split_reads()[1] if wf is not None and bool((wf.long() < step.cached_lens.long()).any()) else None
        if after is not None:
            ops.restamp_followers(self._ops["stamp"], self.stamps, self.table, step, self.unknown_possible)
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

    def _stamp(self, step: Step, counters: torch.Tensor, ring: torch.Tensor) -> None:
        self._ops["stamp"](self.stamps, self.table, step, counters, ring, unknown_possible=self.unknown_possible)

    def last_writer(self, slot: int) -> tuple[int, int] | None:
        """The step and step row that last wrote ``slot`` (``None``: none this canary saw)."""
        return last_writer(self.writers, slot)

    def writer_of(self, v: Violation) -> tuple[int, str] | None:
        """The last writer of a violation's slot, in words (the diagnosis' owner lookup)."""
        w = self.last_writer(v.slot)
        return None if w is None else (w[0], f"row {w[1]} of step {w[0]}")

    # ---- scrubs: the patrol, first reads, the guard slots -------------------------------------

    def _scrub(self, slots: torch.Tensor, site: Site) -> None:
        self._ops["scrub"](self.stamps, self.table, slots, self.ring.counters, self.ring.rows, site)
        self._checked(slots)

    def _next_patrol(self, n: int) -> torch.Tensor:
        return self.walk.next(n, self.forwards, self.device, host=self.backend == "fused")

    @guarded()
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
        self._scrub(slots, Site.SCRUB)

    @guarded()
    def first_read(self, slots: torch.Tensor) -> None:
        """Re-fingerprint the stamped ``slots`` now, before a forward reads them for the first time on
        behalf of a request that did not write them (a prefix-cache hit): whatever the rotating
        content window says, their bytes are verified before that read (site ``first_read``). Blocks
        restored from another tier or copied by a fork are verified as they land
        (:meth:`import_stamps`)."""
        self._scrub(self._slots_arg("slots", slots), Site.FIRST_READ)

    @guarded()
    def patrol(self) -> None:
        """One forward's share of the patrol scrub (``config.patrol_budget_bytes``), for engine
        adapters to call after each forward: the next slots of the round-robin walk over the pool
        are re-fingerprinted, so KV that no request reads is re-verified at least once every
        ``patrol_pass_steps`` forwards (:meth:`stats`). Nothing without a content layout."""
        if self.patrol_slots:
            self._scrub(self._next_patrol(self.patrol_slots), Site.SCRUB)

    @guarded()
    def guard(self) -> None:
        """Check the guard slots (site ``guard``, :mod:`kvcanary.guards`): the reserved slots' bytes
        against their fingerprints when the canary was made (an engine's warm-up writes into them
        are found too), and the guarded live slots against their stamps. :meth:`after_forward` runs
        it at the end of every forward (the records carry that forward's step)."""
        self.guards.check(self._ops, self.stamps, self.table, self.ring.counters, self.ring.rows,
                          self.backend == "fused")

    # ---- the engine's own moves of KV --------------------------------------------------------

    @guarded(forget_slots)
    def release(self, slots: torch.Tensor) -> None:
        """Forget the stamps of freed ``slots``: a later read of them before a write is ``EMPTY``."""
        checks.set_state(self.stamps, self._slots_arg("slots", slots), checks.EMPTY_STAMP)

    @guarded(forget_blocks)
    def release_blocks(self, blocks: list[int], block_size: int) -> None:
        """:meth:`release` of every slot of ``blocks`` (block ``b``: slots ``b * block_size`` to ``(b + 1) *
        block_size - 1``). On the fused path one compiled loop: an engine frees blocks between forwards,
        where each tensor op costs tens of microseconds on the caches a forward left cold."""
        if not blocks:
            return
        step_check.check_blocks(blocks, block_size, self.num_slots)
        if self._fast is None:
            from kvcanary.geometry.base import block_slots

            checks.set_state(self.stamps, block_slots(blocks, block_size).to(self.device), checks.EMPTY_STAMP)
        else:
            self._fast.set_blocks(blocks, block_size, checks.EMPTY_STAMP)

    @guarded()
    def export_stamps(self, slots: torch.Tensor) -> torch.Tensor | None:
        """A copy of the stamps of ``slots`` (int64 ``[n, 4]``) to travel with their KV to another tier.

        ``None`` where the canary could not read them (an internal error, counted): pass that on
        to :meth:`import_stamps`, which marks the landed slots unknown.
        """
        return self.stamps[self._slots_arg("slots", slots)]  # an index gather: already a copy

    @guarded(forget_slots)
    def import_stamps(self, slots: torch.Tensor, stamps: torch.Tensor | None) -> None:
        """Install stamps that travelled with KV now landed in ``slots``, and verify the landed bytes.

        Every landed slot is re-fingerprinted at once, so a copy that landed nothing, landed
        torn, or landed another block's bytes is reported (site ``transfer``). ``stamps=None``
        (stamps that could not travel) puts the slots in the unknown state: the canary lost
        track of them, which is not evidence of corruption.
        """
        slots = self._slots_arg("slots", slots)
        if stamps is None:
            self.forget_known(slots)
            return
        stamps = step_check.checked_stamps(stamps, slots.shape[0], self.device)
        if not self.unknown_possible:  # a copy of slots the canary lost track of stays unknown
            self.unknown_possible = bool((stamps[:, checks.POSITION] == checks.UNKNOWN_POS).any())
        self.stamps[slots] = stamps
        self._scrub(slots, Site.TRANSFER)

    # ---- reporting ----------------------------------------------------------------------------

    def drain(self) -> list[Violation]:
        """Decode the violations recorded since the last drain and keep them in ``history``; reports
        nothing (engine adapters that annotate records before reporting use this, then
        :func:`~kvcanary.reporting.report`)."""
        if self.config.mode == "off" or self.disabled:
            return []
        try:
            self.guards.flush(self.ring.counters, self.ring.rows)
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
                        writer_of=self.writer_of, engine="canary")
        self.internal_errors += errors
        return found

    def stats(self) -> dict[str, int]:
        """Counters (slots verified and stamped, bytes fingerprinted, violations, unverifiable reads, ...)."""
        out = self.ring.counter_values()
        out["violations_lost"] = self.ring.lost
        out["internal_errors"] = self.internal_errors
        out["scrub_passes"] = self.walk.passes
        out["scrub_position"] = self.walk.cursor
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
        return self.walk.age_max(self.forwards)

    def coverage(self) -> dict[str, float]:
        """:func:`~kvcanary.reporting.coverage_of` this canary's stats."""
        return coverage_of(self.stats())
