#!/usr/bin/env bash
# Nsight Compute details (warp stalls with their top SASS locations, scheduler, memory tables,
# occupancy) of one launch of the kernels matching a regex inside a prebuilt test, on a GPU
# machine after tools/gpu/focus.sh unpacked the binaries into /tmp/fb:
#   tools/gpu/ncu_kernel.sh BIN TEST_FILTER KERNEL_REGEX [SKIP] [COUNT]
# e.g. tools/gpu/ncu_kernel.sh cuda_stream grouped_streamed_speed 'moe_gate_up_gst_iq4_xs' 8 1
set -uo pipefail
cd "$(dirname "$0")/../.."
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 0; }
export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" MINIMAX_KERNEL_CACHE=/tmp/minimax-kernel-cache
cd rank-worker
"$NCU" --clock-control none -k "regex:${3:?KERNEL_REGEX}" --launch-skip "${4:-8}" --launch-count "${5:-1}" \
  --section WarpStateStats --section SchedulerStats --section SourceCounters --section Occupancy \
  --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section SpeedOfLight \
  "/tmp/fb/${1:?BIN}" --ignored --test-threads=1 --nocapture "${2:?TEST_FILTER}" 2>&1 | grep -vE "^\s*$|^==PROF==" | grep -vE "^(test |running|grouped|grpf|probe)" | cut -c1-160
