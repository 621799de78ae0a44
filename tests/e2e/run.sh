#!/usr/bin/env bash
# End-to-end tests: real minimax-gateway + 2 CPU minimax-rank processes on the tiny fixture
# model, driven by the official `openai` Python package and raw HTTP. Bounded in time; the
# pytest fixture starts and stops the processes. Usage: tests/e2e/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."

jobs=${CARGO_BUILD_JOBS:-2}
venv=${E2E_VENV:-target/e2e-venv}

echo "== e2e: building gateway and rank =="
cargo build -j"$jobs" -p minimax-gateway -p minimax-rank --bins 2>&1 | tail -n 3

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import openai, anthropic, pytest" 2>/dev/null; then
  echo "== e2e: creating $venv =="
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r tests/e2e/requirements.txt
fi

export MINIMAX_E2E_GATEWAY=${MINIMAX_E2E_GATEWAY:-$PWD/target/debug/minimax-gateway}
export MINIMAX_E2E_RANK=${MINIMAX_E2E_RANK:-$PWD/target/debug/minimax-rank}
echo "== e2e: pytest =="
# Hard bound on the whole run; the fixture bounds every wait inside it.
exec timeout -k 10 900 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/e2e "$@"
