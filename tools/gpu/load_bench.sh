#!/usr/bin/env bash
# Weight loading vs the disk: writes a synthetic M2.7-shaped GGUF (minimax-rank
# write-synthetic) unless FILE exists, then reads it cold with dd (the disk's speed), and loads
# it with `minimax-rank serve --device cuda:0` cold (page cache dropped; as root) with each
# MINIMAX_LOAD_IO mode and once warm, printing each load's upload line. Run on a GPU machine
# from the repository root with prebuilt binaries in BIN_DIR (tools/gpu/collect.sh).
#   tools/gpu/load_bench.sh [BIN_DIR] [FILE] [SPEC]     (SPEC default m2.7:iq4xs:10, ~20 GB)
# Environment: MODES (default "pread mmap"), LOAD_TIMEOUT (seconds per load, 300).
# Logs in $OUT or /tmp/minimax-load-bench (rank.pid: the rank being loaded, for a caller that
# kills this script).
set -uo pipefail
cd "$(dirname "$0")/../.."
bin_dir=${1:-.devbin}
file=${2:-/tmp/minimax-load-bench.gguf}
spec=${3:-m2.7:iq4xs:10}
log_dir=${OUT:-/tmp/minimax-load-bench}
mkdir -p "$log_dir"
if [ -n "${CUDA_HOME:-}" ]; then
  export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export MINIMAX_KERNEL_CACHE=${MINIMAX_KERNEL_CACHE:-/tmp/minimax-kernel-cache}

drop_caches() {
  sync
  if ! echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then
    echo "(could not drop the page cache: not root? 'cold' numbers below are warm)"
  fi
}

if [ ! -f "$file" ]; then
  "$bin_dir/minimax-rank" write-synthetic "$spec" "$file" || exit 1
fi
size=$(stat -c %s "$file")
echo "file: $file, $(awk -v b="$size" 'BEGIN{printf "%.2f GB", b/1e9}')"

drop_caches
t0=$(date +%s.%N)
dd if="$file" of=/dev/null bs=16M 2>"$log_dir/dd.log"
t1=$(date +%s.%N)
awk -v a="$t0" -v b="$t1" -v s="$size" 'BEGIN{printf "disk, cold dd bs=16M: %.2f s, %.2f GB/s\n", b-a, s/1e9/(b-a)}'

# One load: start a rank, wait for its upload line (or a failure), stop it.
load() {
  local label=$1 log="$log_dir/load-$1.log" sock="/tmp/minimax-load-bench-$$.sock"
  "$bin_dir/minimax-rank" serve --rank 0 --listen "unix://$sock" --model "$file" --device cuda:0 --kv-pages 16 >"$log" 2>&1 &
  local pid=$! t0
  echo "$pid" >"$log_dir/rank.pid"
  t0=$(date +%s)
  while kill -0 "$pid" 2>/dev/null; do
    if grep -qE 'weights on |loading failed' "$log"; then break; fi
    if [ $(( $(date +%s) - t0 )) -gt "${LOAD_TIMEOUT:-300}" ]; then echo "$label: timed out"; break; fi
    sleep 0.2
  done
  kill -TERM "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  echo "== $label"
  grep -hoE '(CUDA kernels ready.*|weights: .*|weights on .*|loading failed.*)' "$log" | sed 's/^/  /'
}

for mode in ${MODES:-pread mmap}; do
  drop_caches
  MINIMAX_LOAD_IO=$mode load "cold-$mode"
done
MINIMAX_LOAD_IO=pread load "warm-pread"
