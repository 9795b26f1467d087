"""The harm count (kvcanary.harm): the ledger of each slot's last fingerprinting, checked against
what the ops really re-fingerprint, and the tokens counted from it."""

from __future__ import annotations

import random

import pytest
import torch

from factories import paged_layout, prefill_of, random_step
from kvcanary import CanaryConfig
from kvcanary.canary import Canary
from kvcanary.harm import HarmCounter
from kvcanary.violations import Check, Site, Violation


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("budget_slots", [1, 7, 1000])
def test_the_ledger_marks_exactly_the_slots_a_verify_fingerprints(backend, budget_slots):
    """Every stamped byte is flipped, so each slot a verify re-fingerprints is reported: over several
    verifies of a rotating window, the reported slots are the ledger's marked, stamped ones."""
    rng = random.Random(3)
    bs, blocks = 4, 64
    layout = paged_layout(blocks, bs, row=16, nsrc=1)
    per_slot = layout.content_bytes_per_slot
    cfg = CanaryConfig(mode="log", backend=backend, patrol_budget_bytes=0,
                       content_budget_bytes=None if budget_slots is None else budget_slots * per_slot)
    canary = Canary(blocks * bs, layout, cfg)
    step, stoks = random_step(rng, blocks * bs, bs, [(13, 1), (6, 1), (22, 1)])
    canary.after_forward(prefill_of(step, stoks))
    canary.drain()
    layout.sources[0].tensor.bitwise_xor_(1)  # every slot's bytes changed
    for _ in range(4):
        before = canary.ledger.at.copy()
        f = canary.forwards
        canary.before_forward(step)
        reported = {v.slot for v in canary.drain() if v.checks & Check.CONTENT}
        marked = {int(s) for s in torch.nonzero(torch.from_numpy(canary.ledger.at == f)).flatten()
                  if before[int(s)] != f}
        stamped = {int(s) for s in torch.nonzero(canary.stamps[:, 1] >= 0).flatten()}
        assert reported and reported == marked & stamped
        canary.forwards += 1  # the next verify is a later forward (the engine's after_forward counts)


def violation(request: str, step: int, slot: int, checks: Check, group: str | None = None) -> Violation:
    return Violation(site=Site.VERIFY, checks=checks, step=step, row=0, slot=slot, position=0, expected_token=-1,
                     stored_token=-1, stored_position=0, expected_link=0, stored_link=0, expected_content=0,
                     stored_content=0, aux=-1, request=request, group=group)


class Ledger:
    def __init__(self, good: int) -> None:
        self.good = good

    def last_good(self, slot: int, forward: int, read: bool = False) -> int:
        return self.good


def test_harmful_tokens_are_the_readers_tokens_since_the_last_good_check():
    h = HarmCounter()
    for f in range(10):
        h.forward(f, {"a": 1, "b": 2 if f % 2 else 0})
    # a changed byte found at forward 8, last verified good at forward 5: forwards 6 and 7 read it
    # unverified; the reporting forward 8 counts too unless healing dropped its output
    assert h.count([violation("a", 8, 3, Check.CONTENT)], {None: Ledger(5)}, healed=True) == 2
    assert h.count([violation("a", 8, 3, Check.CONTENT)], {None: Ledger(5)}, healed=False) == 3
    # a foreign slot is found at its first read: no harm before the report
    assert h.count([violation("b", 9, 3, Check.POSITION)], {None: Ledger(0)}, healed=True) == 0
    assert h.count([violation("b", 9, 3, Check.POSITION)], {None: Ledger(0)}, healed=False) == 2
    # verified the forward before (every read byte, each forward): nothing
    assert h.count([violation("a", 9, 3, Check.CONTENT)], {None: Ledger(8)}, healed=True) == 0
    assert h.harmful == 2 + 3 + 0 + 2 + 0
