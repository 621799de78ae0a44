#!/usr/bin/env bash
# The project's one test command (README "Test"). Installs what the tests need on first use
# (Python tools go into tools/*/.venv), then runs every suite that needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
jobs=${CARGO_BUILD_JOBS:-2}

echo "== cargo test (workspace) =="
cargo test --workspace -j"$jobs" 2>&1

echo "== all suites passed =="
