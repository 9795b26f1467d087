"""The object an engine talks to: stamps one KV pool, verifies reads, stamps writes, reports."""

from __future__ import annotations

import collections
import functools
import logging
import os
from typing import Any, Callable, Iterable, TypeVar

import torch

from kvcanary import checks
from kvcanary.config import CanaryConfig
from kvcanary.errors import ConfigError, KvCanaryError, KvCorruptionError, UnsupportedError
from kvcanary.layout import KvLayout
from kvcanary.step import Step
from kvcanary.violations import Counter, Site, Violation, ViolationRing

log = logging.getLogger("kvcanary")
MAX_SLOTS = 1 << 62  # slot ids and byte offsets are int64
F = TypeVar("F", bound=Callable[..., Any])


def _guarded(fn: F) -> F:
    """Skip in ``off`` mode; in ``log`` mode count and log internal errors instead of raising."""

    @functools.wraps(fn)
    def wrapper(self: "Canary", *args: Any, **kwargs: Any) -> Any:
        if self.config.mode == "off":
            return None
        if self.config.mode == "raise":
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        except Exception as e:  # log mode never raises into the engine
            self.internal_errors += 1
            log.error("kvcanary internal error in %s (counted, not raised): %s: %s",
                      fn.__name__, type(e).__name__, e)
            return None

    return wrapper  # type: ignore[return-value]


class Canary:
    """Stamps and checks one pool of ``num_slots`` KV slots.

    Call :meth:`before_forward` with the step before the engine's forward reads the cache,
    :meth:`after_forward` after the forward wrote its new KV, and :meth:`poll` whenever the host
    may sync to drain and report violations.

    Parameters
    ----------
    num_slots : slots in the pool (slot ids ``0 .. num_slots - 1``)
    layout : where each slot's KV bytes live; ``None`` or empty for metadata-only checks
    config : see :class:`CanaryConfig`
    device : the pool's device (default: the layout's, else CPU)
    on_violation : callbacks called with each batch of drained violations (quarantine hooks)
    """

    def __init__(
        self,
        num_slots: int,
        layout: KvLayout | None = None,
        config: CanaryConfig | None = None,
        device: torch.device | str | None = None,
        on_violation: Iterable[Callable[[list[Violation]], None]] = (),
    ) -> None:
        self.config = config or CanaryConfig()
        if not 0 < num_slots < MAX_SLOTS:
            raise ConfigError(f"num_slots: expected 1 .. {MAX_SLOTS - 1}, got {num_slots}")
        layout = layout or KvLayout()
        if device is None:
            device = layout.sources[0].tensor.device if layout.sources else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise UnsupportedError(f"device: expected cpu or cuda, got {self.device.type}")
        if layout.sources and layout.sources[0].tensor.device != self.device:
            raise ConfigError(f"layout lives on {layout.sources[0].tensor.device}, the canary on {self.device}")
        layout.check_covers(num_slots)
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
        self.validate = self.config.validate if self.config.validate is not None else self.backend == "torch"
        if self.backend == "triton":
            from kvcanary.kernels._common import source_table

            self._src_table = source_table(self.layout, self.device)
        self.stamps = checks.new_stamps(num_slots, self.device)
        self.ring = ViolationRing(self.config.ring_capacity, self.device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.scrub_cursor = 0
        self.internal_errors = 0
        self.history: collections.deque[Violation] = collections.deque(maxlen=self.config.history)
        self.callbacks = list(on_violation)

    def _resolve_backend(self) -> str:
        want = self.config.backend
        if want == "torch" or (want == "auto" and self.device.type == "cpu"):
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

    @property
    def step_id(self) -> int:
        return int(self.ring.counters[Counter.STEPS])

    def _prepare(self, step: Step) -> None:
        step.validate_shapes()
        if step.cached_lens.device != self.device:
            raise UnsupportedError(f"step tensors on {step.cached_lens.device}, the canary's pool on {self.device}")
        if self.validate and getattr(step, "_validated_for", None) != self.num_slots:
            step.validate_values(self.num_slots)
            step._validated_for = self.num_slots  # type: ignore[attr-defined]  # once per step object

    @_guarded
    def before_forward(self, step: Step) -> None:
        """Verify every cached slot the step's attention will read (position, link, token, content)."""
        self._prepare(step)
        if self.backend == "triton":
            from kvcanary.kernels import verify

            verify.verify(self.stamps, self._src_table, step, self.ring.counters, self.cursor, self.content_slots,
                          self.ring.rows)
            return
        rows = checks.verify(self.stamps, self.layout, step, self.ring.counters, self.cursor,
                             self.content_slots, self.step_id)
        self.ring.append(rows)

    @_guarded
    def after_forward(self, step: Step) -> None:
        """Stamp every slot the step wrote, fingerprinting its KV bytes, and check the writes."""
        self._prepare(step)
        if self.backend == "triton":
            from kvcanary.kernels import stamp

            stamp.stamp(self.stamps, self._src_table, step, self.ring.counters, self.ring.rows)
        else:
            rows = checks.stamp(self.stamps, self.layout, step, self.ring.counters, self.step_id)
            self.ring.append(rows)
        self.ring.counters[Counter.STEPS] += 1

    @_guarded
    def scrub(self, slots: torch.Tensor | None = None) -> None:
        """Re-fingerprint cached slots and compare with their stamps.

        With ``slots``, those slots; otherwise the next ``config.scrub_slots`` slots of a patrol
        that walks the whole pool round-robin (a full pass every ``num_slots / scrub_slots`` calls).
        Unstamped and released slots are passed over.
        """
        if slots is None:
            n = min(self.config.scrub_slots, self.num_slots)
            slots = (torch.arange(n, device=self.device) + self.scrub_cursor) % self.num_slots
            self.scrub_cursor = (self.scrub_cursor + n) % self.num_slots
        elif slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
            raise KvCanaryError(f"slots: expected a 1-d integer tensor, got {slots.dtype} {tuple(slots.shape)}")
        rows = checks.scrub(self.stamps, self.layout, slots.long(), self.ring.counters, self.step_id)
        self.ring.append(rows)

    @_guarded
    def release(self, slots: torch.Tensor) -> None:
        """Forget the stamps of freed ``slots``: a later read of them before a write is ``EMPTY``."""
        self.stamps[slots.long()] = torch.tensor(checks.EMPTY_STAMP, dtype=torch.int64, device=self.device)

    def export_stamps(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the stamps of ``slots`` (int64 ``[n, 4]``) to travel with their KV to another tier."""
        return self.stamps[slots.long()]  # an index gather: already a copy

    @_guarded
    def import_stamps(self, slots: torch.Tensor, stamps: torch.Tensor | None) -> None:
        """Install stamps that travelled with KV now landed in ``slots``, and verify the landed bytes.

        Every landed slot is re-fingerprinted at once, so a copy that landed nothing, landed
        torn, or landed another block's bytes is reported (site ``transfer``). ``stamps=None``
        (a tier that lost them) marks the slots unstamped, so a read reports ``EMPTY``.
        """
        slots = slots.long()
        if stamps is None:
            self.release(slots)
            return
        if stamps.shape != (slots.shape[0], 4):
            raise KvCanaryError(f"stamps: expected shape ({slots.shape[0]}, 4), got {tuple(stamps.shape)}")
        self.stamps[slots] = stamps.to(self.device, torch.int64)
        rows = checks.scrub(self.stamps, self.layout, slots, self.ring.counters, self.step_id, Site.TRANSFER)
        self.ring.append(rows)

    def poll(self) -> list[Violation]:
        """Drain the violations recorded since the last poll, report them and return them.

        ``log`` mode logs each one; ``raise`` mode raises :class:`KvCorruptionError` carrying them.
        """
        if self.config.mode == "off":
            return []
        try:
            lost_before = self.ring.lost
            found = self.ring.drain()
            lost = self.ring.lost - lost_before
        except Exception as e:
            if self.config.mode == "raise":
                raise
            self.internal_errors += 1
            log.error("kvcanary internal error in poll (counted, not raised): %s: %s", type(e).__name__, e)
            return []
        if not found:
            return []
        self.history.extend(found)
        for cb in self.callbacks:
            cb(found)
        if self.config.mode == "raise":
            raise KvCorruptionError(found, lost)
        for v in found:
            log.warning("kvcanary violation %s", v.describe())
        if lost:
            log.warning("kvcanary: %d violations overflowed the ring before they were drained", lost)
        return found

    def stats(self) -> dict[str, int]:
        """Counters (slots verified and stamped, bytes fingerprinted, violations, ...)."""
        out = self.ring.counter_values()
        out["violations_lost"] = self.ring.lost
        out["internal_errors"] = self.internal_errors
        return out
