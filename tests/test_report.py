"""``kvcanary report``: a real faulted run's JSONL violation log read back as a summary (kinds,
requests to retry, steps, slots), as JSON, and as an HTML page with the two pictures."""

import json
import logging
import re

import pytest
import torch

from kvcanary import CanaryConfig, cli
from kvcanary.engines.transformers import cb_configs, protect, tiny_model
from kvcanary.faults.transformers_cb import CbFault

from test_transformers import prompts


@pytest.fixture(scope="module")
def faulted_log(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("report") / "violations.jsonl")
    model = tiny_model(seed=0, layers=2)
    gen, cbc = cb_configs(max_new_tokens=12)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    faults = [CbFault("flip_shared_byte", at=3, seed=1), CbFault("redirect_table_entry", at=5, seed=2)]
    try:
        with torch.inference_mode(), protect(model, CanaryConfig(mode="log", content_budget_bytes=None,
                                                                 violations_log=log)) as guard:
            guard.hooks.extend(faults)
            model.generate_batch(prompts(16, seed=6), generation_config=gen, continuous_batching_config=cbc)
    finally:
        logging.getLogger("kvcanary").setLevel(logging.WARNING)
    assert guard.violations and all(f.injected_at is not None for f in faults)
    return log, guard


def test_the_summary_names_the_kinds_the_requests_and_the_steps(faulted_log, capsys):
    log, guard = faulted_log
    assert cli.main(["report", log, "--json"]) == 1  # the log holds violations
    out = json.loads(capsys.readouterr().out)
    hurt = {guard.request_of(v) for v in guard.violations} - {None}
    assert set(out["requests"]) == hurt and hurt
    kinds = {k["kind"] for k in out["kinds"]}
    assert any(k.startswith("bytes_changed (verify: ") and "CONTENT" in k for k in kinds)  # the flipped byte
    assert any(k.startswith("foreign_slot") and ("LINK" in k or "POSITION" in k) for k in kinds)  # the redirect
    assert sum(k["events"] for k in out["kinds"]) == out["events"] > 0
    steps = [v.step for v in guard.violations]
    assert min(k["first_step"] for k in out["kinds"]) == min(steps)
    assert max(k["last_step"] for k in out["kinds"]) == max(steps)
    assert cli.main(["report", log]) == 1
    text = capsys.readouterr().out
    assert "violation event(s)" in text and "Requests hurt (retry them)" in text
    assert all(r in text for r in hurt)


def test_the_html_page_has_both_pictures_and_the_tables(faulted_log, tmp_path, capsys):
    log, guard = faulted_log
    page = tmp_path / "report.html"
    assert cli.main(["report", log, "--html", str(page)]) == 1
    body = page.read_text()
    assert body.startswith("<!doctype html>") and body.count("<svg") == 2
    assert len(re.findall(r"<rect ", body)) >= 2 and "Violations over the slot space" in body
    assert all(guard.request_of(v) in body for v in guard.violations if guard.request_of(v))


def test_an_empty_log_reports_nothing_and_an_unreadable_one_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli.main(["report", str(empty)]) == 0
    assert "no violations in the log" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert cli.main(["report", str(bad)]) == 2
    said = capsys.readouterr().out
    assert "cannot read" in said and "bad.jsonl" in said
    assert cli.main(["report", str(tmp_path / "missing.jsonl")]) == 2
