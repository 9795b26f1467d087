"""``kvcanary selftest`` where vLLM is installed: a row per vLLM fault (each run in its own vLLM
process on a tiny random Llama), detected within its deadline by the checks that fit it; ``--no-vllm``
leaves the rows out."""

import json
import subprocess
import sys

import pytest

SELFTEST = ["selftest", "--no-transformers", "--seeds", "1", "--soak", "0", "--json"]
# fault -> the checks that may fire for it
VLLM_FAULTS = {
    "flip_v": {"CONTENT"},
    "redirect": {"POSITION", "LINK", "TOKEN", "EMPTY"},
    "reuse": {"POSITION", "LINK", "TOKEN", "EMPTY", "CONTENT"},
    "zero": {"CONTENT"},
    "flip_k": {"CONTENT"},
    "flip_first_read": {"CONTENT"},
    "write_null_block": {"CONTENT"},
    "keep_rejected_drafts": {"EMPTY", "POSITION", "LINK", "TOKEN"},
    "rollback_one_short": {"EMPTY", "POSITION", "LINK", "TOKEN"},
    # the model forward's positions shifted for one request: the stamp check against its cached length
    "position_shift": {"WRITE_INPUT_POSITION", "WRITE_POSITION"},
    # inside the first layer's attention (kvcanary.audit): found with the audit, missed without it
    "kernel_read_next_page": {"ATTENTION"},
    "kernel_write_zeros": {"WRITE_CONTENT"},
    "kernel_scale_of_one": {"ATTENTION"},
}
AUDIT_FAULTS = {"kernel_read_next_page", "kernel_write_zeros", "kernel_scale_of_one"}
# fault -> where its first detection must come from
SITES = {"flip_first_read": "[first_read step", "write_null_block": "[guard step"}


def selftest(*extra):
    p = subprocess.run([sys.executable, "-m", "kvcanary", *SELFTEST, *extra], capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode in (0, 1) and p.stdout.strip(), p.stderr[-4000:]
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def matrix():
    return selftest()


def test_selftest_has_a_vllm_row_per_fault_and_passes(matrix):
    code, out = matrix
    assert [r["fault"] for r in out["matrix"] if r["engine"] == "vllm"] == list(VLLM_FAULTS)
    assert code == 0 and out["ok"], [r for r in out["matrix"] if r["status"] == "FAIL"]


@pytest.mark.parametrize("fault", list(VLLM_FAULTS))
def test_selftest_vllm_fault_is_detected_in_time(matrix, fault):
    row = next(r for r in matrix[1]["matrix"] if r["engine"] == "vllm" and r["fault"] == fault)
    assert row["status"] == "ok" and row["runs"] == row["detected"] == 1, row["failures"]
    assert row["checks_fired"] and set(row["checks_fired"]) <= VLLM_FAULTS[fault], row
    assert 1 <= row["forwards_max"] <= row["deadline"], row
    assert row["harmful_tokens_max"] is not None  # log mode: the tokens sampled from corrupted KV, counted
    if fault in SITES:  # the first-read check (no content window, no patrol) and the null block's guard
        assert all(SITES[fault] in (f or "") for f in row["first_detections"]), row
    # the audit's faults run again without the write check and read audit, where nothing is found
    assert row["missed_without_audit"] == (1 if fault in AUDIT_FAULTS else None), row


@pytest.mark.parametrize("fault", [f for f in VLLM_FAULTS if f != "write_null_block"])
def test_selftest_vllm_fault_names_the_request_it_hurt(matrix, fault):
    """Each injected fault is reported with the request whose read it hurt (a reader of the corrupted
    block, or the request whose table was redirected), and at the slot it corrupted."""
    row = next(r for r in matrix[1]["matrix"] if r["engine"] == "vllm" and r["fault"] == fault)
    (detail,) = row["details"]
    hurt = set(detail["hurt"])
    assert hurt, detail
    if "readers" in detail:
        assert hurt & set(detail["readers"]), detail
    elif "request" in detail:
        assert detail["request"] in hurt, detail
    if "slot" in detail:
        assert detail["slot"] in detail["hit_slots"], detail


def test_selftest_no_vllm_leaves_the_vllm_rows_out():
    code, out = selftest("--no-vllm")
    assert code == 0 and out["ok"]
    assert not [r for r in out["matrix"] if r["engine"] == "vllm"]
