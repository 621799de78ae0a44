#!/usr/bin/env bash
# The one-GPU test suite inside one device call's limit: runs tools/gpu/run_tests.sh on each
# prebuilt test binary in turn (most telling first), stops starting new ones when the time
# budget is nearly spent, and prints each binary's pass/fail rows. A device call returns at most
# 8 files, so all logs go into one file, $OUT/suite.log.
#   BUDGET=540 ORDER="cuda_model cuda_kernels" tools/gpu/suite.sh [BIN_DIR]
# BIN_DIR (default .devbin) holds the test binaries, minimax-rank and minimax-gateway
# (tools/gpu/collect.sh); binaries that are not there are reported as missing.
set -u
cd "$(dirname "$0")/../.."
bin_dir=${1:-.devbin}
out=${OUT:-/tmp/minimax-gpu-suite}
mkdir -p "$out"
export MINIMAX_KERNEL_CACHE=${MINIMAX_KERNEL_CACHE:-/tmp/minimax-kernel-cache}
t_end=$(($(date +%s) + ${BUDGET:-540}))
order=${ORDER:-"cuda_model cuda_kernels cuda_stream cuda_attention cuda_sampling cuda_kquant cuda_prefill cuda_blas cuda_upload cuda_tensor cuda_tensor_fast engine_cuda cuda_allreduce cuda_pipeline"}
logs=$(mktemp -d)
for n in $order; do
  if [ ! -x "$bin_dir/$n" ]; then
    echo "== $n: MISSING from $bin_dir"
    continue
  fi
  left=$((t_end - $(date +%s)))
  if [ "$left" -le 20 ]; then
    echo "== $n: NOT RUN (budget spent)"
    continue
  fi
  # run_tests.sh runs every binary of its folder: give it one, with the processes it spawns.
  d="$logs/bin_$n"
  mkdir -p "$d" "$logs/$n"
  cp "$bin_dir/$n" "$d/"
  for b in minimax-rank minimax-gateway; do [ -x "$bin_dir/$b" ] && cp "$bin_dir/$b" "$d/"; done
  OUT="$logs/$n" timeout "$left" tools/gpu/run_tests.sh "$d" >"$logs/$n.table" 2>&1
  rc=$?
  echo "== $n: exit $rc at $(date +%T)"
  sed -n '/== GPU test results ==/,$p' "$logs/$n.table" | grep -vE '^(binary|== GPU)'
  { echo "######## $n (exit $rc)"; cat "$logs/$n"/*.log 2>/dev/null; } >>"$out/suite.log"
done
rm -rf "$logs"
