"""The read audit's count per forward (kvcanary.audit.budget) and the rotation's coverage
(kvcanary.audit.auditor)."""

import math

import numpy as np
import pytest

from kvcanary.audit.auditor import Auditor
from kvcanary.audit.budget import AUDIT_ROUNDS, FOCUS, WARM, QueryBudget, shape_class


def test_new_situations_get_the_full_count_and_known_ones_follow_the_time_budget():
    b = QueryBudget(64, 0.01)
    assert [b.plan("decode") for _ in range(WARM)] == [64] * WARM  # the first forwards after start
    # each query costs 10 us of a 10 ms forward: 1 % is 100 us, 10 queries; the count at most doubles
    counts = []
    for _ in range(12):
        n = b.plan("decode")
        counts.append(n)
        b.observe(n, n * 10e-6, 10e-3)
    assert counts[0] == 1 and counts[1] == 2 and counts[2] == 4 and counts[-1] == 10
    assert b.plan("prefill") == 64  # another situation: the full count once
    b.observe(64, 64 * 10e-6, 10e-3)
    after = []
    for _ in range(12):  # its 540 us over the share paid back by smaller counts, then the budget's again
        n = b.plan("prefill")
        after.append(n)
        b.observe(n, n * 10e-6, 10e-3)
    assert after[0] == 0 and after[-1] == 10 and sum(after) < 10 * len(after) - 40


def test_over_a_run_the_audit_keeps_to_its_share_despite_new_situations():
    b = QueryBudget(64, 0.01)
    spent = total = 0.0
    for f in range(400):
        n = b.plan(f // 50)  # a new situation every 50 forwards
        b.observe(n, n * 10e-6, 10e-3)
        if f >= WARM:
            spent, total = spent + n * 10e-6, total + 10e-3
    assert spent / total <= 0.0105


def _over_budget(b: QueryBudget, forwards: int) -> list[int]:
    """Each forward's count where a query costs as much as the forward (the budget never pays one)."""
    counts = []
    for _ in range(forwards):
        n = b.plan(0)
        counts.append(n)
        b.observe(n, 1e-3 if n else 0.0, 1e-3)
    return counts


def test_an_audit_dearer_than_its_budget_audits_one_query_in_each_run_of_rounds_forwards():
    b = QueryBudget(64, 0.01)
    for _ in range(WARM):
        b.plan(0)
    _over_budget(b, 2)  # the first queries' cost is owed: from here no forward's count pays a query
    counts = _over_budget(b, 40 * AUDIT_ROUNDS)
    assert set(counts) == {0, 1} and sum(counts) == 40  # one in each run of AUDIT_ROUNDS
    audited = [i for i, n in enumerate(counts) if n]
    gaps = [b2 - a for a, b2 in zip(audited, audited[1:])]
    assert max(gaps) <= 2 * AUDIT_ROUNDS - 1 and len(set(gaps)) > 3  # at most 15 apart, at varying places
    assert b.stats()["audit_forwards_without_queries"] >= len(counts) - 40
    assert b.write_layers(30)[1] == math.ceil(30 / 8)  # the fewest layers' writes


@pytest.mark.parametrize("period", [8, 16, 20, 24])
def test_a_periodic_brief_fault_meets_an_audited_forward_whatever_its_phase(period):
    """A fixed cadence (every 8th forward) never audits a forward of a fault that strikes every 8th, 16th
    or 24th forward at another phase, and meets one striking every 20th only at half the phases; the
    drawn place in each run meets every phase within a few hundred forwards."""
    b = QueryBudget(64, 0.01)
    for _ in range(WARM):
        b.plan(0)
    _over_budget(b, 2)
    audited = {i for i, n in enumerate(_over_budget(b, 50 * period)) if n}
    for phase in range(period):
        assert any(f in audited for f in range(phase, 50 * period, period)), phase


def test_without_a_read_audit_there_is_no_cadence():
    b = QueryBudget(0, 0.01)
    for _ in range(WARM + 3 * AUDIT_ROUNDS):
        assert b.plan(0) == 0
    assert b.stats()["audit_forwards_without_queries"] == 0


def test_the_audit_comes_back_when_the_other_checks_leave_room_again():
    b = QueryBudget(64, 0.01)
    for _ in range(WARM):
        b.plan(0)
    for _ in range(3 * AUDIT_ROUNDS):  # other checks at 150 % of the share: no queries but the cadence's
        n = b.plan(0)
        b.observe(n, n * 10e-6, 10e-3, 150e-6 + n * 10e-6)
    assert b.count == 0
    counts = []
    for _ in range(40):  # other checks at 60 %: the balance is paid back, then 4 queries a forward
        n = b.plan(0)
        counts.append(n)
        b.observe(n, n * 10e-6, 10e-3, 60e-6 + n * 10e-6)
    assert counts[-1] == 4 and counts[0] <= 1


def test_without_a_budget_every_forward_audits_the_configured_count():
    b = QueryBudget(16, None)
    for _ in range(WARM + 5):
        assert b.plan(0) == 16
        b.observe(16, 1.0, 1e-3)


@pytest.mark.parametrize("layers,rows,heads", [(2, 20, 4), (30, 16, 9), (4, 3, 8), (1, 1, 1)])
def test_the_rotation_covers_pairs_and_triples_within_its_stated_bounds(layers, rows, heads):
    a = Auditor(1, None)
    picks = [a.pick(list(range(layers)), [1] * rows, heads, 1)[0] for _ in range(rows * heads * layers)]
    bound = heads if rows >= heads else (heads - rows + 1) * rows
    pairs_lh = {(lay, h) for lay, _, _, h in picks[: bound * layers]}
    pairs_lr = {(lay, r) for lay, r, _, _ in picks[: rows * layers]}
    triples = {(lay, r, h) for lay, r, _, h in picks}
    assert len(pairs_lh) == layers * heads and len(pairs_lr) == layers * rows
    assert len(triples) == layers * rows * heads


def test_focus_rows_get_their_own_queries_on_their_newest_token():
    a = Auditor(64, None)
    out = a.pick([0, 1, 2], [5, 1, 7], 4, count=2, focus=[2], per_focus=FOCUS)
    assert len(out) == 2 + FOCUS
    mine = out[2:]
    assert {r for _, r, _, _ in mine} == {2} and {off for _, _, off, _ in mine} == {6}
    assert len({lay for lay, _, _, _ in mine}) == 3  # spread over the layers


def test_shape_classes_are_decode_or_prefill_and_rows_to_a_power_of_two():
    assert shape_class(16, False) == shape_class(9, False) == (False, 16)
    assert shape_class(17, False) == (False, 32) and shape_class(1, True) == (True, 1)


def test_a_request_gets_focus_queries_at_its_first_prefix_hit_and_its_first_decode():
    from kvcanary.config import CanaryConfig
    from kvcanary.engines.audit import EngineAudit

    class _Adapter:
        config = CanaryConfig()
        seconds = 0.0

    audit = EngineAudit(_Adapter(), 4)
    assert audit._focus(["a", "b"], np.array([8, 8]), np.array([0, 16])) == [1]  # b read a cached prefix
    assert audit._focus(["a", "b"], np.array([8, 1]), np.array([8, 24])) == [1]  # b's first decode; a's chunk
    assert audit._focus(["a", "b"], np.array([1, 1]), np.array([16, 25])) == [0]  # a's first decode only
    assert audit._focus(["a", "b"], np.array([1, 1]), np.array([17, 26])) == []
    assert math.isclose(audit.budget.share, 0.01)


def test_the_budget_is_the_whole_canary_s_share_the_audit_fills_what_its_other_checks_leave():
    b = QueryBudget(64, 0.01)
    for _ in range(WARM):
        b.plan(0)
    # 1 % of a 10 ms forward is 100 us: the canary's other checks take 60 us, a query 10 us: 4 queries
    counts, shares = [], []
    for _ in range(30):
        n = b.plan(0)
        counts.append(n)
        b.observe(n, n * 10e-6, 10e-3, 60e-6 + n * 10e-6)
        shares.append((60e-6 + n * 10e-6) / 10e-3)
    assert counts[-1] == 4 and max(shares[10:]) <= 0.01
    # other checks above the share: no query on a known-situation forward (but the cadence's)
    for _ in range(5):
        n = b.plan(0)
        b.observe(n, n * 10e-6, 10e-3, 150e-6 + n * 10e-6)
    assert b.count == 0 and b.plan(0) == 0


def test_the_audit_sets_the_canary_s_seconds_since_the_last_forward_against_the_wall_time_since(monkeypatch):
    """EngineAudit.end: the canary's seconds between two forwards' ends (its other checks too) against
    the wall time between them; an engine idle between forwards saves up nothing for the next."""
    from types import SimpleNamespace

    from kvcanary import config as cfg
    from kvcanary.engines import audit as engine_audit

    clock = [100.0]
    monkeypatch.setattr(engine_audit, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    adapter = SimpleNamespace(config=cfg.CanaryConfig(), seconds=0.0)
    audit = engine_audit.EngineAudit(adapter, 4)
    for _ in range(WARM):
        audit.budget.plan(0)

    def forward(wall: float, other: float, idle: float = 0.0) -> int:
        """One forward of ``wall`` seconds after ``idle`` ones, the canary's other checks ``other``
        seconds, each query 10 us: its count."""
        clock[0] += idle
        n = audit.budget.plan(0)
        audit.fa, audit._opened, audit.spent = SimpleNamespace(queries=[0] * n), clock[0], n * 10e-6
        clock[0] += wall
        adapter.seconds += other + n * 10e-6
        audit.end()
        return n

    counts = [forward(10e-3, 60e-6) for _ in range(30)]
    assert counts[-1] == 4  # 100 us of a 10 ms forward: 60 us of other checks leave 4 queries
    # 100 s idle before a forward saves up at most one forward's share, not 1 % of 100 s (which would
    # pay for 64 queries a forward for a thousand forwards)
    after = [forward(10e-3, 60e-6, idle=100.0)] + [forward(10e-3, 60e-6) for _ in range(15)]
    assert max(after) <= 16 and after[-1] == 4


def test_the_write_check_thins_with_the_query_count_and_covers_every_layer_within_its_rounds():
    from kvcanary.audit.budget import WRITE_ROUNDS

    layers = 30
    b = QueryBudget(64, 0.01)
    for _ in range(WARM):  # warm-up: every layer
        b.plan("decode")
        assert b.write_layers(layers) == (0, layers)
    # over budget: no query a forward but the cadence's, and the fewest layers, rotating over all of them
    seen: list[int] = []
    for _ in range(2 * WRITE_ROUNDS):
        n = b.plan("decode")
        b.observe(n, 1e-3, 10e-3, 5e-3)  # the canary takes half of each forward
        assert b.count == 0
        first, count = b.write_layers(layers)
        assert count == math.ceil(layers / WRITE_ROUNDS)
        seen += [(first + i) % layers for i in range(count)]
    for start in range(0, len(seen) - layers, math.ceil(layers / WRITE_ROUNDS)):  # any WRITE_ROUNDS forwards
        assert set(seen[start:start + WRITE_ROUNDS * math.ceil(layers / WRITE_ROUNDS)]) == set(range(layers))
    b.plan("prefill")  # a new situation: every layer
    assert b.write_layers(layers) == (0, layers)
    # a query count at half the full count checks half the layers
    b.plan("prefill")
    b.count = 32
    assert b.write_layers(layers)[1] == 15
    b.count = 64
    assert b.write_layers(layers)[1] == layers
    assert b.write_layers(0) == (0, 0)


def test_without_a_budget_every_forward_checks_every_layer_s_writes():
    b = QueryBudget(64, None)
    for _ in range(3 * WARM):
        b.plan("decode")
        b.observe(64, 1e-3, 10e-3, 5e-3)
        assert b.write_layers(30) == (0, 30)


def test_the_first_forward_is_charged_what_the_canary_did_since_it_started(monkeypatch):
    """EngineAudit.end on the first forward: the canary's seconds since the audit was made (a new
    pool's setup, the prefill's stamps) against the wall time since, so the budget pays them back
    in the forwards after it; a forward whose canary kept to its share owes nothing."""
    from types import SimpleNamespace

    from kvcanary import config as cfg
    from kvcanary.engines import audit as engine_audit

    def first_forward(setup: float) -> float:
        clock = [100.0]
        monkeypatch.setattr(engine_audit, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
        adapter = SimpleNamespace(config=cfg.CanaryConfig(audit_budget=0.01), seconds=0.0)
        audit = engine_audit.EngineAudit(adapter, 4)
        clock[0] += setup  # the setup, in the canary's hooks
        adapter.seconds += setup
        n = audit.budget.plan(0)
        audit.fa, audit._opened, audit.spent = SimpleNamespace(queries=[0] * n), clock[0], n * 10e-6
        clock[0] += 100e-3  # a 100 ms forward
        adapter.seconds += n * 10e-6
        audit.end()
        return audit.budget.balance

    # 10 ms of setup and 64 queries at 10 us against 1 % of 110 ms: 9.5 ms owed
    assert first_forward(10e-3) == pytest.approx(0.01 * 110e-3 - 10.64e-3)
    assert first_forward(0.0) == pytest.approx(0.01 * 100e-3 - 0.64e-3)


def test_the_write_checked_tokens_are_one_array_per_count_until_the_range_grows():
    """EngineAudit.pick_writes hands out the same views for the same token count (a plan made for them,
    kvcanary.engines.vllm.wide.WideForward.again, runs again only on the same array), new ones for
    another count, and new ones over the new range once it grows."""
    import torch

    from kvcanary.config import CanaryConfig
    from kvcanary.engines.audit import EngineAudit

    class _Adapter:
        config = CanaryConfig()
        seconds = 0.0

    audit = EngineAudit(_Adapter(), 4)
    cpu = torch.device("cpu")
    audit.pick_writes(16, cpu)
    toks, index = audit.write_tokens, audit.write_index
    assert toks is not None and index is not None
    assert toks.tolist() == list(range(16)) and index.tolist() == list(range(16))
    audit.pick_writes(5, cpu)
    assert audit.write_tokens is not toks and audit.write_tokens.tolist() == list(range(5))
    audit.pick_writes(16, cpu)
    assert audit.write_tokens is toks and audit.write_index is index  # the same count: the same arrays
    audit.pick_writes(0, cpu)
    assert audit.write_tokens is None and audit.write_index is None  # nothing written: nothing checked
    audit.pick_writes(1000, cpu)  # past the range (256): made again, every view with it
    assert audit.write_tokens.tolist() == list(range(1000))
    audit.pick_writes(16, cpu)
    assert audit.write_tokens is not toks and audit.write_tokens.tolist() == list(range(16))
