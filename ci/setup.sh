#!/usr/bin/env bash
# Create a virtual environment with everything a build or the tests need (CPU only, no GPU).
# Usage: source ci/setup.sh [VENV]   (default .venv)
set -euo pipefail
VENV=${1:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: a plain 'torch' requirement could pull a multi-GB CUDA build
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q "nvidia-cutlass-dsl[cu13]==4.8.1" "apache-tvm-ffi==0.1.15.post2" "cuda-bindings>=12.8" \
  "scikit-build-core>=0.10" build pytest
# cudnn-frontend without its extras, so it cannot move the pins above
"$VENV/bin/python" -m pip install -q --no-deps "nvidia-cudnn-frontend==1.32.0"
"$VENV/bin/python" -m pip install -q "nvidia-cuda-cuobjdump" || true
