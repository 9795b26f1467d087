#!/usr/bin/env bash
# Fill .gpu/ (git-ignored) with what bench/gpu_run.sh needs on a GPU machine without network:
# the wheels of SGLang 0.5.23 and the few packages its kernel launchers import (see
# ../shared/bench/README.md), transformers 5.24 (the GPU image has another version), and a copy
# of SGLang's anchor script. About 55 MB. Run here, where package registries are reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d .gpu sglang==0.5.23 apache-tvm-ffi==0.1.11 orjson pybase64 msgspec pyzmq
"$PY" -m pip download -q --no-deps -d .gpu starlette transformers==5.24.0
cp "${ANCHOR:-../shared/bench/sglang_anchor.py}" .gpu/sglang_anchor.py
du -sh .gpu
