"""Reads of slots written in the same forward (a prefix-cache hit handed out before its KV exists):
verified after the step's writes are stamped, on both paths, bit-identical, never left unverified."""

import pytest
import torch

from kvcanary import Canary, CanaryConfig, Check, Step
from kvcanary.violations import Counter

from factories import paged_layout

NB, BS = 8, 4
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]  # two blocks, 0 and 1


def batch(written_from, reader_tokens=PREFIX):
    """Row 0 prefills PREFIX into blocks 0-1; row 1 holds the same blocks as a prefix hit (its
    cached prefix is PREFIX) and appends one token in block 2, in the same forward."""
    et = torch.full((2, 9), -1, dtype=torch.int64)
    et[0, :8] = torch.tensor(PREFIX)
    et[1, :9] = torch.tensor(reader_tokens + [19])
    return make_step([0, 8], [0, 8, 9], PREFIX + [19], list(range(8)) + [8], list(range(8)) + [8], [[0, 1, 3], [0, 1, 2]],
                et, written_from)


def make_step(cached, offsets, tokens, positions, slots, table, et, written_from=None):
    return Step(cached_lens=torch.tensor(cached), new_offsets=torch.tensor(offsets), new_tokens=torch.tensor(tokens),
                new_positions=torch.tensor(positions), new_slots=torch.tensor(slots), block_table=torch.tensor(table),
                block_size=BS, expected_tokens=et, written_from=written_from)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_reads_of_this_steps_writes_are_verified_after_stamping(backend):
    c = Canary(NB * BS, paged_layout(NB, BS), CanaryConfig(mode="log", content_budget_bytes=None, backend=backend))
    step = batch(torch.tensor([0, 0]))
    c.before_forward(step)
    c.after_forward(step)
    assert c.poll() == []
    st = c.stats()
    assert st["slots_verified_after_write"] == 8 and st["slots_verified"] == 8 and st["slots_stamped"] == 9
    assert st["links_checked"] == 8 and st["content_slots_verified"] == 8


def test_without_written_from_those_reads_find_empty_slots():
    c = Canary(NB * BS, paged_layout(NB, BS), CanaryConfig(mode="log", content_budget_bytes=None))
    c.before_forward(batch(None))
    assert {v.checks for v in c.poll()} == {Check.EMPTY}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_reader_whose_prefix_differs_is_caught_after_the_writes(backend):
    c = Canary(NB * BS, paged_layout(NB, BS), CanaryConfig(mode="log", content_budget_bytes=None, backend=backend))
    step = batch(torch.tensor([0, 0]), reader_tokens=PREFIX[:5] + [99] + PREFIX[6:])
    c.before_forward(step)
    assert c.poll() == []  # nothing is read before the forward
    c.after_forward(step)
    found = c.poll()
    assert [(v.row, v.position, v.checks) for v in found if v.checks & Check.TOKEN] == [(1, 5, Check.TOKEN)]


def test_torch_and_triton_agree_on_split_reads():
    out = []
    for backend in ("torch", "triton"):
        c = Canary(NB * BS, paged_layout(NB, BS), CanaryConfig(mode="log", content_budget_bytes=192, backend=backend))
        for wf in ([0, 0], [0, 3], [0, 8]):  # later rounds: the prefix is stamped, any split verifies clean
            step = batch(torch.tensor(wf))
            c.before_forward(step)
            c.after_forward(step)
        out.append((c.stamps.clone(), c.ring.counters.clone(), sorted(map(tuple, c.ring.rows.tolist())),
                    int(c.cursor)))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert out[0][2:] == out[1][2:]
    assert int(out[0][1][Counter.SLOTS_VERIFIED_AFTER_WRITE]) == 8 + 5 + 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_chain_that_continues_from_a_slot_written_in_the_same_step_links_up(backend):
    # row 1's new token at position 8 follows position 7, which row 0 writes in the same forward:
    # its link must come from the new stamp, or the next read of it is a false LINK
    c = Canary(NB * BS, paged_layout(NB, BS), CanaryConfig(mode="raise", content_budget_bytes=None, backend=backend))
    first = batch(torch.tensor([0, 0]))
    c.before_forward(first)
    c.after_forward(first)
    et = torch.tensor([PREFIX + [19, 20]])
    nxt = make_step([9], [0, 1], [20], [9], [9], [[0, 1, 2]], et)
    c.before_forward(nxt)
    assert c.poll() == [] and c.stats()["links_checked"] == 8 + 9
