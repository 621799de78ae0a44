#!/usr/bin/env bash
# A focused check on a one-GPU machine: chosen tests of the prebuilt binaries, then one
# minimax-bench call, each under its own limit. For iterating on one change (final_one.sh runs
# everything).
#   T_TESTS=200 T_BENCH=200 BENCH_ARGS="--gstream-ab" tools/gpu/focus.sh ARCHIVE BIN:FILTER...
# ARCHIVE: a .tar.xz of tools/gpu/collect.sh's folder with kcache/; BIN:FILTER e.g.
# cuda_stream: (all its tests) or cuda_kernels:fast_grouped. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/minimax-focus}
mkdir -p "$out" /tmp/fb
tar xJf "${1:?ARCHIVE}" -C /tmp/fb
shift
export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
mkdir -p /tmp/minimax-kernel-cache && cp -r /tmp/fb/kcache/. /tmp/minimax-kernel-cache/
export MINIMAX_KERNEL_CACHE=/tmp/minimax-kernel-cache
[ -e /work/main/fixtures ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
t0=$(date +%s)
for spec in "$@"; do
  b=${spec%%:*} f=${spec#*:}
  (cd rank-worker && timeout "${T_TESTS:-200}" "/tmp/fb/$b" --ignored --test-threads=1 --nocapture $f) >"$out/$b.log" 2>&1
  echo "$spec: exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "^test .*(ok|FAILED)$|panicked|^test result" "$out/$b.log" | head -40
done
if [ -n "${BENCH_ARGS:-}" ]; then
  timeout "${T_BENCH:-200}" /tmp/fb/minimax-bench --synthetic "${BENCH_MODEL:-m2.7:iq4xs}" $BENCH_ARGS >"$out/bench.log" 2>&1
  echo "bench: exit $? at $(( $(date +%s) - t0 )) s"
fi
