#!/usr/bin/env bash
# One command on a CUDA machine: set up, run the GPU checks, print one line per check.
#   1. kernels:   both Triton kernels compiled for CUDA against their torch references
#                 (tests/gpu: kv_correct; flash_lora with LR, key shifts and KV leaves)
#   2. injection: injection, RoPE re-alignment and the fused correction write on SGLang's GPU
#                 attention backends (tests/integration/test_gpu_backends.py, tiny model)
#   3. ttft:      python -m benchmarks.ttft_reuse --quick (SmolLM2 on the GPU)
# Exits non-zero if a check failed; without CUDA it says so and exits 0 (nothing to check).
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no CUDA device here; nothing to check (the CPU suite is scripts/test.sh)"
  exit 0
fi
scripts/setup.sh || { echo "gpu_check: setup FAILED"; exit 1; }
VENV=${KVSHARE_VENV:-.venv}
LOGS=${GPU_CHECK_LOGS:-results/gpu_check}
mkdir -p "$LOGS"
failed=0
check() {  # check NAME COMMAND...: run, keep the log, print one line
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$LOGS/$name.log" 2>&1; then
    echo "gpu_check: $name ok ($((SECONDS - t0)) s; $LOGS/$name.log)"
  else
    echo "gpu_check: $name FAILED ($((SECONDS - t0)) s; tail of $LOGS/$name.log below)"
    tail -n 20 "$LOGS/$name.log" | sed 's/^/    /'
    failed=1
  fi
}
check kernels "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/gpu
check injection "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/integration/test_gpu_backends.py
check ttft "$VENV/bin/python" -m benchmarks.ttft_reuse --quick --out "$LOGS/ttft_reuse.json"
exit $failed
