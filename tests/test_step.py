"""Step validation: every bad shape, dtype and value gets an error naming it and what was expected."""

import random

import pytest
import torch

from kvcanary import Canary, CanaryConfig, StepError

from factories import random_step


def good():
    step, _ = random_step(random.Random(0), 64, 4, [(5, 2), (3, 1)])
    return step


def canary():
    return Canary(64, config=CanaryConfig(mode="raise"))


CASES = [
    (lambda s: setattr(s, "block_table", None), "exactly one of slot_table or block_table"),
    (lambda s: setattr(s, "slot_table", torch.zeros(2, 8, dtype=torch.int64)), "exactly one of slot_table or block_table"),
    (lambda s: setattr(s, "block_size", 0), "block_size must be >= 1, got 0"),
    (lambda s: setattr(s, "cached_lens", s.cached_lens.float()), "cached_lens: expected dtype torch.int32 or torch.int64, got torch.float32"),
    (lambda s: setattr(s, "new_offsets", s.new_offsets[:-1]), r"new_offsets: expected shape \(3,\), got \(2,\)"),
    (lambda s: setattr(s, "new_slots", s.new_slots[:1]), r"new_slots: expected shape \(3,\), got \(1,\)"),
    (lambda s: setattr(s, "row_valid", torch.ones(2, dtype=torch.int64)), "row_valid: expected dtype torch.bool, got torch.int64"),
    (lambda s: setattr(s, "block_table", s.block_table[0]), r"block_table: expected 2 dims, got shape"),
    (lambda s: setattr(s, "table_rows", torch.tensor([0, 9])), r"table_rows: expected in \[0, 2\), got 9 at index 1"),
    (lambda s: s.cached_lens.__setitem__(1, -1), "cached_lens: expected >= 0, got -1 at index 1"),
    (lambda s: s.new_offsets.__setitem__(0, 1), "new_offsets\\[0\\]: expected 0, got 1"),
    (lambda s: s.new_offsets.__setitem__(1, 4), "new_offsets increments: expected non-decreasing, got -1 at index 1"),
    (lambda s: s.new_slots.__setitem__(0, 64), "new_slots: expected < num_slots 64, got 64 at index 0"),
    (lambda s: s.cached_lens.__setitem__(0, 40), "cached_lens \\+ new tokens: expected <= table span 8, got 42 at index 0"),
    (lambda s: setattr(s, "read_starts", torch.tensor([6, 0])), r"read_starts: expected in \[0, cached_lens\], got 6 at index 0"),
    (lambda s: setattr(s, "read_starts", torch.tensor([5, 0])), "read_starts: expected < cached_lens when a row appends tokens, got 5"),
    (lambda s: setattr(s, "new_positions", s.new_positions - 10), "new_positions: expected >= 0"),
    (lambda s: setattr(s, "expected_tokens", torch.zeros(3, 4, dtype=torch.int64)), "expected_tokens: expected 2 rows, got 3"),
    (lambda s: (setattr(s, "expected_tokens", torch.zeros(3, 4, dtype=torch.int64)),
                setattr(s, "expected_rows", torch.tensor([2, 3]))), r"expected_rows: expected in \[0, 3\), got 3 at index 1"),
    (lambda s: (setattr(s, "expected_tokens", None), setattr(s, "expected_rows", torch.tensor([0, 1]))),
     "expected_rows: given without expected_tokens"),
    (lambda s: (setattr(s, "expected_tokens", torch.zeros(3, 4, dtype=torch.int64)),
                setattr(s, "expected_rows", torch.tensor([0]))), r"expected_rows: expected shape \(2,\), got \(1,\)"),
]


@pytest.mark.parametrize("mutate,msg", CASES)
def test_bad_step_raises_with_message(mutate, msg):
    s = good()
    mutate(s)
    with pytest.raises(StepError, match=msg):
        canary().before_forward(s)


def test_device_mismatch_named():
    s = good()
    s.new_tokens = s.new_tokens.to("meta")
    with pytest.raises(StepError, match="new_tokens: expected device cpu .*, got meta"):
        canary().after_forward(s)


def test_good_step_passes():
    canary().before_forward(good())


def test_a_new_tokens_stream_assigned_in_use_keeps_the_memo_and_remakes_its_descriptor_entries():
    """Step.assign_new (vLLM's position check assigns the positions the model is given between the
    step's verify and its stamp): the shape check and descriptor stay cached, the field's entries
    in the descriptor are remade, one handed out before is left as it was; a value that fails the
    field's check is assigned as any field is, and the stamp reads the new positions."""
    pytest.importorskip("numba")
    from kvcanary.fused._step import ENP, describe

    step = good()
    before = describe(step)
    memo = step.memo()
    memo["prepared"] = "a canary"
    new = torch.arange(step.num_new, dtype=torch.int64) + 100
    step.assign_new("expected_new_positions", new)
    assert step.memo() is memo and memo["prepared"] == "a canary"
    after = describe(step)
    assert after[ENP] == new.data_ptr() and after[ENP + 1] == 8 and after[ENP + 2] == 1
    assert (after[:ENP] == before[:ENP]).all() and (after[ENP + 3:] == before[ENP + 3:]).all()
    assert before[ENP] == 0  # the descriptor handed out before: unchanged
    assert describe(step) is after  # remade once
    step.assign_new("expected_new_positions", new[:1])  # the wrong length: the memo goes, the check runs
    assert "prepared" not in step.memo()
    with pytest.raises(StepError, match="expected_new_positions: expected shape"):
        step.validate_shapes()
    with pytest.raises(StepError, match="assign_new: expected expected_new_tokens or expected_new_positions"):
        step.assign_new("new_slots", new)


def test_positions_assigned_in_use_are_the_ones_the_stamp_checks():
    """A canary verifies a step, then its expected new positions are assigned through assign_new with
    one of them off: the stamp after the forward reports that position (the fused path reads the new
    field through the remade descriptor)."""
    pytest.importorskip("numba")
    from kvcanary import Check, Site

    c = Canary(64, config=CanaryConfig(mode="log", backend="fused"))
    step = good()
    c.before_forward(step)
    wrong = step.new_positions.clone()
    wrong[1] += 3
    step.assign_new("expected_new_positions", wrong)
    c.after_forward(step)
    found = [v for v in c.drain() if v.site == Site.WRITE]  # (the verify finds this fresh pool's slots empty)
    assert len(found) == 1 and Check.WRITE_INPUT_POSITION in found[0].checks
    assert found[0].slot == int(step.new_slots[1])
