#!/usr/bin/env bash
# Per-kernel isolated durations and DRAM bytes of one replayed N-token decode step, under Nsight
# Compute (kernels serialized: no PDL overlap, ~3 µs launch floor each; what each kernel costs
# alone and whether it is bound by DRAM bytes), on a GPU machine after the binaries were
# unpacked into BIN_DIR (tools/gpu/focus.sh's /tmp/fb):
#   tools/gpu/ncu_step.sh BIN_DIR NT [LAYERS] [REPLAYS]
# Prints one line per kernel of the step (mean over REPLAYS replays, default 3): duration, DRAM
# bytes read, their rate. Environment as the ranks see it (e.g. MINIMAX_GSTREAM=0) passes through.
set -uo pipefail
bin=${1:?BIN_DIR}
nt=${2:?NT}
layers=${3:-4}
reps=${4:-3}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 0; }
export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MINIMAX_KERNEL_CACHE=${MINIMAX_KERNEL_CACHE:-/tmp/minimax-kernel-cache}
csv=$(mktemp)
# Launches to profile: at most 14 a layer + 3 per step (the step's length is found from the
# kernel names afterwards).
per=$((14 * layers + 3))
"$NCU" --profile-from-start off --cache-control none --clock-control none -c $((per * reps)) \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --print-units base \
  "$bin/minimax-bench" --synthetic "m2.7:iq4xs:$layers" --check-layers 0 --nsys-replay "$nt" >"$csv" 2>/dev/null
python3 - "$csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit("no ncu rows")
h = rows[0]
ki, mi, vi, ii = (h.index(k) for k in ("Kernel Name", "Metric Name", "Metric Value", "ID"))
d, names = collections.defaultdict(dict), {}
for r in rows[1:]:
    try:
        d[int(r[ii])][r[mi]] = float(r[vi].replace(",", ""))
        names[int(r[ii])] = r[ki]
    except ValueError:
        pass
ids = sorted(d)
nm = [names[i] for i in ids]
# The step's length: the shortest period of the kernel-name sequence.
n = next((p for p in range(1, len(nm) // 2 + 1) if all(nm[i] == nm[i + p] for i in range(len(nm) - p))), len(nm))
reps = len(ids) // n
print(f"{n} kernels a step, {reps} replays profiled")
print(f"{'#':>3} {'kernel':<36} {'us':>8} {'DRAM MB':>9} {'GB/s':>6}")
tot = 0.0
for j in range(n):
    t = sum(d[ids[j + n * r]].get("gpu__time_duration.sum", 0) for r in range(reps)) / reps
    b = sum(d[ids[j + n * r]].get("dram__bytes_read.sum", 0) for r in range(reps)) / reps
    tot += t
    print(f"{j:3d} {nm[j][:36]:<36} {t / 1e3:8.2f} {b / 1e6:9.2f} {b / max(t, 1):6.0f}")
print(f"sum of isolated kernel times: {tot / 1e3:.1f} us")
PY
rm -f "$csv"
