"""The patrol's walk: one round-robin pass after another over a pool's slots, shared by the scrub
(:meth:`kvcanary.canary.Canary.scrub`) and the engine-driven patrol
(:meth:`kvcanary.canary.Canary.patrol`), and the bound it gives on how stale a slot's last check is."""

from __future__ import annotations

import collections

import numpy as np
import torch


class PatrolWalk:
    """The walk over ``num_slots`` slots.

    Attributes
    ----------
    cursor : the slot the next call starts at
    passes : complete passes over the pool
    visits : the calls ``(forward, slots)`` back to the last that reached the slot at the cursor
    walked : the slots those calls walked, in all
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.cursor = 0
        self.passes = 0
        self.visits: collections.deque[tuple[int, int]] = collections.deque()
        self.walked = 0

    def walk(self, n: int, forward: int) -> int:
        """Move the cursor past its next ``n`` slots in forward ``forward``; returns where they start."""
        visits = self.visits
        visits.append((forward, n))
        self.walked += n
        while self.walked - visits[0][1] >= self.num_slots:
            self.walked -= visits.popleft()[1]  # the slots at the cursor were walked over again since
        first = self.cursor
        self.passes += (first + n) // self.num_slots
        self.cursor = (first + n) % self.num_slots
        return first

    def next(self, n: int, forward: int, device: torch.device, host: bool) -> torch.Tensor:
        """The next ``n`` slots of the walk, int64 on ``device`` (made with numpy where ``host``)."""
        first = self.walk(n, forward)
        if host:
            return torch.from_numpy((np.arange(n) + first) % self.num_slots)
        return (torch.arange(n, device=device) + first) % self.num_slots

    def age_max(self, forwards: int) -> int:
        """At most how many forwards ago the walk last passed any slot: the forwards since it last
        passed the slot at its cursor, or all of them while no walk has covered the pool."""
        if self.walked >= self.num_slots:
            return forwards - self.visits[0][0]
        return forwards
