#!/usr/bin/env bash
# What users get on one GPU: starts minimax-gateway with one CUDA rank serving a synthetic
# MiniMax-M2.7 (random weights, benchmarks only), waits until it is ready, runs
# tools/bench/http_bench.py against it (standard-library Python), prints its table and stops
# everything. Run on a GPU machine from the repository root, with prebuilt binaries
# (minimax-gateway, minimax-rank) in BIN_DIR (tools/gpu/collect.sh copies them).
#   tools/gpu/http_bench.sh [BIN_DIR] [http_bench.py args...]
# Environment: GATEWAY_ARGS (how ranks start; default `--device cuda`: one CUDA rank; e.g.
# `--gpus 0,1 --parallelism pipeline` for a two-GPU world: each rank fills its share of the
# synthetic weights), MODEL (a GGUF to serve instead of synthetic weights, e.g. one
# `minimax-rank write-synthetic ... --tokenizer-from fixtures/m2-small/q8_0.gguf` wrote, with
# `--vocab 1000` for http_bench.py), SYNTHETIC (default m2.7:iq4xs),
# KV_PAGES (default 640 pages of 64 tokens:
# 40,960 tokens, room for the 32,768-token TTFT), PORT (8000), READY_TIMEOUT (seconds, 900).
# Logs (gateway + rank, benchmark) in $OUT or /tmp/minimax-http-bench; gateway.pid there (the
# rank dies with the gateway) for a caller that kills this script.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin_dir=${1:-.devbin}
shift || true
log_dir=${OUT:-/tmp/minimax-http-bench}
mkdir -p "$log_dir"
if [ -n "${CUDA_HOME:-}" ]; then
  export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export MINIMAX_KERNEL_CACHE=${MINIMAX_KERNEL_CACHE:-/tmp/minimax-kernel-cache}
port=${PORT:-8000}
url="http://127.0.0.1:$port"

if [ -n "${MODEL:-}" ]; then
  model_args=(--model "$MODEL")
else
  model_args=(--synthetic "${SYNTHETIC:-m2.7:iq4xs}" --allow-synthetic)
fi
"$bin_dir/minimax-gateway" "${model_args[@]}" \
  ${GATEWAY_ARGS:---device cuda} --rank-binary "$bin_dir/minimax-rank" --kv-pages "${KV_PAGES:-640}" \
  --port "$port" >"$log_dir/gateway.log" 2>&1 &
gw=$!
echo "$gw" >"$log_dir/gateway.pid"
stop() {
  kill -TERM "$gw" 2>/dev/null
  for _ in $(seq 50); do kill -0 "$gw" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$gw" 2>/dev/null
}
trap stop EXIT
trap 'exit 143' TERM INT

ready() {
  python3 - "$url" <<'PY'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1] + "/health", timeout=2) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}
t0=$(date +%s)
until ready; do
  if ! kill -0 "$gw" 2>/dev/null; then
    echo "gateway exited before it was ready; last log lines:" >&2
    tail -n 30 "$log_dir/gateway.log" >&2
    exit 1
  fi
  if [ $(( $(date +%s) - t0 )) -gt "${READY_TIMEOUT:-900}" ]; then
    echo "not ready after ${READY_TIMEOUT:-900} s; last log lines:" >&2
    tail -n 30 "$log_dir/gateway.log" >&2
    exit 1
  fi
  sleep 1
done
echo "ready after $(( $(date +%s) - t0 )) s ($(grep -hoE 'synthetic weights on .*' "$log_dir/gateway.log" | head -1))"
python3 tools/bench/http_bench.py --url "$url" "$@" 2>&1 | tee "$log_dir/http_bench.log"
rc=${PIPESTATUS[0]}
exit "$rc"
