#!/usr/bin/env bash
# On a GPU machine (device tool, carry [".devbin"]): the fast-path kernel test for each gate/up
# variant (MINIMAX_GU_REG=0|4|2|4n|2n), the benchmark's decode replay + per-kernel split for
# each variant that passed (each run stopped after its split), then Nsight Compute (if present,
# --clock-control none) on one mvq_q8_0_1, moe_gate_up and moe_down launch of a 2-layer model.
#   tools/gpu/profile_gu.sh [variants...]      logs in $OUT (or /tmp/minimax-prof)
set -u
cd "$(dirname "$0")/../.."
B=.devbin
L=${OUT:-/tmp/minimax-prof}; mkdir -p "$L"
[ -n "${CUDA_HOME:-}" ] && export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MINIMAX_KERNEL_CACHE=/tmp/minimax-kernel-cache NCCL_NVLS_ENABLE=0
[ -e /work/main/fixtures ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
vars=${*:-"0 4 2 4n 2n"}
bvars=${BENCH_VARS:-}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
ok=""
for v in $vars; do
  (cd rank-worker && MINIMAX_GU_REG=$v timeout 90 "../$B/cuda_kernels" --ignored --test-threads=1 --nocapture fast_q8_products) >"$L/kt_$v.log" 2>&1
  rc=$?; echo "kernel test MINIMAX_GU_REG=$v rc=$rc"; [ $rc -eq 0 ] && ok="$ok $v"
  grep -E "^(mvq|moe )" "$L/kt_$v.log" | head -4
done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
M="gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_membar.ratio,smsp__average_warp_latency_issue_stalled_not_selected.ratio,smsp__average_warp_latency_issue_stalled_selected.ratio,smsp__average_warp_latency_issue_stalled_no_instruction.ratio,smsp__average_warp_latency_issue_stalled_dispatch_stall.ratio,smsp__average_warp_latency_issue_stalled_drain.ratio,smsp__average_warp_latency_issue_stalled_imc_miss.ratio,smsp__average_warp_latency_issue_stalled_branch_resolving.ratio,smsp__average_warp_latency_issue_stalled_sleeping.ratio,smsp__average_warp_latency_per_inst_issued.ratio,launch__registers_per_thread,launch__occupancy_limit_registers,sm__maximum_warps_per_active_cycle_pct"
ncu_run() {
[ -n "$NCU" ] || return 0
for v in "$@"; do
  echo "== ncu MINIMAX_GU_REG=$v"
  MINIMAX_GU_REG=$v timeout ${NCU_T:-100} "$NCU" --clock-control none --kill on --metrics "$M" \
    -k 'regex:^(mvq_q8_0_1|mvqs_q8_0_1[sl]|moe_gate_up.*|moe_down.*iq4_xs)$' --launch-skip 24 --launch-count 6 \
    "$B/minimax-bench" --synthetic m2.7:iq4xs:2 --no-prefill --no-8k --decode-steps 20 >"$L/ncu_$v.log" 2>&1
  echo "rc=$?"
  grep -vE " INFO |^(model|device|decode|check|fast)" "$L/ncu_$v.log" | grep -E '^  [a-z_0-9]+.*\(|^    [a-z]|==PROF==|==ERROR' | head -230
done
}
ncu_run ${NCU_FIRST:-0}
# Bench until its per-kernel split is printed (then stopped).
for v in $ok; do
  [ -z "$bvars" ] || [[ " $bvars " == *" $v "* ]] || continue
  MINIMAX_GU_REG=$v "$B/minimax-bench" --no-prefill --no-8k --decode-steps 40 >"$L/bench_$v.log" 2>&1 &
  pid=$!; s=0
  while kill -0 $pid 2>/dev/null && ! grep -q "bytes per decoded token" "$L/bench_$v.log" && [ $s -lt ${BENCH_T:-75} ]; do sleep 1; s=$((s+1)); done
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  echo "== bench MINIMAX_GU_REG=$v (${s}s)"
  grep -E "graph replay|moe_gate_up|moe_down|mvq_q8_0_1 |total" "$L/bench_$v.log" | grep -v INFO
done
ncu_run ${NCU_LATER:-}
