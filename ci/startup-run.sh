#!/usr/bin/env bash
# Issue 31's measurement, in two halves (docs/gpu-logs/issue31/): the builds on a CPU machine, the run on the GPU.
#   bash ci/startup-run.sh prepare [BEFORE_COMMIT]   # CPU: sm_90a builds of this tree (packed format) and of
#                                                    # BEFORE_COMMIT (default cb76d3d, format 1) into .gpu/*.tar.xz
#   bash ci/startup-run.sh device                    # GPU (device tool, carry [".gpu"]): logs under $OUT
# Device knobs, seconds per part (0 skips it): TT the GPU tests, TS bench/startup.py (SR runs, SF extra flags, e.g.
# --profile), TA bench/ab.py, TH bench/host_floor.py; IMPT=1 python -X importtime of cuda.bindings.driver.
# Each prepare build recompiles the 718 sm_90a entries unless its cache (.gpu/work) holds them: ~9 min on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
  set -e
  B=${2:-cb76d3d}; W=.gpu/work; PY=${PY:-.venv/bin/python}
  mkdir -p "$W" && rm -rf "$W/before" "$W/pk" && mkdir -p "$W/before" "$W/pk"
  $PY -m dsa_aot build --manifest manifests/default.toml --only 'sm_90a$' --out "$W/pk/gen" --work "$W/this" --cache "$W/cache" -j 2 --no-fidelity
  git archive "$B" | tar x -C "$W/before"
  (cd "$W/before" && "$OLDPWD/$PY" -m dsa_aot build --manifest manifests/default.toml --only 'sm_90a$' --out dsa_aot/_generated \
     --work "../wbefore" --cache "../cbefore" -j 2 --no-fidelity)
  tar cJf .gpu/gen90.tar.xz -C "$W/pk" gen
  tar cJf .gpu/before.tar.xz -C "$W/before" .
  rm -rf "$W/pk" "$W/before"; ls -la .gpu ;;
device)
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
  rm -rf dsa_aot/_generated /tmp/g /tmp/before; mkdir -p /tmp/g /tmp/before
  tar xJf .gpu/gen90.tar.xz -C /tmp/g && mv /tmp/g/gen dsa_aot/_generated && tar xJf .gpu/before.tar.xz -C /tmp/before || exit 1
  { nvidia-smi -L; git log --oneline -1; python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"; } > "$OUT/env.log" 2>&1
  cat "$OUT/env.log"
  if [ "${TT:-0}" != 0 ]; then timeout "$TT" python3 -m pytest -q -rs -m gpu tests/gpu > "$OUT/gpu-tests.log" 2>&1; echo "tests rc=$?"; tail -5 "$OUT/gpu-tests.log"; fi
  if [ "${TS:-0}" != 0 ]; then timeout "$TS" python3 bench/startup.py ${SF:-} --before /tmp/before --runs "${SR:-3}" > "$OUT/startup.txt" 2>&1
    echo "startup rc=$?"; grep '^|' "$OUT/startup.txt"; tail -8 "$OUT/startup.txt"; fi
  if [ "${IMPT:-0}" != 0 ]; then python3 -X importtime -c "import torch; torch.zeros(1, device='cuda'); import cuda.bindings.driver" 2> "$OUT/importtime.txt"
    sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -15; fi
  if [ "${TA:-0}" != 0 ]; then timeout "$TA" python3 bench/ab.py --before /tmp/before > "$OUT/ab.txt" 2>&1; echo "ab rc=$?"; tail -40 "$OUT/ab.txt"; fi
  if [ "${TH:-0}" != 0 ]; then timeout "$TH" python3 bench/host_floor.py > "$OUT/host_floor.txt" 2>&1; echo "host_floor rc=$?"; tail -40 "$OUT/host_floor.txt"; fi ;;
*) echo "usage: $0 prepare [BEFORE_COMMIT] | device" >&2; exit 2 ;;
esac
