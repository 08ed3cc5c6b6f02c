#!/usr/bin/env bash
# Set up (if needed) and run the test suite. GPU tests are marked and skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh .venv
.venv/bin/python -m pytest -q -rs tests "$@"
