#!/usr/bin/env bash
# The checks that need a GPU, on a CUDA host with torch installed: builds pyckpt in tree for the
# given Python (scripts/dev_build.sh; zstd compiled in from PYCKPT_ZSTD_SOURCE when it is set, so
# the host needs no libzstd-dev), runs the `gpu`-marked tests and the CUDA staging tests, then the
# GPU benchmark. Each part has its own time limit and log; a failing part does not stop the next.
# Usage: scripts/gpu_check.sh [python] [logdir]   (default: python3, gpu-logs)
# Knobs: GPU_BENCH_ARGS (extra bench_gpu_async.py arguments), GPU_TESTS_TIMEOUT, GPU_BENCH_TIMEOUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
LOGS=${2:-gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

step() {  # step NAME SECONDS CMD...: runs CMD with a time limit, logs to $LOGS/NAME.log
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  echo "=== $name: exit $rc in $(($(date +%s) - t0)) s" | tee -a "$LOGS/summary.txt"
  tail -n 30 "$LOGS/$name.log"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "available", torch.cuda.is_available())'
  nproc
} 2>&1 | tee "$LOGS/summary.txt"

ZARGS=""
if [ -n "${PYCKPT_ZSTD_SOURCE:-}" ]; then
  ZARGS="-DPYCKPT_ZSTD_STATIC=ON -DPYCKPT_ZSTD_SOURCE=$(cd "$PYCKPT_ZSTD_SOURCE" && pwd)"
fi
step build 600 env PYCKPT_CMAKE_ARGS="$ZARGS" scripts/dev_build.sh "$PY" || exit 1

step gpu-tests "${GPU_TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider -rA \
  -m "gpu" tests/test_cuda_staging_gpu.py tests/test_gpu_restore.py tests/test_manager.py
step cuda-cpu-tests "${GPU_TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_cuda_staging.py tests/test_cuda_staging_pinned.py tests/test_manager_staging.py \
  tests/test_storage.py
# shellcheck disable=SC2086
step bench-gpu-async "${GPU_BENCH_TIMEOUT:-300}" "$PY" benchmarks/bench_gpu_async.py \
  ${GPU_BENCH_ARGS:-}
exit "$status"
