"""``kvcanary report``: a real faulted run's JSONL violation log read back as a summary (kinds,
requests to retry, steps, slots), as JSON, and as an HTML page with the two pictures."""

import gzip
import json
import logging
import re
import socket

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
def test_a_line_that_is_not_an_event_is_skipped_counted_and_named_by_number(line, expected, tmp_path, capsys):
    log = tmp_path / "odd.jsonl"
    log.write_text(GOOD + "\n\n" + line + "\n")
    assert cli.main(["report", str(log), "--json"]) == 5  # violations (1), and a line skipped (4)
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert got["events"] == 1 and got["skipped_lines"] == 1 and got["lines"] == 2
    assert got["skipped"][0]["line"] == 3 and expected in got["skipped"][0]["reason"]
    assert err.startswith(f"kvcanary report: {log}: skipped 1 of 2 line(s) that are not violation events (line 3: ")
    assert expected in err


def test_a_file_without_one_violation_event_is_refused_naming_its_first_line(tmp_path, capsys):
    log = tmp_path / "notes.txt"
    log.write_text("hello\n[1, 2]\n")
    assert cli.main(["report", str(log)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing printed before the refusal
    assert err.strip() == (f"kvcanary report: cannot read {str(log)!r} as a JSONL violation log: line 1: expected a "
                           f"JSON object (one violation event), got text that is not JSON (Expecting value: line 1 "
                           f"column 1 (char 0)) (none of its 2 line(s) is a violation event)")


def _event(step, request, t, pid, slot=40, host="node-1"):
    return json.dumps({"time": t, "pid": pid, "host": host, "engine": "vllm", "rank": 0, "group": "full",
                       "site": "verify", "step": step, "request": request, "checks": ["CONTENT"],
                       "summary": f"[verify step {step}] {request}", "violations": [{"slot": slot, "step": step}]})


T0 = 1767323471.25  # 2026-01-02 03:11:11.250 UTC


def test_a_log_a_crash_left_torn_is_read_past_the_damage(tmp_path, capsys):
    lines = [_event(3, "a", T0, 11), _event(4, "b", T0 + 1, 11)]
    torn = _event(5, "c", T0 + 2, 11)[:37]  # the process died mid-write; the next one appends to the fragment
    lines += [torn + _event(1, "d", T0 + 30, 12), "\x00" * 12, _event(2, "e", T0 + 31, 12), _event(6, "f", T0 + 3, 11)[:50]]
    log = tmp_path / "crashed.jsonl"
    log.write_text("\n".join(lines))  # the last line torn too, without its newline
    assert cli.main(["report", str(log), "--json"]) == 5
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert set(got["requests"]) == {"a", "b", "d", "e"}  # d came after the torn start of c, on its line
    assert [(b["line"], b["reason"].split(", got ")[1][:12]) for b in got["skipped"]] == [
        (3, "a torn one: "), (4, "12 NUL byte("), (6, "text that is")]
    assert "skipped 3 of 6 line(s)" in err and "line 3: " in err and "line 4: " in err and "line 6: " in err


def test_wall_clock_times_per_request_and_steps_per_process(tmp_path, capsys):
    # two processes, whose step numbers both start again at 1: only the times order them
    log = tmp_path / "fleet.jsonl"
    log.write_text("\n".join([_event(7, "r1", T0, 11), _event(9, "r1", T0 + 65, 11),
                              _event(2, "r2", T0 + 70, 12, host="node-2")]) + "\n")
    assert cli.main(["report", str(log), "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert (got["first_time"], got["last_time"], got["times"]) == (T0, T0 + 70, "UTC")
    assert (got["first_seen"], got["last_seen"]) == ("2026-01-02 03:11:11.250", "2026-01-02 03:12:21.250")
    hurt = {r["request"]: r for r in got["requests_hurt"]}
    assert (hurt["r1"]["first_seen"], hurt["r1"]["last_seen"]) == ("2026-01-02 03:11:11.250", "2026-01-02 03:12:16.250")
    assert hurt["r1"]["steps_by_process"] == {"vllm rank 0 pid 11 on node-1": [7, 9]}
    assert got["kinds"][0]["steps_by_process"] == {"vllm rank 0 pid 11 on node-1": [7, 9],
                                                   "vllm rank 0 pid 12 on node-2": [2, 2]}
    assert "2026-01-02 03:11:11.250 .. 2026-01-02 03:12:21.250 UTC (1 min 10 s)" in got["headline"]
    assert "reported by 2 processes (steps count per process)" in got["headline"] and "steps 2 .. 9" not in got["headline"]
    assert cli.main(["report", str(log)]) == 1
    text = capsys.readouterr().out
    assert "first seen (UTC)" in text and "2026-01-02 03:12:16.250" in text
    assert "step numbers count the forwards of one process and start again in each" in text
    page = tmp_path / "fleet.html"  # the page's tables do not wrap: the steps of each process, by name
    assert cli.main(["report", str(log), "--html", str(page)]) == 1
    body = page.read_text()
    assert "7 .. 9 (vllm rank 0 pid 11 on node-1); 2 .. 2 (vllm rank 0 pid 12 on node-2)" in body
    assert "Violations over time (UTC)" in body and "2026-01-02 03:12:21.250" in body


def test_the_requests_table_says_how_many_more_requests_there_are(tmp_path, capsys):
    log = tmp_path / "many.jsonl"
    log.write_text("\n".join(_event(i, f"req_{i:02d}", T0 + i, 11, slot=i) for i in range(33)) + "\n")
    assert cli.main(["report", str(log)]) == 1
    text = capsys.readouterr().out
    assert "... and 13 more request(s) (--json lists every one)" in text  # 20 shown of 33
    assert "... and 23 more slot(s) (--json lists every one)" in text  # 10 shown of 33
    assert cli.main(["report", str(log), "--json"]) == 1
    assert len(json.loads(capsys.readouterr().out)["requests_hurt"]) == 33


def test_gzip_logs_and_a_byte_order_mark_are_read(faulted_log, tmp_path, capsys):
    log, _ = faulted_log
    assert cli.main(["report", log, "--json"]) == 1
    plain = json.loads(capsys.readouterr().out)
    raw = open(log, "rb").read()
    gz = tmp_path / "violations.jsonl.1.gz"  # as logrotate leaves it
    gz.write_bytes(gzip.compress(raw))
    assert cli.main(["report", str(gz), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["requests_hurt"] == plain["requests_hurt"]
    bom = tmp_path / "bom.jsonl"  # as an editor on another system saves it
    bom.write_bytes(b"\xef\xbb\xbf" + raw)
    assert cli.main(["report", str(bom), "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["events"] == plain["events"] and got["skipped_lines"] == 0
    cut = tmp_path / "cut.jsonl.gz"  # a rotation caught mid-compression
    data = gzip.compress(raw * 4)
    cut.write_bytes(data[: len(data) * 3 // 4])
    code = cli.main(["report", str(cut), "--json"])
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert code == 5 and 0 < got["events"] < 4 * plain["events"], (code, got["events"])
    assert "the compressed file ends before its end marker (cut short)" in got["cut"] and "cut short" in err


def test_the_help_lists_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    out = capsys.readouterr().out
    assert "exit status:" in out and "5 = skipped lines and violations" in out and "gzip" in out


def test_log_lines_say_when_and_where(faulted_log):
    from kvcanary import eventlog

    log, _ = faulted_log
    evs = eventlog.read(log)
    assert all(isinstance(e["time"], float) and e["host"] == socket.gethostname() and e["pid"] > 0 for e in evs)


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
