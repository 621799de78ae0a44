#!/usr/bin/env bash
# The whole GPU check on a 2-GPU machine in one go, from prebuilt binaries: every CUDA test,
# the one-GPU rank benchmark, the HTTP benchmark through a real gateway, then the two-GPU tests
# and the tensor/pipeline benchmarks. Work that needs one GPU runs on GPU 0 and GPU 1 side by
# side to save machine time; on a one-GPU machine it runs one after the other and the two-GPU
# phase is skipped.
#   tools/gpu/all.sh BIN_DIR
# BIN_DIR holds the cuda_* test binaries, minimax-rank, minimax-bench and minimax-gateway
# (tools/gpu/collect.sh), optionally kcache/ (a prebuilt kernel cache: minimax-rank
# build-kernels --arch 90). Logs: $OUT/logs.tar.xz (every log) and $OUT/summary.txt.
# Per-phase limits (seconds): T1 (one-GPU phase, default 200), T2 (two-GPU phase, 200).
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=$(cd "${1:?BIN_DIR}" && pwd)
out=${OUT:-/tmp/minimax-all}
logs=/tmp/minimax-all-logs
rm -rf "$logs" && mkdir -p "$logs"/{t1,t2,http}
summary="$out/summary.txt"
mkdir -p "$out"
export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
if [ -d "$bin/kcache" ]; then
  mkdir -p /tmp/minimax-kernel-cache && cp -r "$bin/kcache/." /tmp/minimax-kernel-cache/
fi
export MINIMAX_KERNEL_CACHE=/tmp/minimax-kernel-cache
nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$summary"

# Test binaries that need one GPU / two GPUs.
mkdir -p /tmp/t1 /tmp/t2
for b in "$bin"/cuda_*; do
  case "$(basename "$b")" in
    cuda_tensor|cuda_tensor_fast|cuda_pipeline|cuda_allreduce) ln -sf "$b" /tmp/t2/ ;;
    cuda_nvrtc) ;;
    *) ln -sf "$b" /tmp/t1/ ;;
  esac
done
ln -sf "$bin/minimax-rank" /tmp/t2/minimax-rank

T1=${T1:-200}
T2=${T2:-200}
ngpu=$(nvidia-smi -L | wc -l)
bench_one() {
  timeout $((T1 * 6 / 10)) "$bin/minimax-bench" --synthetic m2.7:iq4xs ${BENCH_ARGS:-} >"$logs/bench1.log" 2>&1
  OUT="$logs/http" timeout $((T1 * 4 / 10)) bash tools/gpu/http_bench.sh "$bin" --prefill "${HTTP_PREFILL:-512,8192}" --stream-tokens 32 >"$logs/http.log" 2>&1
}
if [ "$ngpu" -ge 2 ]; then
  echo "== phase 1: one-GPU tests on GPU 0 | one-GPU benchmark, then HTTP benchmark, on GPU 1 =="
  (CUDA_VISIBLE_DEVICES=0 OUT="$logs/t1" timeout "$T1" bash tools/gpu/run_tests.sh /tmp/t1 >"$logs/t1/table.log" 2>&1) &
  p_tests=$!
  (CUDA_VISIBLE_DEVICES=1 bench_one) &
  p_bench=$!
  wait $p_tests $p_bench
else
  # One GPU: the same work one after the other, then stop (the two-GPU phase needs two).
  echo "== phase 1 (one GPU): one-GPU tests, then the one-GPU and HTTP benchmarks =="
  OUT="$logs/t1" timeout "$T1" bash tools/gpu/run_tests.sh /tmp/t1 >"$logs/t1/table.log" 2>&1
  bench_one
fi
{
  echo "--- GPU tests, one GPU ---"; sed -n '/== GPU test results ==/,$p' "$logs/t1/table.log"
  echo "--- minimax-bench, one GPU ---"; grep -v ' INFO ' "$logs/bench1.log" | tail -n 60
  echo "--- HTTP benchmark, one GPU ---"; tail -n 40 "$logs/http.log"
} >>"$summary"
if [ "$ngpu" -lt 2 ]; then
  tar -C "$logs" -cJf "$out/logs.tar.xz" . 2>/dev/null
  cat "$summary"
  exit 0
fi

echo "== phase 2: two-GPU tests, then tensor-2 and pipeline-2 benchmarks =="
OUT="$logs/t2" timeout $((T2 * 45 / 100)) bash tools/gpu/run_tests.sh /tmp/t2 >"$logs/t2/table.log" 2>&1
timeout $((T2 * 30 / 100)) "$bin/minimax-bench" --tp 2 --synthetic m2.7:iq4xs --8k ${TP2_ARGS:-} >"$logs/bench_tp2.log" 2>&1
timeout $((T2 * 25 / 100)) "$bin/minimax-bench" --pp 2 --synthetic m2.7:iq4xs --no-prefill ${PP2_ARGS:-} >"$logs/bench_pp2.log" 2>&1
{
  echo "--- GPU tests, two GPUs ---"; sed -n '/== GPU test results ==/,$p' "$logs/t2/table.log"
  echo "--- minimax-bench --tp 2 ---"; grep -v ' INFO ' "$logs/bench_tp2.log" | tail -n 40
  echo "--- minimax-bench --pp 2 ---"; grep -v ' INFO ' "$logs/bench_pp2.log" | tail -n 30
} >>"$summary"
tar -C "$logs" -cJf "$out/logs.tar.xz" . 2>/dev/null
cat "$summary"
