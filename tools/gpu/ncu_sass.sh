#!/usr/bin/env bash
# Per-SASS-instruction warp-stall samples of one launch of a kernel inside a prebuilt test (after
# tools/gpu/focus.sh unpacked the binaries into /tmp/fb), plus the stall-reason and pipe
# metrics; prints the hottest instructions. Output files under $OUT.
#   tools/gpu/ncu_sass.sh BIN TEST_FILTER KERNEL_REGEX [SKIP]
# BIN minimax-bench: TEST_FILTER is its argument list instead (word-split), e.g.
#   tools/gpu/ncu_sass.sh minimax-bench "--synthetic m2.7:iq4xs:2 --check-layers 0 --nsys-replay 32" mvmma3 2
set -uo pipefail
cd "$(dirname "$0")/../.."
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 0; }
export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" MINIMAX_KERNEL_CACHE=/tmp/minimax-kernel-cache
o=${OUT:-/tmp}
S=smsp__average_warp_latency_issue_stalled
M="$S"_long_scoreboard.ratio,"$S"_short_scoreboard.ratio,"$S"_mio_throttle.ratio,"$S"_math_pipe_throttle.ratio,"$S"_wait.ratio,"$S"_barrier.ratio,"$S"_not_selected.ratio,"$S"_selected.ratio,"$S"_no_instruction.ratio,"$S"_dispatch_stall.ratio,"$S"_branch_resolving.ratio,"$S"_sleeping.ratio,"$S"_lg_throttle.ratio,"$S"_membar.ratio,smsp__average_warp_latency_per_inst_issued.ratio,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,gpu__time_duration.sum
cd rank-worker
if [ "$1" = minimax-bench ]; then
  run=(/tmp/fb/minimax-bench $2)
  prof=(--profile-from-start off)
else
  run=("/tmp/fb/$1" --ignored --test-threads=1 --nocapture "$2")
  prof=()
fi
"$NCU" "${prof[@]}" --clock-control none -k "regex:${3:?KERNEL_REGEX}" --launch-skip "${4:-8}" --launch-count 1 --metrics "$M" \
  "${run[@]}" > "$o/ncu_metrics.txt" 2>&1
grep -E "ratio|pct|sum" "$o/ncu_metrics.txt" | sed 's/  */ /g'
"$NCU" "${prof[@]}" --clock-control none -k "regex:$3" --launch-skip "${4:-8}" --launch-count 1 --section SourceCounters --section WarpStateStats \
  --page source --csv --print-source sass "${run[@]}" > "$o/ncu_sass.csv" 2>&1
python3 - "$o/ncu_sass.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
hi = next((i for i, r in enumerate(rows) if any("Source" == c or "Address" in c for c in r)), None)
if hi is None:
    print("no source table"); print("\n".join(",".join(r)[:200] for r in rows[:30])); sys.exit()
h = rows[hi]; print("columns:", h[:12])
def col(name):
    for i, c in enumerate(h):
        if c.startswith(name): return i
    return None
si = col("Source"); wi = col("Warp Stall Sampling (All"); ei = col("Instructions Executed")
body = [r for r in rows[hi + 1:] if len(r) == len(h)]
tot = sum(float(r[wi] or 0) for r in body) if wi is not None else 0
print("total stall samples", tot, "instructions", len(body))
for r in sorted(body, key=lambda r: -float(r[wi] or 0))[:45]:
    print(f"{float(r[wi] or 0):8.0f} {100*float(r[wi] or 0)/max(tot,1):5.1f}%  {r[ei] if ei is not None else '':>10}  {r[si][:90]}")
PY
