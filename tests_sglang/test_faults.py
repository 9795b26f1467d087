"""Faults injected into the canary's engine (tests_sglang/control/) are found in the forward they
strike, named by the request that read them; ``raise`` fails that forward's requests in their
callers' threads, ``quarantine`` only the requests that read the corrupted KV. Each fault is undone
after its forward, so the engine the tests share is whole again."""

import pytest

G = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def _prefix(base):
    return list(range(base, base + 24))  # each test its own prefix: no other test reads it


def _struck(canary, before, kind):
    """The fault injected since ``before`` faults were, and the events of the forward it struck."""
    st = canary.state()
    assert not st["errors"], st["errors"]
    faults = [f for f in st["injected"][before:] if f["kind"] == kind]
    assert len(faults) == 1, st["injected"]
    f = faults[0]
    return f, [e for e in canary.events() if e["step"] == f["forward"]]


def _violations(events):
    return [v for e in events for v in e["violations"]]


def test_a_flipped_byte_in_a_shared_prefix_is_found_by_both_readers_in_the_forward_it_strikes(canary):
    p = _prefix(700)
    canary.engine.generate(input_ids=[p + [1, 2]], sampling_params=G)  # the prefix is now in the radix cache
    n = len(canary.state()["injected"])
    canary.command(fault={"kind": "flip", "prefix": p, "position": 5, "layer": 1, "half": "v"})
    outs = canary.engine.generate(input_ids=[p + [3, 4], p + [5, 6]], sampling_params=G)
    assert all(o["meta_info"]["cached_tokens"] >= 24 for o in outs)
    f, events = _struck(canary, n, "flip")
    bad = [v for v in _violations(events) if v["slot"] == f["slot"]]
    assert bad and all("CONTENT" in v["checks"] and v["position"] == 5 for v in bad)
    readers = {o["meta_info"]["id"] for o in outs}
    assert {v["request"] for v in bad if v["site"] == "first_read"} == readers
    assert canary.state()["stats"]["internal_errors"] == 0


def test_a_table_entry_off_by_one_is_found_in_the_forward_it_strikes(canary):
    p = _prefix(760)
    canary.engine.generate(input_ids=[p + [1, 2]], sampling_params=G)
    n = len(canary.state()["injected"])
    canary.command(fault={"kind": "shift", "prefix": p, "position": 7})
    out = canary.engine.generate(input_ids=[p + [9, 9]], sampling_params=G)[0]
    f, events = _struck(canary, n, "shift")
    assert f["rid"] == out["meta_info"]["id"]
    bad = [v for v in _violations(events) if v["position"] == 7 and v["request"] == f["rid"]]
    assert bad and all("POSITION" in v["checks"] for v in bad)
    assert all(v["stored_position"] == 8 for v in bad)  # the entry holds the next position's slot


def test_raise_fails_the_forwards_requests_in_the_callers_thread_and_the_engine_goes_on(canary):
    p = _prefix(820)
    clean = canary.engine.generate(input_ids=[p + [1, 2]], sampling_params=G)[0]["output_ids"]
    n = len(canary.state()["injected"])
    canary.command(mode="raise", fault={"kind": "flip", "prefix": p, "position": 2})
    try:
        with pytest.raises(Exception, match="kvcanary: KvCorruptionError") as err:
            canary.engine.generate(input_ids=[p + [1, 2]], sampling_params=G)
        assert "CONTENT" in str(err.value)
        f, events = _struck(canary, n, "flip")
        assert f["rid"] in canary.state()["failed"]
    finally:
        canary.command(mode="log")
    again = canary.engine.generate(input_ids=[p + [1, 2]], sampling_params=G)[0]
    assert again["output_ids"] == clean and again["meta_info"]["finish_reason"]["type"] == "length"


def test_quarantine_fails_only_the_requests_that_read_corrupted_kv(canary):
    p, other = _prefix(880), list(range(940, 964))
    canary.engine.generate(input_ids=[p + [1, 2]], sampling_params=G)
    clean = canary.engine.generate(input_ids=[other + [5]], sampling_params=G)[0]["output_ids"]
    n = len(canary.state()["injected"])
    canary.command(mode="quarantine", fault={"kind": "flip", "prefix": p, "position": 11})
    try:
        outs = canary.engine.generate(input_ids=[p + [3], other + [5], p + [4]], sampling_params=G)
        f, events = _struck(canary, n, "flip")
        failed = canary.state()["failed"]
    finally:
        canary.command(mode="log")
    readers, bystander = [outs[0], outs[2]], outs[1]
    for o in readers:
        reason = o["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "kvcanary" in reason["message"], reason
        assert o["meta_info"]["id"] in failed
    assert bystander["meta_info"]["finish_reason"]["type"] == "length"
    assert bystander["output_ids"] == clean and bystander["meta_info"]["id"] not in failed


@pytest.mark.parametrize("piece", ["audit", "steps", "stamps"])
def test_a_failure_of_the_canarys_own_never_reaches_the_engine_nor_turns_into_reports(canary, piece):
    """In ``log`` mode, a piece of kvcanary made to fail inside the engine: the outputs are a clean
    run's, the failures are counted, nothing is reported, then or after the piece is mended."""
    import workload

    prompts = [_prefix(300 + 40 * ["audit", "steps", "stamps"].index(piece))[:20] + [5, 6], workload.SHARED[0]]
    clean = [o["output_ids"] for o in canary.engine.generate(input_ids=prompts, sampling_params=G)]
    before = canary.state()["stats"]
    events = len(canary.events())
    canary.command(**{"break": piece})
    try:
        broken = [o["output_ids"] for o in canary.engine.generate(input_ids=prompts, sampling_params=G)]
        st = canary.state()
    finally:
        canary.command(**{"break": None})
    assert st["broken"] == [piece] and not st["errors"]
    assert broken == clean
    assert st["stats"]["internal_errors"] > before["internal_errors"]
    mended = [o["output_ids"] for o in canary.engine.generate(input_ids=prompts, sampling_params=G)]
    after = canary.state()
    assert mended == clean and after["broken"] == []
    assert after["stats"]["violations"] == before["violations"] and len(canary.events()) == events
    assert after["stats"]["internal_errors"] == st["stats"]["internal_errors"]


def test_a_failing_healer_leaves_the_engine_serving(canary):
    """``repair`` with its healing made to fail: the failure is counted and SGLang processes the
    forward's results as it would without the canary (the request is not repaired, nothing hangs)."""
    p = _prefix(420)
    clean = canary.engine.generate(input_ids=[p + [1, 2]], sampling_params=G)[0]["output_ids"]
    before = canary.state()["stats"]
    canary.command(mode="repair", fault={"kind": "flip", "prefix": p, "position": 4, "half": "v", "layer": 1},
                   **{"break": "heal"})
    try:
        out = canary.engine.generate(input_ids=[p + [1, 2]], sampling_params=G)[0]
        st = canary.state()
    finally:
        canary.command(mode="log", **{"break": None})
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == len(clean)
    assert st["stats"]["internal_errors"] > before["internal_errors"] and st["stats"]["repairs"] == before["repairs"]
    again = canary.engine.generate(input_ids=[_prefix(460) + [1]], sampling_params=G)[0]
    assert again["meta_info"]["finish_reason"]["type"] == "length"
