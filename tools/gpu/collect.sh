#!/usr/bin/env bash
# Copies the newest prebuilt CUDA test binaries (every rank-worker/tests/cuda_*.rs, or the names
# given) and the rank/bench binaries into a git-ignored folder (default .devbin/), stripped, so
# the device tool can carry them to a GPU machine. Build first (see run_tests.sh).
#   tools/gpu/collect.sh [OUT_DIR] [TEST_NAME...]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.devbin}
shift || true
case "$out" in .devbin*) ;; *) echo "output folder must be .devbin* (git-ignored)" >&2; exit 2 ;; esac
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in rank-worker/tests/cuda_*.rs gateway/tests/engine_cuda.rs; do names+=("$(basename "$f" .rs)"); done
fi
mkdir -p "$out"
rm -f "$out"/cuda_* "$out"/engine_cuda
for t in "${names[@]}"; do
  f=$(ls -t target/release/deps/$t-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
  [ -n "$f" ] || { echo "no build of $t (cargo test --release --no-run --test $t)" >&2; continue; }
  cp "$f" "$out/$t"
  strip "$out/$t"
done
# The rank binary (multi-GPU tests spawn it) and the benchmark binary.
for b in minimax-rank minimax-bench minimax-gateway; do
  if [ -x "target/release/$b" ]; then
    cp "target/release/$b" "$out/" && strip "$out/$b"
  fi
done
ls -la "$out"
