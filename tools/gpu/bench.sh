#!/usr/bin/env bash
# On a GPU machine, from the repository root, with prebuilt binaries in .devbin/ (see
# tools/gpu/collect.sh): the CUDA test suite (pass/fail table), then the rank-forward benchmark
# on synthetic M2.7 weights. Logs in $OUT (or /tmp/minimax-gpu-tests).
#   tools/gpu/bench.sh [.devbin] [minimax-bench args...]
set -uo pipefail
cd "$(dirname "$0")/../.."
bin_dir=${1:-.devbin}
shift || true
log_dir=${OUT:-/tmp/minimax-gpu-tests}
mkdir -p "$log_dir"
if [ -n "${CUDA_HOME:-}" ]; then
  export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export MINIMAX_KERNEL_CACHE=${MINIMAX_KERNEL_CACHE:-/tmp/minimax-kernel-cache}
tests_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  tools/gpu/run_tests.sh "$bin_dir" >"$log_dir/tests.log" 2>&1
  tests_rc=$?
  sed -n '/== GPU test results ==/,$p' "$log_dir/tests.log"
  grep -hE '^(q8 quantize|mvq|moe )' "$log_dir"/cuda_kernels.log 2>/dev/null || true
fi
"$bin_dir/minimax-bench" "$@" 2>&1 | tee "$log_dir/bench.log" | grep -v ' INFO '
exit $tests_rc
