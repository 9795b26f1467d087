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
    said = capsys.readouterr().err
    assert "cannot read" in said and "bad.jsonl" in said and "line 1" in said
    assert cli.main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


GOOD = '{"site": "verify", "step": 3, "checks": ["CONTENT"], "violations": [{"slot": 40, "step": 3}]}'


@pytest.mark.parametrize("line, expected", [
    ("[1,2,3]", "expected a JSON object (one violation event), got [1, 2, 3]"),
    ("null", "expected a JSON object (one violation event), got null"),
    ('{"step": "abc"}', "expected a violation event with fields site, step, checks, violations, got an object "
                        "without site, checks, violations"),
    ('{"violations": [1, 2]}', "got an object without site, step, checks"),
    ('{"foo": 1}', "got an object without site, step, checks, violations (fields: foo)"),
    ('{"site": "verify", "step": "abc", "checks": [], "violations": []}', 'step: expected an integer, got "abc"'),
    ('{"site": "verify", "step": true, "checks": [], "violations": []}', "step: expected an integer, got true"),
    ('{"site": "verify", "step": 1, "checks": [], "violations": [1, 2]}',
     "violations[0]: expected an object (one slot record), got 1"),
    ('{"site": "verify", "step": 1, "checks": [7], "violations": []}', "checks: expected a list of check names"),
    ('{"site": "verify", "step": 1, "checks": [], "violations": [], "diagnosis": 5}',
     "diagnosis: expected an object or null, got 5"),
    ("{not json", "expected a JSON object (one violation event), got text that is not JSON"),
])
def test_a_line_that_is_not_an_event_is_refused_with_its_file_and_line(line, expected, tmp_path, capsys):
    log = tmp_path / "odd.jsonl"
    log.write_text(GOOD + "\n\n" + line + "\n")
    assert cli.main(["report", str(log)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing printed before the refusal
    assert f"kvcanary report: cannot read {str(log)!r} as a JSONL violation log: line 3: " in err
    assert expected in err


def test_an_event_line_with_only_the_needed_fields_is_read(tmp_path, capsys):
    log = tmp_path / "min.jsonl"
    log.write_text(GOOD + "\n")
    assert cli.main(["report", str(log), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["events"] == 1


@pytest.mark.parametrize("where, expected", [
    ("missing/out.html", "expected an existing directory to write the page in, got {d!r}, which does not exist"),
    (".", "expected a file to write the page to, got a directory"),
])
def test_an_html_page_that_cannot_be_written_is_refused_before_the_summary(where, expected, tmp_path, capsys):
    log = tmp_path / "v.jsonl"
    log.write_text(GOOD + "\n")
    out = str(tmp_path / where)
    assert cli.main(["report", str(log), "--html", out]) == 2
    said = capsys.readouterr()
    assert said.out == ""
    assert said.err.strip() == f"kvcanary report: --html {out}: " + expected.format(d=str(tmp_path / "missing"))
