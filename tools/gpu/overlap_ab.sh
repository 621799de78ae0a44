#!/usr/bin/env bash
# An A/B of one switch through HTTP on one GPU: tools/gpu/http_bench.sh (gateway + one CUDA
# rank serving a synthetic MiniMax-M2.7) once per entry of MODES (default "off on"), with the
# environment variable VAR (default MINIMAX_OVERLAP, overlapped decode) set to it, and the
# same http_bench.py arguments each time.
#   tools/gpu/overlap_ab.sh BIN_DIR [http_bench.py args...]
# e.g. device-drawn sampled tokens: VAR=MINIMAX_DEVICE_DRAW MODES="1 0 1" tools/gpu/overlap_ab.sh
#   BIN_DIR --sampling default --decode-tokens 300 --prefill 512 --streams 1,4
# Environment: VAR, MODES, and what http_bench.sh reads (SYNTHETIC, KV_PAGES, ...). Logs under
# $OUT (default /tmp/minimax-overlap-ab), one folder per run.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=${1:?BIN_DIR}
shift
out=${OUT:-/tmp/minimax-overlap-ab}
var=${VAR:-MINIMAX_OVERLAP}
i=0
for mode in ${MODES:-off on}; do
  i=$((i + 1))
  echo "== run $i: $var=$mode"
  env "$var=$mode" OUT="$out/$i-$mode" tools/gpu/http_bench.sh "$bin" "$@" 2>&1 | grep -vE "^\s*$"
  echo "exit ${PIPESTATUS[0]}"
done
