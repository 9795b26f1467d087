"""Every fault class is detected by its expected check within its deadline, across seeds, table
kinds and layouts; a long clean soak reports nothing; the selftest's exit status follows both."""

import json

import pytest

from kvcanary.cli import main
from kvcanary.faults import runner
from kvcanary.faults import scripted as scripted_faults
from kvcanary.faults.catalog import BY_NAME, CATALOG, Outcome, Point

DETECT = [f for f in CATALOG if f.outcome == Outcome.DETECT]
SCRIPTED = [f for f in DETECT if f.point != Point.KERNEL]  # the kernel classes need an engine's attention


@pytest.mark.parametrize("fc", SCRIPTED, ids=lambda f: f.name)
@pytest.mark.parametrize("seed,table,layout", [(0, "block", "paged"), (1, "token", "flat"), (2, "block", "packed"),
                                               (3, "token", "head_major"), (4, "block", "mla")])
def test_scripted_fault_detected_in_time(fc, seed, table, layout):
    r = runner.run_scripted(fc, seed, table=table, layout=layout)
    assert r.detected, r.detail
    assert r.forwards_to_detect is not None and r.forwards_to_detect <= fc.max_forwards, r
    assert set(r.checks_fired) & {c.name for c in type(fc.checks) if c in fc.checks}
    assert r.ok


@pytest.mark.parametrize("name", sorted(runner.CB_FAULTS))
def test_transformers_fault_detected_in_time(name):
    for seed in (0, 1):
        r = runner.run_transformers(BY_NAME[name], seed)
        assert r.ok, r


def test_catalog_is_complete_and_documented():
    assert set(scripted_faults.INJECTORS) == {f.name for f in SCRIPTED}
    assert {f.name for f in DETECT if f.point == Point.KERNEL} == set(runner.KERNEL_FAULTS)  # transformers runs them
    for f in CATALOG:
        assert f.summary
        if f.outcome == Outcome.MISS:
            assert f.why_missed and not f.checks
        else:
            assert f.checks and f.max_forwards >= 1
    points = {f.point for f in DETECT}
    assert points == set(Point)


def test_clean_soak_ten_thousand_steps():
    st = runner.soak(10_000, seed=7)
    assert st["soak_steps"] >= 10_000
    assert st["violations"] == 0 and st["internal_errors"] == 0
    assert st["slots_verified"] > 100_000 and st["content_bytes_verified"] > 0


def test_selftest_passes_and_prints_matrix(capsys):
    assert main(["selftest", "--seeds", "1", "--soak", "50", "--no-transformers"]) == 0
    out = capsys.readouterr().out
    assert "selftest passed" in out and "bit_flip" in out
    # without transformers, the kernel classes say they did not run, and why
    assert "attention_read_bug" in out and "needs an engine's attention kernel" in out


def test_selftest_fails_when_a_detection_is_missed(capsys, monkeypatch):
    monkeypatch.setitem(scripted_faults.INJECTORS, "bit_flip", lambda eng, rng: scripted_faults.Injection({}))
    assert main(["selftest", "--seeds", "1", "--soak", "20", "--no-transformers", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    bad = [r for r in rep["matrix"] if r["status"] == "FAIL"]
    assert [r["fault"] for r in bad] == ["bit_flip"] and not rep["ok"]


def test_selftest_fails_on_a_false_positive(capsys, monkeypatch):
    monkeypatch.setattr(runner, "soak", lambda n, progress=None: {"soak_steps": n, "violations": 1,
                                                                  "internal_errors": 0, "slots_verified": 1})
    assert main(["selftest", "--seeds", "1", "--soak", "20", "--no-transformers", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["soak"]["false_positives"] == 1 and not rep["ok"]
