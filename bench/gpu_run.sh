#!/usr/bin/env bash
# Every GPU check in one run (for a lent GPU machine without network): GPU parity and CUDA-graph
# tests, SGLang's anchor and bench/kernels.py in the same process launch window, and the
# transformers overhead benchmark on CUDA. Needs .whl/ with the wheels listed in
# ../shared/bench/README.md (sglang 0.5.23 and friends) and a copy of sglang_anchor.py in bench/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvcanary-gpu}; mkdir -p "$OUT"
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl 2>/dev/null && export PYTHONPATH="$SITE:src"
export PYTHONPATH="${PYTHONPATH:-}:src"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || true
PYTHONUNBUFFERED=1 python3 -m pytest -q tests/test_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
PYTHONUNBUFFERED=1 python3 bench/sglang_anchor.py 2>&1 | tee "$OUT/sglang_anchor.jsonl" | tail -30
PYTHONUNBUFFERED=1 python3 bench/kernels.py 2>&1 | tee "$OUT/kernels.jsonl" | tail -30
PYTHONUNBUFFERED=1 python3 bench/transformers_cb.py --device cuda --repeats 3 2>&1 | tee "$OUT/transformers_cuda.jsonl"
