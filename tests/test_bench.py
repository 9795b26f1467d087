"""The CPU benchmarks run against the library as it stands: each ``bench/`` script that needs no
other environment runs a small case and prints its figures (a benchmark the code moved away from
fails here, not on the day someone needs its numbers). What the figures are is for the scripts to
say; here only that they come out, and clean."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

# script -> arguments of a small run (seconds, not minutes, on two cores)
SMALL = {
    "host_cost.py": ["--forwards", "2", "--requests", "16", "--contexts", "48", "--kinds", "decode,mixed"],
    "transformers_stages.py": ["--runs", "1"],
    "transformers_cb.py": ["--repeats", "1", "--workloads", "decode_heavy", "--threads", "1"],
    "decode_forward.py": ["--repeats", "1", "--new-tokens", "8", "--backends", "fused"],
    "ops.py": ["--quick", "--repeats", "1", "--backends", "torch,fused"],
    "vllm_gpu_layouts.py": ["--device", "cpu"],  # the Triton kernels under the interpreter
    "audit_loop.py": ["--repeat", "2"],  # the trained model's first forwards
}


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


@pytest.mark.parametrize("script", sorted(SMALL))
def test_a_cpu_benchmark_runs_and_prints_its_figures(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCH / script), *SMALL[script]], capture_output=True, text=True,
                          timeout=600, env=env, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = _json_lines(done.stdout)
    assert lines, done.stdout[-2000:]
    for d in lines:  # a clean run reports no violation and no canary failure of its own
        assert d.get("violations", 0) == 0 and d.get("internal_errors", 0) == 0, d
