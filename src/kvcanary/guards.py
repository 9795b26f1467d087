"""A pool's guard slots and its padding writes: where a stray write lands, found on every forward.

**Reserved** slots (a layout's ``reserved``: a null block, the page padding tokens read from) are
never written by the engine: their bytes are fingerprinted when the canary is made and compared
after every forward. **Guarded** slots (the pool's first and last slot, the layout's ``guards``)
are live: one that holds a stamp is re-verified against it on every forward. **Padding writes**
(the slots an engine's padding tokens wrote) must not land in live or reserved KV.

No host sync: a changed reserved slot is recorded on the device and put into the ring at the next
drain (one record per slot and drain).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvcanary import checks
from kvcanary.errors import ConfigError, KvCanaryError
from kvcanary.layout import KvLayout
from kvcanary.violations import F_STEP, Check, Counter, Site, append_rows

_SCRUB_COUNTERS = [int(Counter.SLOTS_SCRUBBED), int(Counter.CONTENT_BYTES_SCRUBBED)]


class GuardSlots:
    """The guard slots of one pool of ``num_slots`` on ``device``.

    Attributes
    ----------
    reserved, guarded : int64 ``[n]`` the reserved and the guarded live slots; ``every``: both, in that order
    base : each reserved slot's fingerprint when last seen; ``now``: scratch for the torch path
    hit, was, got : per reserved slot, the step its change was found at (-1: none since the last
    drain) and the fingerprints before and after it
    """

    def __init__(self, layout: KvLayout, num_slots: int, device: torch.device,
                 content: Callable[..., None], table: Any) -> None:
        for name, ids in (("reserved", layout.reserved), ("guards", layout.guards)):
            bad = [i for i in ids if not 0 <= i < num_slots]
            if bad:
                raise ConfigError(f"layout {name}: slot {bad[0]} is outside the pool, expected 0 .. {num_slots - 1}")
        reserved = layout.reserved if layout.sources else ()
        guarded = sorted(({0, num_slots - 1} | set(layout.guards)) - set(reserved)) if layout.sources else []
        as_slots = lambda ids: torch.tensor(list(ids), dtype=torch.int64, device=device)  # noqa: E731
        self.reserved, self.guarded = as_slots(reserved), as_slots(guarded)
        self.every = as_slots(list(reserved) + guarded)  # the fused path checks them in one pass
        n = len(reserved)
        zeros = lambda: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        self.now, self.base, self.was, self.got = zeros(), zeros(), zeros(), zeros()
        if n:
            content(self.reserved, table, num_slots, self.base)
        # the fused path: the reserved slots' bytes as they were when ``base`` was taken
        self.regions: Any = None
        self.snapshot: Any = None
        if n and device.type == "cpu" and hasattr(table, "runs"):  # a fused layout table (kvcanary.fused.fold)
            from kvcanary.fused.snapshot import regions, taken

            self.regions = regions(table, self.reserved.numpy(), table.bytes_per_slot)
            self.snapshot = taken(self.regions) if self.regions.shape[0] else None
        self.hit = torch.full((n,), -1, dtype=torch.int64, device=device)
        # on a CPU pool, as numpy once: each drain looks at it (a torch call per drain costs tens of
        # microseconds right after an engine's forward)
        self.hit_host = self.hit.numpy() if self.hit.is_cpu else None
        self.num_slots = num_slots

    def snapshot_args(self) -> tuple[int, int, int]:
        """The fused guard's snapshot: its regions' address, their count, the snapshot's address
        (zeros: none)."""
        if self.snapshot is None:
            return 0, 0, 0
        return self.regions.ctypes.data, int(self.regions.shape[0]), self.snapshot.ctypes.data

    @property
    def count(self) -> int:
        """Slots checked on every forward (reserved and guarded)."""
        return int(self.reserved.shape[0] + self.guarded.shape[0])

    def check(self, ops: dict[str, Callable[..., Any]], stamps: torch.Tensor, table: Any, counters: torch.Tensor,
              rows: torch.Tensor, fused: bool) -> None:
        """Check every guard slot (site ``guard``) and count ``guard_checks``."""
        if fused:
            from kvcanary.fused.scrub import guard

            if self.every.numel():
                guard(stamps, table, self.every, self.reserved.shape[0], self.base, self.hit, self.was, self.got,
                      counters, rows, self.snapshot_args())
            return
        if self.guarded.numel():  # counted as guard checks, not as scrubbed slots
            scrubbed = counters[_SCRUB_COUNTERS].clone()
            ops["scrub"](stamps, table, self.guarded, counters, rows, Site.GUARD)
            counters[_SCRUB_COUNTERS] = scrubbed
        if self.reserved.numel():
            base, now = self.base, self.now
            ops["content"](self.reserved, table, self.num_slots, now)
            new = (now != base) & (self.hit < 0)
            self.hit.copy_(torch.where(new, counters[Counter.STEPS], self.hit))
            self.was.copy_(torch.where(new, base, self.was))
            self.got.copy_(torch.where(new, now, self.got))
            base.copy_(now)
        counters[Counter.GUARD_CHECKS] += self.count

    def flush(self, counters: torch.Tensor, rows: torch.Tensor) -> None:
        """Put the reserved-slot changes recorded since the last drain into the ring (at a drain,
        which syncs anyway)."""
        if not self.reserved.numel():
            return
        if self.hit_host is not None:
            if max(self.hit_host.tolist()) < 0:
                return
        elif not bool((self.hit >= 0).any()):
            return
        hit = self.hit >= 0
        s = self.reserved[hit]
        m1 = torch.full_like(s, -1)
        cols = [m1, s, m1, m1, m1, m1, torch.zeros_like(s), torch.zeros_like(s), self.got[hit], self.was[hit], m1]
        out = checks.pack(Site.GUARD, torch.full_like(s, int(Check.CONTENT)), 0, cols)
        out[:, F_STEP] = self.hit[hit]
        append_rows(counters, rows, out)
        self.hit[hit] = -1

    def check_padding(self, slots: torch.Tensor, stamps: torch.Tensor, counters: torch.Tensor, rows: torch.Tensor,
                      step_id: int) -> None:
        """Report padding writes (``slots``, int ``[n]``; negative: not written) that hit a live
        sequence's stamp or a reserved slot (``PADDING_WRITE``), or fell outside the pool (with
        ``BAD_SLOT``)."""
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise KvCanaryError(f"padding_slots: expected a 1-d integer tensor of slot ids, got {slots!r}")
        s = slots.to(stamps.device, torch.int64)
        s = s[s >= 0]
        inside = s < self.num_slots
        st = stamps[torch.where(inside, s, 0)]
        live = inside & (st[:, checks.POSITION] >= 0)
        bad = live | (inside & torch.isin(s, self.reserved)) | ~inside
        flags = torch.where(bad, int(Check.PADDING_WRITE), 0) | torch.where(inside, 0, int(Check.BAD_SLOT))
        st = torch.where(inside[:, None], st, -1)
        m1 = torch.full_like(s, -1)
        cols = [m1, s, st[:, checks.POSITION], m1, st[:, checks.TOKEN], st[:, checks.POSITION], torch.zeros_like(s),
                st[:, checks.LINK], torch.zeros_like(s), st[:, checks.CONTENT], m1]
        append_rows(counters, rows, checks.pack(Site.WRITE, flags, step_id, cols))
