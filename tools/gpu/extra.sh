#!/usr/bin/env bash
# The measurements all.sh leaves out, on the same 2-GPU machine (prebuilt binaries, one device
# call): weight loading vs the disk (GPU 0); the Q4_K_M-like mix in tensor 2 and pipeline 2
# (its ~149 GB do not fit one H200); kill -9 recovery through the gateway. Each part has its
# own time limit so one hang cannot eat the call.
#   tools/gpu/extra.sh BIN_DIR
# Environment: PARTS (default "load q4km recovery"; instances with different PARTS may run side
# by side, e.g. "load" during all.sh's one-GPU phase), LOAD_SPEC (default m2.7:iq4xs:10,
# ~20 GB), Q4KM_ENV (environment for the Q4_K_M runs, e.g. MINIMAX_FAST_KQ=0).
# Logs: $OUT/extra-PARTS.tar.xz and $OUT/extra-PARTS.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=$(cd "${1:?BIN_DIR}" && pwd)
out=${OUT:-/tmp/minimax-extra}
parts=" ${PARTS:-load q4km recovery} "
name=$(echo ${PARTS:-load q4km recovery} | tr ' ' '-')
logs=/tmp/minimax-extra-logs-$name
rm -rf "$logs" && mkdir -p "$logs"/{load,recovery}
summary="$out/extra-$name.txt"
mkdir -p "$out"
: >"$summary"
export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
if [ -d "$bin/kcache" ] && [ ! -d /tmp/minimax-kernel-cache ]; then
  mkdir -p /tmp/minimax-kernel-cache && cp -r "$bin/kcache/." /tmp/minimax-kernel-cache/
fi
export MINIMAX_KERNEL_CACHE=/tmp/minimax-kernel-cache

if [[ $parts == *" load "* ]]; then
  echo "== part 1: weight loading vs the disk (GPU 0) =="
  CUDA_VISIBLE_DEVICES=0 OUT="$logs/load" LOAD_TIMEOUT=120 timeout 240 bash tools/gpu/load_bench.sh "$bin" /tmp/minimax-load.gguf "${LOAD_SPEC:-m2.7:iq4xs:10}" >"$logs/load.log" 2>&1
  { echo "--- weight loading vs the disk ---"; cat "$logs/load.log"; } >>"$summary"
fi

if [[ $parts == *" q4km "* ]]; then
  echo "== part 2: Q4_K_M-like mix, tensor 2 and pipeline 2 =="
  env ${Q4KM_ENV:-} timeout 100 "$bin/minimax-bench" --tp 2 --synthetic m2.7:q4km --decode-only >"$logs/q4km_tp2.log" 2>&1
  env ${Q4KM_ENV:-} timeout 80 "$bin/minimax-bench" --pp 2 --synthetic m2.7:q4km --decode-only >"$logs/q4km_pp2.log" 2>&1
  {
    echo "--- Q4_K_M-like mix, tensor 2 ---"; grep -v ' INFO ' "$logs/q4km_tp2.log" | tail -n 30
    echo "--- Q4_K_M-like mix, pipeline 2 ---"; grep -v ' INFO ' "$logs/q4km_pp2.log" | tail -n 20
  } >>"$summary"
fi

if [[ $parts == *" recovery "* ]]; then
  echo "== part 3: kill -9 recovery through the gateway =="
  OUT="$logs/recovery" timeout 200 bash tools/gpu/recovery.sh --device cuda --bin "$bin" >"$logs/recovery.log" 2>&1
  { echo "--- recovery ---"; tail -n 25 "$logs/recovery.log"; } >>"$summary"
fi

tar -C "$logs" -cJf "$out/extra-$name.tar.xz" . 2>/dev/null
cat "$summary"
