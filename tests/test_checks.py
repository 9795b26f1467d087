"""The torch checks equal the per-slot loop: same stamps, same violations, on clean and corrupted pools."""

import os
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary import checks
from kvcanary.violations import F_CHECKS, F_POSITION, F_ROW, NUM_COUNTERS, Check, Counter

import loopref
from factories import paged_layout, prefill_of, random_step

NB, BS = 24, 4


def run_verify(stamps, layout, step, content_slots=None, cursor=0):
    counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64)
    cur = torch.tensor([cursor])
    rows = checks.verify(stamps, layout, step, counters, cur, content_slots, 0)
    return {(int(r[F_ROW]), int(r[F_POSITION])): int(r[F_CHECKS]) for r in rows}, counters


def corrupt(rng, stamps, layout, step):
    """A few random corruptions of stamps, KV bytes and the table."""
    for _ in range(rng.randint(1, 4)):
        what = rng.choice(["stamp", "byte", "table"])
        if what == "stamp":
            stamps[rng.randrange(stamps.shape[0]), rng.randrange(4)] ^= 1 << rng.randrange(63)
        elif what == "byte":
            src = rng.choice(layout.sources)
            src.tensor.view(-1)[rng.randrange(src.tensor.numel())] ^= 1 << rng.randrange(8)
        else:
            t = step.table
            t[rng.randrange(t.shape[0]), rng.randrange(t.shape[1])] = rng.randrange(-1, t.max().item() + 2)


@settings(max_examples=int(os.environ.get("KVC_EXAMPLES", 40)), deadline=None)
@given(
    seed=st.integers(0, 10**6),
    kind=st.sampled_from(["block", "token"]),
    nrows=st.integers(1, 4),
    pad_rows=st.integers(0, 2),
    pad_tokens=st.booleans(),
    window=st.sampled_from([None, 3]),
    budget=st.sampled_from([None, 0, 1, 5]),
    book=st.booleans(),
)
def test_torch_equals_loop(seed, kind, nrows, pad_rows, pad_tokens, window, budget, book):
    rng = random.Random(seed)
    layout = paged_layout(NB, BS, seed=seed)
    lens = [(rng.randint(0, 9), rng.randint(0, 5)) for _ in range(nrows)]
    step, stoks = random_step(rng, NB * BS, BS, lens, kind, pad_rows, pad_tokens, window, book)
    stamps_t = checks.new_stamps(NB * BS)
    stamps_l = stamps_t.clone()
    pre = prefill_of(step, stoks)
    counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64)
    assert checks.stamp(stamps_t, layout, pre, counters, 0).shape[0] == 0
    assert loopref.stamp(stamps_l, layout, pre) == {}
    assert torch.equal(stamps_t, stamps_l)

    got, _ = run_verify(stamps_t, layout, step)
    assert got == {}, "clean pool must verify clean"
    if rng.random() < 0.7:
        corrupt(rng, stamps_t, layout, step)
        stamps_l.copy_(stamps_t)
    cursor = rng.randrange(20)
    got, cnt = run_verify(stamps_t, layout, step, budget, cursor)
    n = int(cnt[Counter.SLOTS_VERIFIED])
    sel = None
    if budget is not None and n:
        sel = {e for e in range(n) if (e - cursor % n) % n < min(budget, n)}
    assert got == loopref.verify(stamps_l, layout, step, sel)
    # writes: the stamps and the write checks match too
    if rng.random() < 0.3 and step.num_new:
        step.new_positions[rng.randrange(step.num_new)] += 1
    cnt = torch.zeros(NUM_COUNTERS, dtype=torch.int64)
    rows = checks.stamp(stamps_t, layout, step, cnt, 0)
    want = loopref.stamp(stamps_l, layout, step)
    offs = step.new_offsets.tolist()
    got_w = {}
    for r in rows:
        rr, p = int(r[F_ROW]), int(r[F_POSITION])
        got_w[offs[rr] + p - int(step.cached_lens[rr])] = int(r[F_CHECKS])
    assert got_w == want
    assert torch.equal(stamps_t, stamps_l)


def test_counters_and_budget_rotation():
    rng = random.Random(3)
    layout = paged_layout(NB, BS, seed=3)
    step, stoks = random_step(rng, NB * BS, BS, [(9, 1), (7, 1)])
    stamps = checks.new_stamps(NB * BS)
    checks.stamp(stamps, layout, prefill_of(step, stoks), torch.zeros(NUM_COUNTERS, dtype=torch.int64), 0)
    counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64)
    cursor = torch.zeros(1, dtype=torch.int64)
    for _ in range(4):  # 4 steps x 4 slots covers all 16 read slots once
        assert checks.verify(stamps, layout, step, counters, cursor, 4, 0).shape[0] == 0
    c = {k.name: int(counters[k]) for k in Counter}
    assert c["SLOTS_VERIFIED"] == 64
    assert c["CONTENT_SLOTS_VERIFIED"] == 16 and c["CONTENT_SLOTS_SKIPPED"] == 48
    assert c["CONTENT_BYTES_VERIFIED"] == 16 * layout.content_bytes_per_slot
    assert c["LINKS_CHECKED"] == 64
    assert int(cursor) == 16


def test_a_wrong_token_in_a_record_read_through_expected_rows_is_reported_at_its_row_and_position():
    """A step that reads an engine's token record in place (``expected_rows``) is checked against
    the rows it names: a wrong token there is a TOKEN violation at that step row and position; a
    wrong token in a row no step row names, or past what the row reads, is not consulted."""
    rng = random.Random(5)
    layout = paged_layout(NB, BS, seed=5)
    step, stoks = random_step(rng, NB * BS, BS, [(9, 1), (7, 1)], book=True)
    stamps = checks.new_stamps(NB * BS)
    checks.stamp(stamps, layout, prefill_of(step, stoks), torch.zeros(NUM_COUNTERS, dtype=torch.int64), 0)
    assert run_verify(stamps, layout, step)[0] == {}
    named = set(step.expected_rows.tolist())
    other = next(i for i in range(step.expected_tokens.shape[0]) if i not in named)
    step.expected_tokens[other, :5] += 1  # a row no step row reads
    step.expected_tokens[int(step.expected_rows[0]), 9:] += 1  # past row 0's reads (its new token: a separate stream)
    assert run_verify(stamps, layout, step)[0] == {}
    step.expected_tokens[int(step.expected_rows[1]), 4] += 1
    got, _ = run_verify(stamps, layout, step)
    assert got == {(1, 4): int(Check.TOKEN)}
    assert got == loopref.verify(stamps, layout, step, None)
