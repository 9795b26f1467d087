"""``kvcanary demo`` on the trained model (the default): the questions and answers in its JSON, the
same without and with the canary; ``--inject``: each fault detected, the requests it hurt with their
clean, served (log mode) and repaired answers, repair serving only clean answers; ``--model PATH`` and
the one-line errors for a missing path and a missing extra."""

import json
import os
import sys

import pytest
from test_real_model import converted_cache

from kvcanary.cli import main
from kvcanary.real_model import QUESTIONS


@pytest.fixture
def cache(monkeypatch):
    root = converted_cache()
    monkeypatch.setenv("KVCANARY_CACHE_DIR", root)
    return root


@pytest.fixture
def no_new_signatures():
    """The test's demo runs with the signatures the warm-up makes (``kvcanary warmup`` compiles them
    ahead of time): a signature more, and the first run on a machine compiles in an engine's forward."""
    from kvcanary import fused

    assert fused.available() is None
    count = lambda: sum(len(d.signatures) for d in fused.loops().values())  # noqa: E731
    before = count()
    yield
    assert count() == before, "the real model's demo used a compiled-loop signature the warm-up does not make"


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_demo_answers_each_question_the_same_without_and_with_the_canary_and_heals_injected_faults(
        cache, capsys, no_new_signatures):
    assert main(["demo", "--inject", "--json", "--max-new-tokens", "16"]) == 0
    out = _json(capsys)
    assert out["model"] == "SmolLM2-135M-Instruct" and out["dtype"] == "bfloat16" and out["model_converted"] is False
    answers = out["answers"]
    assert [a["question"] for a in answers] == list(QUESTIONS)
    assert all(a["identical"] and a["without_canary"] == a["with_canary"] for a in answers)
    assert answers[0]["with_canary"] == "The capital of France is Paris."
    assert out["outputs_identical"] is True and out["violations"] == 0 and out["internal_errors"] == 0
    assert 0 < out["canary_share_pct"] < 100 and out["canary_ms_per_forward"] > 0 and out["slots_verified"] > 0
    clean = {a["question"]: a["without_canary"] for a in answers}
    faults = out["injected"]
    assert [f["fault"] for f in faults] == ["flip_shared_byte", "redirect_table_entry", "free_shared_block"]
    for f in faults:
        assert f["detected"] and "request" in f["first_detection"] and f["requests"], f
        assert f["repair_injected_same"] and not f["changed_undetected"], f
        assert f["repair"]["violations"] > 0 and f["repair"]["internal_errors"] == 0, f
        assert not f["repair"]["served_other_text"], f
        for r in f["requests"]:
            assert r["clean"] == clean[r["question"]], r
            assert r["repair_equals_clean"] or r["repair_failed"], r  # repair serves the clean answer or an error
    # recomputing heals a flipped byte and a redirected table entry: every reader gets the clean answer
    for f in faults[:2]:
        assert f["repair"]["repairs"] >= 1 and f["repair"]["requests_failed"] == 0, f
        assert all(r["repair"] == r["clean"] for r in f["requests"]), f
    assert out["repair_run"]["served_only_clean_answers"] is True
    assert os.path.exists(out["report"]["html"])


def test_a_local_checkpoint_directory_runs_the_same_demo(cache, capsys, no_new_signatures):
    path = os.path.join(cache, "models", "SmolLM2-135M-Instruct-float32")
    assert main(["demo", "--model", path, "--dtype", "float32", "--requests", "2", "--max-new-tokens", "10",
                 "--json"]) == 0
    out = _json(capsys)
    assert out["model"] == "SmolLM2-135M-Instruct-float32" and out["dtype"] == "float32"
    assert [a["with_canary"] for a in out["answers"]][0] == "The capital of France is Paris."
    assert out["outputs_identical"] is True and out["violations"] == 0


def test_a_missing_model_path_is_a_one_line_error(tmp_path, capsys):
    assert main(["demo", "--model", "/nonexistent/checkpoint"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err.strip() == (
        "kvcanary demo: --model: '/nonexistent/checkpoint' is not a directory (expected `tiny` or a local "
        "checkpoint directory with a tokenizer and chat template)")
    assert main(["demo", "--model", str(tmp_path)]) == 2  # a directory that holds no checkpoint
    said = capsys.readouterr()
    assert said.out == "" and len(said.err.strip().splitlines()) == 1
    assert said.err.startswith(f"kvcanary demo: --model: {str(tmp_path)!r} does not load as a checkpoint: ")


def test_without_the_extra_the_demo_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))  # nothing converted here
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert main(["demo", "--json"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and len(said.err.strip().splitlines()) == 1
    assert said.err.startswith("kvcanary demo: the real model (SmolLM2-135M-Instruct) needs gguf, not installed: "
                               "pip install 'kvcanary[real]'"), said.err


def test_the_vllm_demo_outside_vllms_environment_says_where_to_run_it(monkeypatch, capsys):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find(name, *a))
    assert main(["demo", "--engine", "vllm"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and len(said.err.strip().splitlines()) == 1
    assert said.err.startswith("kvcanary demo --engine vllm needs vLLM: run it in vLLM's environment"), said.err


def test_a_question_asked_twice_is_printed_once_when_its_answers_agree(capsys):
    from kvcanary.demo.common import print_chat

    def answer(q, without, with_):
        return {"question": q, "without_canary": without, "with_canary": with_, "identical": without == with_}

    print_chat({"model": "m", "dtype": "bfloat16", "requests": 4, "system_prompt": "s", "engine": "e", "forwards": 3,
                "canary_ms_per_forward": 1.5, "forward_ms": 20.0, "canary_share_pct": 7.5, "violations": 0,
                "answers": [answer("Q1?", "A", "A"), answer("Q2?", "B", "B"), answer("Q1?", "A", "A"),
                            answer("Q2?", "B", "C")]})
    out = capsys.readouterr().out
    assert out.startswith("m (bfloat16): 4 requests (2 questions, each asked 2 times) sharing the system prompt 's'")
    assert out.count("Q: Q1?") == 1 and "Q: Q1?   (asked 2 times, the same answers)" in out
    assert out.count("Q: Q2?") == 2 and out.count("<-- DIFFERS") == 1  # answers that disagree: each ask shown
    assert "identical to those without it: NO (3 of 4)" in out
    assert "canary cost: 1.5 ms of host time per forward of 20.0 ms (7.5% of the run; 3 forwards)" in out
