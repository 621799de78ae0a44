#!/usr/bin/env bash
# Copies the newest prebuilt CUDA test binaries into .devbin/ (git-ignored), stripped, so the
# device tool can carry them to a GPU machine. Build first (see run_tests.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .devbin
rm -f .devbin/cuda_*
for t in cuda_kernels cuda_model cuda_nvrtc cuda_tensor; do
  f=$(ls -t target/release/deps/$t-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
  [ -n "$f" ] || { echo "no build of $t (cargo test --release --no-run --test $t)" >&2; continue; }
  cp "$f" ".devbin/$t"
  strip ".devbin/$t"
done
ls -la .devbin
# The rank binary (cuda_tensor spawns it; cargo build --release --bin minimax-rank).
if [ -x target/release/minimax-rank ]; then
  cp target/release/minimax-rank .devbin/ && strip .devbin/minimax-rank
fi
# The benchmark binary (cargo build --release --bin minimax-bench).
if [ -x target/release/minimax-bench ]; then
  cp target/release/minimax-bench .devbin/ && strip .devbin/minimax-bench
fi
ls -la .devbin
