#!/usr/bin/env bash
# The project's one test command (README "Test"). Installs what the tests need on first use
# (Python tools go into tools/*/.venv), then runs every suite that needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}

echo "== installing grpcurl (rank health/reflection test) =="
MINIMAX_GRPCURL="$(tools/grpcurl/install.sh)"
export MINIMAX_GRPCURL

echo "== cargo test (workspace) =="
cargo test --workspace 2>&1

echo "== NVRTC: every CUDA kernel compiles for sm_90 and sm_120 =="
tools/nvrtc_check/run.sh

echo "== e2e: gateway + CPU ranks with the OpenAI SDK and raw HTTP =="
tests/e2e/run.sh

echo "== all suites passed =="
