#!/usr/bin/env bash
# One call on a one-GPU machine that checks and measures a whole change: every one-GPU CUDA
# test, the rank benchmark, the HTTP benchmark through a real gateway and (if time is left)
# per-kernel durations of a replayed 32-token step under Nsight Compute, each under its own
# time limit so that the call stays inside the device tool's limit.
#   tools/gpu/final_one.sh ARCHIVE   (a .tar.xz of tools/gpu/collect.sh's folder incl. kcache/)
# Limits (seconds): T_TESTS (180), T_BENCH (170), T_HTTP (100), T_ALL (480: no Nsight after it).
# Logs under $OUT; a summary at the end of stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
out=${OUT:-/tmp/minimax-final}
mkdir -p "$out" /tmp/fb /tmp/ft
tar xJf "${1:?ARCHIVE}" -C /tmp/fb
export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
mkdir -p /tmp/minimax-kernel-cache && cp -r /tmp/fb/kcache/. /tmp/minimax-kernel-cache/
export MINIMAX_KERNEL_CACHE=/tmp/minimax-kernel-cache
for b in /tmp/fb/cuda_*; do
  case "$(basename "$b")" in cuda_tensor|cuda_tensor_fast|cuda_pipeline|cuda_allreduce|cuda_nvrtc) ;; *) ln -sf "$b" /tmp/ft/ ;; esac
done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
OUT="$out/tests" timeout "${T_TESTS:-180}" bash tools/gpu/run_tests.sh /tmp/ft >"$out/tests.log" 2>&1
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout "${T_BENCH:-170}" /tmp/fb/minimax-bench --synthetic m2.7:iq4xs ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
echo "bench done at $(( $(date +%s) - t0 )) s (exit $?)"
OUT="$out/http" timeout "${T_HTTP:-100}" bash tools/gpu/http_bench.sh /tmp/fb --prefill "${HTTP_PREFILL:-512,8192,32768}" --stream-tokens 32 >"$out/http.log" 2>&1
echo "http done at $(( $(date +%s) - t0 )) s"
left=$(( ${T_ALL:-480} - ($(date +%s) - t0) ))
ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ "$left" -gt 40 ] && [ -n "$ncu_bin" ]; then
  timeout "$left" "$ncu_bin" --profile-from-start off --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    /tmp/fb/minimax-bench --synthetic m2.7:iq4xs:4 --check-layers 0 --nsys-replay 32 >"$out/ncu32.csv" 2>"$out/ncu32.err"
  python3 - "$out/ncu32.csv" <<'PY' >"$out/ncu32.txt" 2>&1
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit("no ncu rows")
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value")
tot = collections.defaultdict(float); cnt = collections.Counter()
for r in rows[1:]:
    try:
        v = float(r[vi].replace(",", ""))
    except ValueError:
        continue
    tot[r[ki]] += v; cnt[r[ki]] += 1
reps = 20
print(f"per replayed 32-token step of the 4-layer model (sum over {reps} replays / {reps}), ns:")
for k, v in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"  {k[:60]:<60} {v / reps:>12.0f} ns  {cnt[k] // reps:>4} launches")
PY
fi
echo "== summary =="
sed -n '/== GPU test results ==/,$p' "$out/tests.log" | grep -v " ok$"
grep -c " ok$" "$out/tests.log" | sed 's/^/tests ok: /'
grep -E "^\|" "$out/bench.log" | head -80
grep -E "decode batch|grouped gate/up|per-kernel split|^  " "$out/bench.log" | head -60
grep -E "^\||ready after" "$out/http.log"
cat "$out/ncu32.txt" 2>/dev/null | head -30
echo "total $(( $(date +%s) - t0 )) s"
