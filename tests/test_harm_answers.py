"""Harm as answers changed on the trained model (kvcanary.faults.answers, bench/harm_answers.py): the
cheap fault classes injected into the 8 chat questions in log mode and in repair mode; repair gives
every question its clean answer (or, for a corruption recomputing does not fix, an error), never
other text."""

import pytest
from test_real_model import converted_cache

from kvcanary.faults import answers


@pytest.fixture(scope="module")
def chat():
    mp = pytest.MonkeyPatch()
    mp.setenv("KVCANARY_CACHE_DIR", converted_cache())
    try:
        yield answers.chat("bfloat16", max_new_tokens=16)
    finally:
        mp.undo()


def test_the_clean_answers_are_the_demos(chat):
    assert chat.clean[0] == "The capital of France is Paris." and "Shakespeare" in chat.clean[-1]


@pytest.mark.parametrize("name, audit_queries", [
    ("bit_flip", answers.FULL_AUDIT), ("table_redirect", answers.FULL_AUDIT),
    # a kernel bug hits every forward: with every query of a decode forward audited, no token computed
    # by it is served; repair recomputes its readers, which read it again and fail after repair_limit
    ("layout_disagreement", 4096)])
def test_repair_changes_no_answer(chat, name, audit_queries):
    row = answers.run_class(chat, name, audit_queries=audit_queries)
    log, rep = row["log"], row["repair"]
    assert row["applicable"] and row["injected_same"] and log["injected_at"] is not None, row
    assert log["detected"] and rep["detected"] and not log["changed_undetected"], row
    assert rep["answers_changed"] == 0, rep["changed"]
    assert rep["repairs"] >= 1 and log["internal_errors"] == rep["internal_errors"] == 0, row
    assert row["ok"]
    if name != "layout_disagreement":  # recomputing heals a flipped byte and a redirected table entry
        assert rep["failed"] == 0, rep["failed_questions"]
    else:
        assert log["answers_changed"] > 0 and rep["failed"] > 0  # the fault is visible in the text


def test_a_class_that_needs_a_window_is_not_applicable(chat):
    row = answers.run_class(chat, "window_off_by_one")
    assert row["applicable"] is False and "sliding-window" in row["why"]
