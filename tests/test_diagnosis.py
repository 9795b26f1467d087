"""Diagnosis in words: each rule of :mod:`kvcanary.diagnosis` names the class of the fault that
:mod:`kvcanary.faults` injects, with its evidence, every request that read the bad slots and the
slot's last writer; the JSONL log and the log line carry it."""

import collections
import logging

import pytest
import torch

from kvcanary import Canary, CanaryConfig, eventlog
from kvcanary.diagnosis import RULES, annotate
from kvcanary.engines.transformers import cb_configs, protect, tiny_model
from kvcanary.faults import runner
from kvcanary.faults.catalog import CATALOG
from kvcanary.faults.transformers_cb import CbFault
from kvcanary.violations import events

from factories import paged_layout, random_step
from test_transformers import prompts

BY_NAME = {f.name: f for f in CATALOG}


@pytest.mark.parametrize("fault,seed,kind", [
    ("bit_flip", 0, "bytes_changed"), ("byte_smash", 1, "bytes_changed"), ("burst_16b", 2, "bytes_changed"),
    ("slot_reused_while_referenced", 0, "slot_reused"), ("table_shift", 2, "table_shifted"),
    ("prefix_cache_recycled_block", 0, "foreign_slot"), ("wrong_position", 0, "write_position"),
    ("wrong_input_token", 0, "write_input"), ("transfer_lands_nothing", 0, "transfer"), ("torn_offload", 1, "transfer"),
    ("padding_write_into_reserved", 0, "padding_write"), ("padding_slot_wraps_to_live_kv", 1, "padding_write"),
    ("padding_token_writes_live_slot", 2, "padding_write"), ("cold_bytes_then_prefix_hit", 0, "bytes_changed"),
    ("cold_bytes_never_read", 1, "bytes_changed"),
])
def test_scripted_faults_get_their_class(fault, seed, kind):
    r = runner.run_scripted(BY_NAME[fault], seed)
    assert r.detected and r.diagnosis == kind, (r.diagnosis, r.first)


def test_a_read_of_a_never_written_slot():
    import random

    rng = random.Random(1)
    c = Canary(64 * 4, paged_layout(64, 4), CanaryConfig(mode="log"))
    step, _ = random_step(rng, 64 * 4, 4, [(9, 1), (6, 1)])
    c.before_forward(step)  # nothing was ever written: every read is EMPTY
    evs = annotate(events(c.drain()), c.writer_of)
    assert evs and {e.diagnosis.kind for e in evs} == {"never_written"}
    assert "no write" in evs[0].diagnosis.evidence


@pytest.fixture(scope="module")
def llama():
    return tiny_model(seed=0, layers=2)


@pytest.mark.parametrize("fault,kind", [("flip_shared_byte", "bytes_changed"), ("redirect_table_entry", "foreign_slot"),
                                        ("free_shared_block", "slot_reused"), ("flip_cold_byte", "bytes_changed")])
def test_transformers_faults_get_their_class_in_the_log_with_readers_and_writers(llama, tmp_path, fault, kind):
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    log = str(tmp_path / "v.jsonl")
    f = CbFault(fault, at=3 if fault != "flip_cold_byte" else 8, seed=1)
    ps = prompts(24, seed=6) if fault != "flip_cold_byte" else [p[: 10 + 3 * i] for i, p in enumerate(prompts(24, seed=3))]
    gen, cbc = cb_configs(max_new_tokens=12 if fault != "flip_cold_byte" else 24, num_blocks=128)
    cfg = CanaryConfig(mode="log", content_budget_bytes=None, violations_log=log, patrol_budget_bytes=128 << 10)
    with torch.inference_mode(), protect(llama, cfg) as guard:
        guard.hooks.append(f)
        llama.generate_batch(ps, generation_config=gen, continuous_batching_config=cbc)
    assert f.injected_at is not None
    evs = [e for e in eventlog.read(log) if e["step"] >= f.injected_at]
    kinds = collections.Counter(e["diagnosis"]["kind"] for e in evs)
    assert kinds.most_common(1)[0][0] == kind, kinds
    first = next(e for e in evs if e["diagnosis"]["kind"] == kind)
    d = first["diagnosis"]
    assert d["evidence"] and d["text"] and d["writers"]  # the bad slots' last writer, by request and step
    if first["site"] == "verify":
        # every request that read the bad slot in that drain, not only the event's own
        same = {e["request"] for e in evs if e["step"] == first["step"] and
                {v["slot"] for v in e["violations"]} & {v["slot"] for v in first["violations"]}}
        assert set(d["readers"]) >= same and first["request"] in d["readers"]
    assert "likely " + kind in first["summary"]


def test_every_rule_has_a_test_that_drives_it_and_a_failing_diagnosis_never_hides_a_report(monkeypatch):
    covered = {"bytes_changed", "slot_reused", "table_shifted", "foreign_slot", "write_position", "write_input",
               "transfer", "never_written", "padding_write", "cache_write", "kernel_read"}
    assert {k for k, _, _ in RULES} == covered
    import kvcanary.reporting as cm

    def boom(*a, **k):
        raise RuntimeError("diagnosis broke")

    monkeypatch.setattr(cm, "annotate", boom)
    import random

    c = Canary(64 * 4, paged_layout(64, 4), CanaryConfig(mode="log"))
    step, _ = random_step(random.Random(2), 64 * 4, 4, [(9, 1)])
    c.before_forward(step)
    assert c.poll() and c.internal_errors == 0  # reported undiagnosed, not lost


def test_the_audits_reports_are_diagnosed_as_a_cache_write_or_a_kernel_read():
    """The write check's and the read audit's records (kvcanary.audit) get their own classes, with
    the layer, the head, the error against its tolerance and the page shift that explains it."""
    from kvcanary.diagnosis import explain
    from kvcanary.violations import Check, Site, Violation, events

    write = Violation(Site.WRITE, Check.WRITE_CONTENT, 5, 1, 40, 7, 0, 3, -1, 0, 0, 0, 0, 2, request="r1")
    d = explain(events([write])[0])
    assert d.kind == "cache_write" and "layer(s) 2" in d.evidence and "slot 40" in d.evidence
    assert "K and V bytes than the model computed" in write.describe()
    read = Violation(Site.AUDIT, Check.ATTENTION, 5, 1, 40, 7, 3, -1, 1, 1000, 187000, 0, 0, 0, request="r1")
    d = explain(events([read])[0])
    assert d.kind == "kernel_read" and "layer 0 head 3" in d.evidence and "0.187" in d.evidence
    assert "1 page(s) on" in d.evidence and "1 block(s) on explains it" in read.describe()
