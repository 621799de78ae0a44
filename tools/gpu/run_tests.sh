#!/usr/bin/env bash
# Runs the prebuilt CUDA test binaries on a GPU machine (no Rust toolchain needed there) and
# prints a pass/fail table. Build them on a dev machine first:
#   CARGO_PROFILE_RELEASE_DEBUG=0 cargo test -p minimax-rank --release --no-run \
#       --test cuda_kernels --test cuda_model
#   cargo test -p minimax-gateway --release --no-run --test engine_cuda   # a served CUDA rank
#   cargo build --release -p minimax-rank --bins
#   tools/gpu/collect.sh          # copies + strips them into .devbin/
# then, on the GPU machine, from the repository root:
#   tools/gpu/run_tests.sh [.devbin] [extra test-binary args...]
# Logs go to $OUT (if set) or /tmp/minimax-gpu-tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin_dir=${1:-.devbin}
shift || true
log_dir=${OUT:-/tmp/minimax-gpu-tests}
mkdir -p "$log_dir"
if [ -n "${CUDA_HOME:-}" ]; then
  export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# The test binaries find fixtures/ through the crate path baked in at build time
# (BUILD_ROOT, /work/main on the dev machines); link it to this checkout if it is missing.
build_root=${BUILD_ROOT:-/work/main}
if [ ! -e "$build_root/fixtures" ]; then
  mkdir -p "$(dirname "$build_root")" && ln -sfn "$PWD" "$build_root" || echo "warning: cannot link $build_root" >&2
fi
# Multi-GPU tests spawn rank processes from the same directory.
if [ -x "$bin_dir/minimax-rank" ]; then
  export MINIMAX_RANK_BIN="$(cd "$bin_dir" && pwd)/minimax-rank"
fi
# NCCL: cudarc loads libnccl.so; the image has NCCL as a Python wheel (libnccl.so.2 only), so
# link it under the name cudarc looks for. NVLink multicast stays off.
export NCCL_NVLS_ENABLE=0
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  nccl_so=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)
  [ -e "$nccl_so" ] || nccl_so=$(ls /usr/lib/x86_64-linux-gnu/libnccl.so.2 /usr/local/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2 /usr/local/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2 2>/dev/null | head -1 || true)
  if [ -n "$nccl_so" ] && [ -e "$nccl_so" ]; then
    mkdir -p /tmp/minimax-nccl && ln -sfn "$nccl_so" /tmp/minimax-nccl/libnccl.so
    export LD_LIBRARY_PATH="/tmp/minimax-nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
export MINIMAX_KERNEL_CACHE=${MINIMAX_KERNEL_CACHE:-/tmp/minimax-kernel-cache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"

table=()
fail=0
# engine_cuda (gateway/tests): the engine against a real CUDA rank process ($bin_dir/minimax-rank).
export MINIMAX_RANK_BINARY=${MINIMAX_RANK_BINARY:-$(cd "$bin_dir" && pwd)/minimax-rank}
for b in "$bin_dir"/cuda_* "$bin_dir"/engine_cuda; do
  [ -x "$b" ] || continue
  name=$(basename "$b")
  log="$log_dir/$name.log"
  start=$(date +%s)
  # Fixture paths are resolved from the crate directory baked in at build time; run from
  # rank-worker/ so relative fallbacks work too.
  b_abs="$(cd "$(dirname "$b")" && pwd)/$(basename "$b")"
  (cd rank-worker && "$b_abs" --ignored --test-threads=1 --nocapture "$@") >"$log" 2>&1
  rc=$?
  end=$(date +%s)
  # Test names from "test NAME ... " (output may follow on the same line with --nocapture);
  # failures from the list after the last "failures:"; no "test result:" line = crashed.
  failed_names=$(awk '/^failures:$/{f=1; delete a; next} f && /^    [^ ]+$/{print $1}' "$log" | sort -u)
  finished=$(grep -c '^test result:' "$log" || true)
  while read -r t; do
    [ -n "$t" ] || continue
    if [ "$finished" -eq 0 ]; then res=CRASHED
    elif grep -qx "$t" <<<"$failed_names"; then res=FAILED
    else res=ok; fi
    table+=("$name $t $res")
  done < <(sed -nE 's/^test ([^ ]+) \.\.\. .*/\1/p' "$log")
  # A binary that did not run at all (missing, wrong arch, crashed before any test) is a failure.
  if ! grep -qE '^test [^ ]+ \.\.\. ' "$log"; then
    table+=("$name (no-tests-ran) CRASHED")
  fi
  printf '%s: exit %d in %d s (log %s)\n' "$name" "$rc" "$((end - start))" "$log"
  [ "$rc" -eq 0 ] || fail=1
done

echo
echo "== measured =="
grep -hE '^(dequant|matvec|experts|rms_norm|rope|router|silu_mul|attention|m2-|NVIDIA|.*sm_[0-9]+)' "$log_dir"/*.log || true
echo
echo "== GPU test results =="
printf '%-14s %-62s %s\n' binary test result
pass=0; failed=0
for row in "${table[@]}"; do
  read -r bin test res <<<"$row"
  printf '%-14s %-62s %s\n' "${bin%%-*}" "$test" "$res"
  if [ "$res" = ok ]; then pass=$((pass + 1)); else failed=$((failed + 1)); fi
done
echo "$pass passed, $failed failed"
[ "$fail" -eq 0 ] && [ "$failed" -eq 0 ]
