#!/usr/bin/env bash
# Every GPU check in one run, on a lent GPU machine without network (Python 3.12 with torch and
# triton): stages run in the order given (default: all), each under its own time limit, each
# writing its log to $OUT as it goes.
#
#   tests         GPU parity, CUDA-graph replay and no-host-sync tests (tests/test_kernels.py ...)
#   bench         SGLang's anchor, then bench/kernels.py, in the same process launch window, then
#                 its sweep of decode verify's block and warps
#   transformers  bench/transformers_cb.py on CUDA (Llama-shaped, 16 layers x 2048, random weights)
#   vllm_layouts  vLLM's GPU backends' cache layouts (FlashAttention, FlashInfer NHD/HND, Triton,
#                 FlexAttention) on CUDA tensors: Triton-vs-torch stamp parity, a clean verify and a
#                 flipped byte found, then decode verify and prefill stamp timings
#                 (bench/vllm_gpu_layouts.py, no vLLM needed), and tests/test_vllm_gpu.py's Triton cases
#   sglang_pool   SGLang's token-to-KV pool layout on CUDA tensors: the Triton kernels' stamps against
#                 the torch reference's, a clean verify, a flipped byte found (tests/test_sglang_pool.py's
#                 Triton case, no SGLang needed)
#
# Needs .gpu/ from bench/prepare_gpu_run.sh (carry it). The stages' limits add up to 15 minutes,
# more than one device call's 10, so split them (the session's 15 device minutes include starting):
#   bench/gpu_run.sh bench        then        bench/gpu_run.sh tests transformers vllm_layouts sglang_pool
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvcanary-gpu}
mkdir -p "$OUT"
SITE=/tmp/kvcanary-site
if [ ! -d "$SITE" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/*.whl \
    || { echo "wheel install failed: run bench/prepare_gpu_run.sh and carry .gpu"; exit 1; }
fi
export PYTHONPATH="$SITE:$PWD/src:$PWD/tests" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"

stage() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -25 "$OUT/$name.log"
  echo "== $name: exit $rc in $((SECONDS - t0))s"
}

for s in "${@:-bench tests transformers vllm_layouts sglang_pool}"; do
  for one in $s; do
    case $one in
      tests)  # kernel variants compile on first use: spread them over the host's cores when xdist is there
        par=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
        stage tests 240 python3 -m pytest -q $par -p no:cacheprovider tests/test_kernels.py tests/test_no_host_sync.py ;;
      bench)
        stage sglang_anchor 120 python3 .gpu/sglang_anchor.py
        stage kernels 200 python3 bench/kernels.py
        stage kernels_sweep 60 python3 bench/kernels.py --sweep ;;
      transformers) stage transformers_cuda 180 python3 bench/transformers_cb.py --device cuda --repeats 3 \
                      --layers 16 --hidden 2048 ;;
      vllm_layouts)
        stage vllm_gpu_layouts 90 python3 bench/vllm_gpu_layouts.py --device cuda
        stage vllm_gpu_tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_vllm_gpu.py -k triton ;;
      sglang_pool)  # SGLang's pool layout on CUDA tensors under the Triton kernels (no SGLang needed)
        stage sglang_pool_tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_sglang_pool.py -k triton ;;
      *) echo "unknown stage $one (tests, bench, transformers, vllm_layouts, sglang_pool)"; exit 2 ;;
    esac
  done
done
