#!/usr/bin/env bash
# One call on a one-GPU machine for the opt-in experiments that wait for a GPU run (docs/CUDA.md
# "Next (speed)", "Waiting for a GPU run"): their correctness tests first, then their A/Bs,
# each under its own limit, a summary at the end.
#   tools/gpu/pending.sh ARCHIVE   (a .tar.xz of tools/gpu/collect.sh's folder incl. kcache/,
#                                   with cuda_prefill, cuda_attention, cuda_model, cuda_kernels
#                                   and minimax-bench)
# Limits (seconds): T_TESTS (150 for all tests), T_AB (100 for each benchmark call).
# Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
out=${OUT:-/tmp/minimax-pending}
mkdir -p "$out" /tmp/fb
tar xJf "${1:?ARCHIVE}" -C /tmp/fb
export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
mkdir -p /tmp/minimax-kernel-cache && cp -r /tmp/fb/kcache/. /tmp/minimax-kernel-cache/
export MINIMAX_KERNEL_CACHE=/tmp/minimax-kernel-cache
[ -e /work/main/fixtures ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
summary=()
# BIN FILTER...: one test binary's chosen tests (exact names), pass/fail into the summary.
run_tests() {
  local b=$1
  shift
  local left=$(( ${T_TESTS:-150} - ($(date +%s) - t0) ))
  [ "$left" -gt 5 ] || { summary+=("$b: skipped (test time spent)"); return; }
  (cd rank-worker && timeout "$left" "/tmp/fb/$b" --ignored --test-threads=1 --nocapture "$@") >"$out/$b.log" 2>&1
  local rc=$?
  summary+=("$b $*: exit $rc; $(grep -E '^test result' "$out/$b.log" | tail -1)")
}
run_tests cuda_prefill tma_grouped_gemm_matches_q8_twin_and_int8_kernels int8_gemm_speed
run_tests cuda_attention flash_attention_matches_f64_reference flash_attention_speed_at_m27_shapes
run_tests cuda_model fast_path_short_context_attention_matches_split_form
run_tests cuda_kernels memory_pool_keeps_or_returns_freed_memory fast_norm_router_and_qk_rope_match_cpu
# NAME ENV... -- BENCH ARGS: one benchmark call under T_AB with the environment given.
bench() {
  local name=$1
  shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" timeout "${T_AB:-100}" /tmp/fb/minimax-bench --synthetic "${BENCH_MODEL:-m2.7:iq4xs}" "$@" >"$out/bench_$name.log" 2>&1
  summary+=("bench $name: exit $?")
}
bench short_ab -- --short-ab
bench pool_ab -- --pool-ab
bench base MINIMAX_FLASH_SPLIT=0 -- --prefill-only --no-32k
for n in 2 3 4; do bench split$n MINIMAX_FLASH_SPLIT=$n -- --prefill-only --no-32k; done
bench gather MINIMAX_XG_GATHER=1 -- --prefill-only --no-32k

echo "== tests and A/Bs ($(( $(date +%s) - t0 )) s) =="
printf '%s\n' "${summary[@]}"
grep -hE "split [235]: max|keys split|flashdb, keys" "$out/cuda_attention.log" | head -20
grep -hE "grouped X of|unsplit short-context|pool keep|qk|FAILED|panicked" "$out"/cuda_*.log | head -10
grep -hE "A/B, batch 1" "$out/bench_short_ab.log"
grep -hE "^\| [0-9]|pool reserved" "$out/bench_pool_ab.log"
for f in base split2 split3 split4 gather; do
  echo "$f: $(grep -hE '^prefill (512|8192)( \(|:)' "$out/bench_$f.log" | tr '\n' ' ')"
done
