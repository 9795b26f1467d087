"""The unknown state: slots written while the canary was not watching are counted, never reported,
and the chains written after them stay a function of the prefix alone; a failure of the canary's
own leaves unknown slots behind, never false reports."""

import random

import pytest
import torch

from kvcanary import Canary, CanaryConfig, Step, checks
from kvcanary.violations import Counter

from factories import paged_layout, prefill_of, random_step

NB, BS = 16, 4


def decode(base: Step, stoks) -> Step:
    """A decode step over ``base``'s table: row ``r`` has ``stoks[r]`` cached and appends one token."""
    r = len(stoks)
    cached = torch.tensor([len(s) for s in stoks])
    new = [s[-1] + 1 for s in stoks]
    et = torch.full((r, int(cached.max()) + 1), -1, dtype=torch.int64)
    for i, seq in enumerate(stoks):
        et[i, : len(seq) + 1] = torch.tensor(seq + [new[i]])
    s = Step(cached_lens=cached, new_offsets=torch.arange(r + 1), new_tokens=torch.tensor(new), new_positions=cached,
             new_slots=torch.zeros(r, dtype=torch.int64), block_table=base.table[:r], block_size=base.block_size,
             expected_tokens=et)
    s.new_slots = s.lookup(torch.arange(r), cached)
    return s


def grown(stoks, step: Step):
    return [seq + [int(t)] for seq, t in zip(stoks, step.new_tokens)]


def written(rng, cfg=None):
    """A canary that watched two rows' prefills (9 and 6 tokens, room for 6 more each)."""
    layout = paged_layout(NB, BS, seed=3)
    c = Canary(NB * BS, layout, cfg or CanaryConfig(mode="raise", content_budget_bytes=None))
    step, stoks = random_step(rng, NB * BS, BS, [(9, 6), (6, 6)])
    c.after_forward(prefill_of(step, stoks))
    stoks = [seq[: int(n)] for seq, n in zip(stoks, step.cached_lens)]
    step.new_offsets[:] = 0
    step.new_tokens = step.new_positions = step.new_slots = step.expected_new_tokens = torch.zeros(0, dtype=torch.int64)
    return c, step, stoks


def test_reads_of_unknown_slots_are_counted_never_reported():
    c, step, stoks = written(random.Random(0))
    c.forget(step.lookup(torch.tensor([0, 0]), torch.tensor([3, 4])))
    c.before_forward(step)
    assert c.poll() == []
    st = c.stats()
    assert st["slots_unverifiable"] == 2 and st["slots_verified"] == 15
    assert st["links_unchecked"] == 1  # position 5 follows an unknown slot


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_chain_written_after_an_unknown_slot_is_the_prefix_own(backend):
    rng = random.Random(1)
    watched, step, stoks = written(rng)
    blind = Canary(NB * BS, watched.layout, CanaryConfig(mode="raise", content_budget_bytes=None, backend=backend))
    blind.forget(torch.arange(NB * BS))  # attached to a warm engine: every slot unknown
    nxt = decode(step, stoks)
    watched.after_forward(nxt)
    blind.after_forward(nxt)
    new = nxt.new_slots
    assert torch.equal(blind.stamps[new], watched.stamps[new])  # the same link as if it had watched
    # the prefix is written again (a prefix cache swaps in an identical block): the chain joins up
    blind.after_forward(prefill_of(step, stoks))
    blind.before_forward(decode(step, grown(stoks, nxt)))
    assert blind.poll() == [] and blind.stats()["links_checked"] > 0


def test_without_the_prefix_tokens_the_new_slots_stay_unknown():
    c, step, stoks = written(random.Random(2))
    c.forget(torch.arange(NB * BS))
    nxt = decode(step, stoks)
    nxt.expected_tokens = None
    c.after_forward(nxt)
    assert bool((c.stamps[nxt.new_slots, checks.POSITION] == checks.UNKNOWN_POS).all())
    assert c.stats()["slots_stamped"] == 15  # the prefills', none of these


def test_stamps_that_could_not_travel_land_unknown():
    c, step, _ = written(random.Random(3))
    slots = step.lookup(torch.tensor([1, 1]), torch.tensor([0, 1]))
    c.import_stamps(slots, None)
    assert bool((c.stamps[slots, checks.POSITION] == checks.UNKNOWN_POS).all())
    c.before_forward(step)
    assert c.poll() == [] and c.stats()["slots_unverifiable"] == 2


OPS = [("torch", op) for op in ("verify", "stamp", "scrub", "set_state", "fingerprint")]
# the fused ops fingerprint inline; its forward hooks are one compiled call each (kvcanary.fused.forward)
OPS += [("fused", op) for op in ("before", "after", "scrub", "set_state")]


@pytest.mark.parametrize("backend,op", OPS)
def test_an_op_that_fails_once_leaves_no_false_report_behind(monkeypatch, backend, op):
    rng = random.Random(4)
    c, step, stoks = written(rng, CanaryConfig(mode="log", content_budget_bytes=None, backend=backend))
    if op in ("before", "after"):
        owner, orig = c._fast, getattr(c._fast, op)
    elif op in c._ops and backend != "torch":
        owner, orig = None, c._ops[op]
    else:
        owner = type(c.layout) if op == "fingerprint" else checks
        orig = getattr(owner, op)
    calls = {"n": 0}

    def once(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure inside kvcanary")
        return orig(*a, **k)

    if owner is None:
        monkeypatch.setitem(c._ops, op, once)
    else:
        monkeypatch.setattr(owner, op, once)
    free = sorted(set(range(NB)) - set(step.table.flatten().tolist()))[0] * BS  # a slot no row holds
    for _ in range(4):  # decode a few tokens, scrubbing and moving stamps around as an engine does
        nxt = decode(step, stoks)
        c.before_forward(nxt)
        c.after_forward(nxt)
        c.scrub()
        c.import_stamps(nxt.new_slots, c.export_stamps(nxt.new_slots))
        c.release(torch.tensor([free]))
        stoks = grown(stoks, nxt)
    c.before_forward(decode(step, stoks))
    assert calls["n"] > 1, f"{op} was never reached"
    assert c.poll() == [] and c.stats()["internal_errors"] == 1
