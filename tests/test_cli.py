"""The command line: help and usage errors without torch, the selftest without a soak, the scripted
demo's injected faults and their detections; the package's lazily imported public names."""

import json
import subprocess
import sys

import pytest

import kvcanary
from kvcanary.cli import main
from kvcanary.faults import runner

HEAVY = ("torch", "transformers", "triton", "numpy")


def _imported(argv: list[str]) -> tuple[int, set[str], str]:
    """Run ``python -X importtime -m kvcanary *argv``: its exit status, the modules it imported, stderr."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvcanary", *argv],
                          capture_output=True, text=True, timeout=120)
    mods = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done.returncode, mods, done.stderr


@pytest.mark.parametrize("argv, status", [
    (["--help"], 0), (["demo", "--help"], 0), (["selftest", "--help"], 0), (["warmup", "--help"], 0),
    (["report", "--help"], 0),
    (["demo", "--bogus"], 2), (["demo", "--engine", "nope"], 2), (["selftest", "--soak", "-1"], 2), ([], 2),
])
def test_help_and_usage_errors_import_nothing_heavy(argv, status):
    code, mods, err = _imported(argv)
    assert code == status, err[-2000:]
    assert "kvcanary.cli" in mods  # the probe saw the command line load
    heavy = sorted(m for m in mods if m.split(".")[0] in HEAVY)
    assert not heavy, heavy[:10]


def test_help_lists_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:" in out and "2  bad usage" in out


@pytest.mark.parametrize("argv, message", [
    (["selftest", "--soak", "-1"], "argument --soak: expected an integer >= 0, got -1"),
    (["selftest", "--seeds", "0"], "argument --seeds: expected an integer >= 1, got 0"),
    (["demo", "--requests", "x"], "argument --requests: expected an integer, got 'x'"),
])
def test_bad_counts_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_selftest_soak_0_runs_no_soak(capsys):
    argv = ["selftest", "--no-transformers", "--seeds", "1", "--soak", "0"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True
    assert out["soak"] == {"ran": False, "steps": 0, "false_positives": 0, "slots_verified": 0}
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "clean soak: not run (--soak 0)" in text and text.rstrip().endswith("selftest passed")


def test_scripted_demo_inject_reports_each_detection(capsys):
    argv = ["demo", "--engine", "scripted", "--requests", "8", "--inject"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["violations"] == 0  # the clean run stays clean
    assert [f["fault"] for f in out["injected"]] == list(runner.CB_FAULTS)
    for f in out["injected"]:
        assert f["detected"] and f["in_time"], f
        assert isinstance(f["injected_at_step"], int) and f["checks_fired"], f
        assert "slot" in f["first_detection"] and f["first_detection"].startswith("["), f
    assert main(argv) == 0
    text = capsys.readouterr().out
    for name in runner.CB_FAULTS:
        assert f"fault {name} at step " in text
    assert text.count("    detected: [") == len(runner.CB_FAULTS)


def test_public_names_load_on_first_access():
    import kvcanary.canary
    import kvcanary.layout

    assert kvcanary.Canary is kvcanary.canary.Canary and kvcanary.KvLayout is kvcanary.layout.KvLayout
    assert all(getattr(kvcanary, name) is not None for name in kvcanary.__all__)
    assert set(kvcanary.__all__) <= set(dir(kvcanary))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvcanary.nope  # noqa: B018


@pytest.mark.parametrize("var, value, message", [
    ("KVCANARY_MODE", "bogus", "KVCANARY_MODE: expected one of ('off', 'log', 'raise', 'quarantine', 'repair'), got 'bogus'"),
    ("KVCANARY_RING_CAPACITY", "x", "KVCANARY_RING_CAPACITY: expected an integer, got 'x'"),
    ("KVCANARY_RING_CAPACITY", "0", "KVCANARY_RING_CAPACITY: expected >= 1, got 0"),
    ("KVCANARY_VALIDATE", "maybe", "KVCANARY_VALIDATE: expected one of 1/0/true/false/yes/no/on/off, got 'maybe'"),
])
@pytest.mark.parametrize("argv", [["demo"], ["demo", "--engine", "scripted"], ["selftest", "--soak", "0"]])
def test_a_bad_kvcanary_value_is_a_usage_error(argv, var, value, message, monkeypatch, capsys):
    monkeypatch.setenv(var, value)
    assert main(argv) == 2  # said up front: nothing is built or run
    said = capsys.readouterr()
    assert said.err.strip() == f"kvcanary {argv[0]}: {message}" and said.out == ""


def test_a_scripted_pool_too_small_for_the_workload_is_a_usage_error(capsys):
    assert main(["demo", "--engine", "scripted", "--blocks", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvcanary demo: --blocks: expected at least 6 (the workload's longest request holds up to 46 tokens, "
        "6 blocks of 8 slots), got 1")
    assert main(["demo", "--engine", "scripted", "--blocks", "6", "--requests", "6", "--json"]) == 0  # the smallest runs
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["finished"] > 0


def test_the_demo_times_the_one_time_setup_apart(capsys):
    assert main(["demo", "--engine", "scripted", "--requests", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["setup_s"] >= 0 and out["wall_s"] >= 0
