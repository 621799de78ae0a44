#!/usr/bin/env bash
# Compiles every CUDA kernel in kernels/ with NVRTC for sm_90 (Hopper) and sm_120 (Blackwell),
# on a machine without a GPU: NVRTC and the CUDA headers come from PyPI wheels installed into
# tools/nvrtc_check/.venv, and the check is the ignored test rank-worker/tests/cuda_nvrtc.rs.
# A kernel that does not compile fails this script (and CI).
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=tools/nvrtc_check/.venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r tools/nvrtc_check/requirements.txt
lib=$("$venv/bin/python" - <<'PY'
import os, nvidia
for base in nvidia.__path__:
    for sub in ("cu13/lib", "cuda_nvrtc/lib"):
        d = os.path.join(base, sub)
        if any(f.startswith("libnvrtc.so") for f in (os.listdir(d) if os.path.isdir(d) else [])):
            print(d); raise SystemExit
raise SystemExit("libnvrtc not found in the nvidia wheels")
PY
)
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cargo test -p minimax-rank -j"${CARGO_BUILD_JOBS:-2}" --test cuda_nvrtc -- --ignored --nocapture 2>&1
