#!/usr/bin/env bash
# Issue 7's served table on a 2-GPU machine in one call, from prebuilt binaries: full 62-layer
# synthetic MiniMax-M2.7 worlds served through a real gateway (each rank fills its share of
# the weights on its GPU: no GGUF file), tensor 2 and pipeline 2, for the Q4_K_M-like mix (the
# issue's) and the IQ4_XS mix; then tensor 2 with NCCL's socket transport forced; then the
# rank forward split of tensor 2 (kernels vs collectives per token, minimax-bench --tp 2).
#   tools/gpu/two_gpu_served.sh BIN_DIR
# BIN_DIR: minimax-gateway, minimax-rank, minimax-bench (tools/gpu/collect.sh), optionally
# kcache/. Environment: MIXES (default "q4km iq4xs"), PREFILL (512,513,8192), STREAMS (1,32),
# T_WORLD (seconds a world may take, 120). Logs and a summary under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=$(cd "${1:?BIN_DIR}" && pwd)
out=${OUT:-/tmp/minimax-two-gpu}
mkdir -p "$out"
summary="$out/summary.txt"
export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
if [ -d "$bin/kcache" ]; then
  mkdir -p /tmp/minimax-kernel-cache && cp -r "$bin/kcache/." /tmp/minimax-kernel-cache/
fi
export MINIMAX_KERNEL_CACHE=/tmp/minimax-kernel-cache
nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv,noheader | tee "$summary"
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
  echo "two_gpu_served.sh needs two GPUs" | tee -a "$summary"
  exit 2
fi

# One served world: label, gateway arguments, extra environment (VAR=VALUE ...).
world() {
  local label=$1 args=$2
  shift 2
  echo "== $label ==" | tee -a "$summary"
  env "$@" OUT="$out/$label" GATEWAY_ARGS="$args" SYNTHETIC="$mix_spec" timeout "${T_WORLD:-120}" \
    bash tools/gpu/http_bench.sh "$bin" --prefill "${PREFILL:-512,513,8192}" --streams "${STREAMS:-1,32}" --stream-tokens 32 >"$out/$label.log" 2>&1
  echo "exit $?" >>"$summary"
  grep -E "^\||ready after" "$out/$label.log" >>"$summary"
}
for mix in ${MIXES:-q4km iq4xs}; do
  mix_spec="m2.7:$mix"
  world "${mix}_tensor2" "--gpus 0,1 --parallelism tensor"
  world "${mix}_pipeline2" "--gpus 0,1 --parallelism pipeline"
done
# NCCL's network transport between the two rank processes (what two hosts would use).
mixes=${MIXES:-q4km iq4xs}
mix_spec="m2.7:${mixes%% *}"
PREFILL=512 STREAMS=1 world "socket_tensor2" "--gpus 0,1 --parallelism tensor" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 MINIMAX_TP_ALLREDUCE=nccl NCCL_DEBUG=INFO
grep -m2 -E "Using network|via NET" "$out/socket_tensor2/gateway.log" >>"$summary" 2>/dev/null
# Kernels vs collectives per decoded token, tensor 2 (rank forward, no HTTP).
echo "== minimax-bench --tp 2 --synthetic $mix_spec ==" | tee -a "$summary"
timeout 150 "$bin/minimax-bench" --tp 2 --synthetic "$mix_spec" >"$out/bench_tp2.log" 2>&1
echo "exit $?" >>"$summary"
grep -v ' INFO ' "$out/bench_tp2.log" | tail -n 30 >>"$summary"
cat "$summary"
