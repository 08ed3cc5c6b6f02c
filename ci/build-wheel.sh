#!/usr/bin/env bash
# Set up (if needed) and build the wheel from manifests/default.toml (CPU only) into dist/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh .venv
rm -rf dist
# --no-build-isolation reuses the pinned toolchain of .venv instead of installing it again
.venv/bin/python -m pip wheel --no-build-isolation --no-deps -w dist .
ls -la dist
# no SM100 GPU runs the SM100 sparse-backward path: check the op's calls against the shipped launchers
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m zipfile -e dist/*.whl "$tmp"
.venv/bin/python ci/check_sm100_calls.py --gen "$tmp/dsa_aot/_generated"
