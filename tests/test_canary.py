"""Modes, reporting, the ring's overflow accounting, release, counters, configuration."""

import logging
import os
import random
import subprocess
import sys

import pytest
import torch

import kvcanary
from kvcanary import Canary, CanaryConfig, Check, ConfigError, KvCorruptionError, StepError, UnsupportedError
from kvcanary import checks
from kvcanary.violations import NUM_FIELDS, ViolationRing

from factories import paged_layout, prefill_of, random_step

NB, BS = 16, 4


def primed(mode, **cfg):
    rng = random.Random(5)
    layout = paged_layout(NB, BS, seed=5)
    c = Canary(NB * BS, layout, CanaryConfig(mode=mode, **cfg))
    step, stoks = random_step(rng, NB * BS, BS, [(6, 1), (9, 1)])
    c.after_forward(prefill_of(step, stoks))
    return c, step, layout


def test_raise_mode_raises_structured_error():
    c, step, layout = primed("raise")
    layout.sources[0].slot_bytes(int(step.lookup(torch.tensor([1]), torch.tensor([4]))[0]))[0, -1] ^= 0xFF
    c.before_forward(step)
    with pytest.raises(KvCorruptionError) as ei:
        c.poll()
    v = ei.value.first
    assert v.checks == Check.CONTENT and v.row == 1 and v.position == 4
    assert "CONTENT" in str(ei.value) and "row 1" in str(ei.value)
    assert v.to_dict()["checks"] == ["CONTENT"]


def test_log_mode_logs_and_never_raises(caplog):
    c, step, _ = primed("log")
    c.stamps[int(step.lookup(torch.tensor([0]), torch.tensor([2]))[0]), 1] = 77
    with caplog.at_level(logging.WARNING, "kvcanary"):
        c.before_forward(step)
        v = c.poll()
    assert len(v) == 1 and Check.POSITION in v[0].checks
    assert "POSITION" in caplog.text
    bad = random_step(random.Random(1), NB * BS, BS, [(3, 1)])[0]
    bad.new_slots[0] = 10**6  # an invalid step: counted as an internal error, not raised
    c.after_forward(bad)
    c.before_forward("not a step")  # type: ignore[arg-type]
    assert c.stats()["internal_errors"] == 2


def test_raise_mode_raises_internal_errors():
    c, _, _ = primed("raise")
    bad = random_step(random.Random(1), NB * BS, BS, [(3, 1)])[0]
    bad.new_slots[0] = 10**6
    with pytest.raises(StepError):
        c.after_forward(bad)


def test_off_mode_does_nothing():
    c, step, layout = primed("off")
    layout.sources[0].tensor.view(-1)[:] ^= 1
    c.before_forward(step)
    c.after_forward(step)
    assert c.poll() == [] and c.stats()["slots_verified"] == 0 and c.stats()["slots_stamped"] == 0


def test_ring_overflow_is_counted_not_lost_silently():
    ring = ViolationRing(4, torch.device("cpu"))
    rows = torch.zeros(10, NUM_FIELDS, dtype=torch.int64)
    rows[:, 2] = torch.arange(10)  # step field tells the rows apart
    ring.append(rows[:3])
    ring.append(rows[3:])
    got = ring.drain()
    assert [v.step for v in got] == [6, 7, 8, 9] and ring.lost == 6
    ring.append(rows[:2])
    assert [v.step for v in ring.drain()] == [0, 1] and ring.lost == 6


def test_poll_reports_lost_rows():
    c, step, _ = primed("raise", ring_capacity=2)
    c.stamps[:, 2] ^= 1  # every link broken
    c.before_forward(step)
    with pytest.raises(KvCorruptionError, match="lost to ring overflow") as ei:
        c.poll()
    assert len(ei.value.violations) == 2 and ei.value.lost == 13
    assert c.stats()["violations"] == 15 and c.stats()["violations_lost"] == 13


def test_release_makes_reads_empty():
    c, step, _ = primed("log")
    s = step.lookup(torch.tensor([0]), torch.tensor([3]))
    c.release(s)
    c.before_forward(step)
    v = c.poll()
    assert [(x.checks, x.position) for x in v if x.row == 0][0] == (Check.EMPTY, 3)


@pytest.mark.parametrize("backend", ["fused", "torch"])
def test_release_blocks_empties_every_slot_of_the_blocks_and_no_other(backend):
    c, step, _ = primed("log", backend=backend)
    before = c.stamps.clone()
    c.release_blocks([3, 1, 3], BS)  # a block twice: the same as once
    for b in range(NB):
        got = c.stamps[b * BS:(b + 1) * BS]
        want = torch.tensor(checks.EMPTY_STAMP).expand(BS, 4) if b in (1, 3) else before[b * BS:(b + 1) * BS]
        assert torch.equal(got, want), b
    c.release_blocks([], BS)  # nothing freed: nothing done
    assert c.stats()["internal_errors"] == 0


@pytest.mark.parametrize("blocks,bs,bad", [([NB], BS, f"got {NB}"), ([-1], BS, "got -1"), ([0], 3, "got 3")])
def test_release_blocks_names_a_bad_block_or_block_size(blocks, bs, bad):
    c, _, _ = primed("raise")
    with pytest.raises(kvcanary.KvCanaryError, match=bad):
        c.release_blocks(blocks, bs)


def test_callbacks_receive_violations():
    got = []
    rng = random.Random(5)
    c = Canary(NB * BS, paged_layout(NB, BS), CanaryConfig(mode="log"), on_violation=[got.extend])
    step, _ = random_step(rng, NB * BS, BS, [(6, 1)])
    c.before_forward(step)  # nothing stamped yet: every read is EMPTY
    c.poll()
    assert len(got) == 6 and all(v.checks == Check.EMPTY for v in got)


def test_counters():
    c, step, layout = primed("raise", content_budget_bytes=None)
    c.before_forward(step)
    c.after_forward(step)
    s = c.stats()
    assert s["slots_verified"] == 15 and s["slots_stamped"] == 15 + 2 and s["steps"] == 2
    assert s["content_bytes_verified"] == 15 * layout.content_bytes_per_slot
    assert s["content_bytes_stamped"] == 17 * layout.content_bytes_per_slot


def test_metadata_only_content_none():
    c, step, layout = primed("raise", content="none")
    layout.sources[0].tensor.view(-1)[:] ^= 1
    c.before_forward(step)
    assert c.poll() == [] and c.stats()["content_bytes_verified"] == 0


def test_config_errors():
    with pytest.raises(ConfigError, match="mode: expected one of .*, got 'loud'"):
        CanaryConfig(mode="loud")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ring_capacity: expected >= 1, got 0"):
        CanaryConfig(ring_capacity=0)
    with pytest.raises(ConfigError, match="less than one slot's 64 content bytes"):
        Canary(NB * BS, paged_layout(NB, BS), CanaryConfig(content_budget_bytes=10))
    with pytest.raises(ConfigError, match="num_slots: expected an integer in 1 .*, got 0"):
        Canary(0)
    with pytest.raises(UnsupportedError, match="device: expected cpu or cuda, got meta"):
        Canary(4, device="meta")


def test_config_from_env():
    cfg = CanaryConfig.from_env(environ={"KVCANARY_MODE": "raise", "KVCANARY_CONTENT_BUDGET_BYTES": "none",
                                         "KVCANARY_VALIDATE": "0", "KVCANARY_RING_CAPACITY": "64"})
    assert (cfg.mode, cfg.content_budget_bytes, cfg.validate, cfg.ring_capacity) == ("raise", None, False, 64)
    with pytest.raises(ConfigError, match="KVCANARY_RING_CAPACITY: expected an integer, got 'many'"):
        CanaryConfig.from_env(environ={"KVCANARY_RING_CAPACITY": "many"})


def test_env_table_listed_in_readme():
    from pathlib import Path

    from kvcanary.config import ENV

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for var in ENV:
        assert f"`{var}`" in readme, var


def test_public_surface_is_pinned():
    assert sorted(kvcanary.__all__) == [
        "ByteSource", "Canary", "CanaryConfig", "Check", "ConfigError", "KvCanaryError", "KvCorruptionError",
        "KvLayout", "LayoutError", "Site", "Step", "StepError", "UnsupportedError", "Violation",
    ]


def test_cpu_path_never_imports_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import kvcanary\n"
        "from kvcanary.cli import main\n"
        "assert main(['demo', '--engine', 'scripted', '--requests', '4', '--json']) == 0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_violations_log_gets_one_json_line_per_event(tmp_path):
    from kvcanary import eventlog

    path = str(tmp_path / "v.jsonl")
    c, step, layout = primed("log", violations_log=path)
    for pos in (2, 3):  # two slots of row 0 in one step: one event
        c.stamps[int(step.lookup(torch.tensor([0]), torch.tensor([pos]))[0]), 1] = 77
    c.before_forward(step)
    found = c.poll()
    lines = eventlog.read(path)
    assert len(found) >= 2 and len(lines) == 1
    ev = lines[0]
    assert ev["site"] == "verify" and ev["row"] == 0 and "POSITION" in ev["checks"] and ev["slots"] == len(found)
    assert [v["slot"] for v in ev["violations"]] == [v.slot for v in found] and ev["engine"] == "canary"
    assert CanaryConfig.from_env(environ={"KVCANARY_VIOLATIONS_LOG": path}).violations_log == path


def test_the_patrol_walks_its_budget_per_call_and_states_its_pass_length():
    from kvcanary import ConfigError
    from kvcanary.violations import Counter

    from factories import paged_layout

    layout = paged_layout(16, 8, row=64, nsrc=2)  # 128 slots of 128 content bytes
    assert Canary(128, layout, CanaryConfig(patrol_budget_bytes=128 * 10)).stats()["patrol_pass_steps"] == 13
    c = Canary(128, layout, CanaryConfig(mode="raise", patrol_budget_bytes=128 * 16))
    assert c.patrol_slots == 16 and c.stats()["patrol_pass_steps"] == 8
    stamped = torch.arange(0, 128, 2)
    c.stamps[stamped, 1] = 0  # half the pool stamped (contents 0 differ from the bytes: all bad)
    for _ in range(8):
        c.patrol()
    assert c.scrub_passes == 1 and int(c.ring.counters[Counter.SLOTS_SCRUBBED]) == 64
    with pytest.raises(KvCorruptionError) as e:
        c.poll()
    assert len(e.value.violations) == 64  # every stamped slot re-verified once in the pass
    assert Canary(128, layout, CanaryConfig(patrol_budget_bytes=0)).stats()["patrol_pass_steps"] == 0
    assert Canary(128, config=CanaryConfig()).patrol_slots == 0  # metadata only: nothing to re-read
    with pytest.raises(ConfigError, match="patrol_budget_bytes: expected an integer >= 0 or 'auto', got int -1"):
        CanaryConfig(patrol_budget_bytes=-1)


# ---- violation sinks that fail in raise mode ------------------------------------------------------

def _flipped(mode, **cfg):
    """A primed canary with one flipped byte a verify finds, and the step that reads it."""
    c, step, layout = primed(mode, **cfg)
    layout.sources[0].slot_bytes(int(step.lookup(torch.tensor([1]), torch.tensor([4]))[0]))[0, -1] ^= 0xFF
    return c, step


def _boom(found):
    raise RuntimeError("callback down")


@pytest.mark.parametrize("sink", ["callback", "log_is_a_directory", "log_unwritable"])
def test_a_failing_sink_still_raises_the_corruption_error_and_the_other_sinks_run(sink, tmp_path, caplog):
    got = []
    log_path = str(tmp_path / "v.jsonl")
    if sink == "log_unwritable":
        log_path = str(tmp_path / "missing" / "v.jsonl")
        os.mkdir(tmp_path / "missing")
    callbacks = [_boom, got.extend] if sink == "callback" else [got.extend]
    c, step = _flipped("raise", violations_log=log_path)
    # the config refuses such paths up front: here they break after it was made
    if sink == "log_is_a_directory":
        os.mkdir(log_path)
    elif sink == "log_unwritable":
        os.rmdir(tmp_path / "missing")
    c.callbacks = callbacks
    c.before_forward(step)
    with caplog.at_level(logging.ERROR, "kvcanary"), pytest.raises(KvCorruptionError) as ei:
        c.poll()
    err = ei.value
    assert err.first is not None and err.first.checks == Check.CONTENT
    assert got == err.violations  # the callback after the failing sink ran
    want = RuntimeError if sink == "callback" else OSError
    assert len(err.sink_errors) == 1 and isinstance(err.sink_errors[0], want)
    assert err.__cause__ is err.sink_errors[0] and "1 violation sink(s) failed" in str(err)
    assert "attached to the KvCorruptionError" in caplog.text
    if sink == "callback":
        assert len(open(log_path).read().splitlines()) == 1  # the log before it was written


def test_a_failing_sink_in_log_mode_is_counted():
    c, step = _flipped("log")
    c.callbacks = [_boom]
    c.before_forward(step)
    assert c.poll() and c.stats()["internal_errors"] == 1


def test_an_adapters_failing_sink_still_raises_and_leaves_the_error_pending(tmp_path):
    from kvcanary.engines.base import Adapter

    c, step = _flipped("raise")
    c.before_forward(step)
    found = c.drain()
    log = tmp_path / "violations.jsonl"
    adapter = Adapter(CanaryConfig(mode="raise", violations_log=str(log)), on_violation=_boom)
    log.mkdir()  # the log's path turned into a directory after the config was checked: the sink fails
    with pytest.raises(KvCorruptionError) as ei:
        adapter.report(found)
    assert adapter.pending is ei.value and adapter.violations == found
    assert [type(e) for e in ei.value.sink_errors] == [IsADirectoryError, RuntimeError]


# ---- unknown KVCANARY_* names ---------------------------------------------------------------------

def test_an_unknown_kvcanary_variable_is_warned_once_with_the_closest_name(caplog, monkeypatch):
    from kvcanary import config

    monkeypatch.setattr(config, "_warned", set())
    env = {"KVCANARY_MOD": "raise", "KVCANARY_XYZZY_QUUX": "1", "KVCANARY_CACHE_DIR": "/tmp/x",
           "KVCANARY_STAMP_STORE": "/tmp/s", "KVCANARY_TEST_FAULT": "flip_v", "KVCANARY_TEST_FAULT_AT": "3",
           "OTHER": "1"}
    with caplog.at_level(logging.WARNING, "kvcanary"):
        assert CanaryConfig.from_env(environ=env).mode == "log"  # ignored, but said
        CanaryConfig.from_env(environ=env)  # once per process and name
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "kvcanary: KVCANARY_MOD is not a kvcanary variable and is ignored; did you mean KVCANARY_MODE?",
        "kvcanary: KVCANARY_XYZZY_QUUX is not a kvcanary variable and is ignored; expected one of "
        + ", ".join([*config.ENV, *config.OTHER_ENV]),
    ]


def test_every_kvcanary_variable_the_code_reads_is_declared():
    import re
    from pathlib import Path

    from kvcanary.config import ENV, OTHER_ENV

    root = Path(__file__).parents[1]
    files = [*root.glob("src/kvcanary/**/*.py"), *root.glob("tests_vllm/**/*.py"), *root.glob("bench/*.py")]
    read = {m for f in files for m in re.findall(r"[\"'](KVCANARY_[A-Z0-9_]*[A-Z0-9])[\"']", f.read_text())}
    assert {"KVCANARY_MODE", "KVCANARY_STAMP_STORE", "KVCANARY_TEST_FAULT_AT"} <= read  # the pattern finds them
    assert read <= set(ENV) | set(OTHER_ENV), read - set(ENV) - set(OTHER_ENV)
