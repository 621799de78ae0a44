#!/usr/bin/env bash
# Overlapped decode A/B through HTTP on one GPU: tools/gpu/http_bench.sh (gateway + one CUDA
# rank serving a synthetic MiniMax-M2.7) once per entry of MODES (default "off on"), with
# MINIMAX_OVERLAP set to it, and the same http_bench.py arguments each time.
#   tools/gpu/overlap_ab.sh BIN_DIR [http_bench.py args...]
# Environment: MODES, and what http_bench.sh reads (SYNTHETIC, KV_PAGES, ...). Logs under $OUT
# (default /tmp/minimax-overlap-ab), one folder per run.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=${1:?BIN_DIR}
shift
out=${OUT:-/tmp/minimax-overlap-ab}
i=0
for mode in ${MODES:-off on}; do
  i=$((i + 1))
  echo "== run $i: overlap $mode"
  MINIMAX_OVERLAP=$mode OUT="$out/$i-$mode" tools/gpu/http_bench.sh "$bin" "$@" 2>&1 | grep -vE "^\s*$"
  echo "exit ${PIPESTATUS[0]}"
done
