#!/usr/bin/env bash
# The GPU run on the H200 test machine (no package index there): GPU tests, JIT-vs-AOT parity, bench.
# Expects: aot/_generated built on a CPU machine (python -m aot build) and carried along; the DSL
# chunks of ../shared/tools/dsl-chunks.sh already in ~/dsl (see docs/gpu-results.md for the calls).
# Logs go to $OUT (or ./gpu-logs).
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
DSL="$HOME/dsl/site:$HOME/dsl/site/nvidia_cutlass_dsl/dsl_packages"
{ nvidia-smi -L; python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"; } 2>&1 | tee "$OUT/env.log"
rc=0
# 1. GPU tests of the AOT ops (cutlass is not on the path here)
python3 -m pytest -q -rs -m gpu tests/gpu 2>&1 | tee "$OUT/gpu-tests.log"; rc=$((rc | ${PIPESTATUS[0]}))
# Parity and bench families to run (any of "csa", "indexer", "sparse"), e.g. to split the run over device calls.
PARITY=${PARITY:-"csa indexer sparse"}
want() { case " $PARITY " in *" $1 "*) return 0 ;; esac; return 1; }
if want csa; then
# 2. JIT-vs-AOT parity, each side in its own process
rm -rf /tmp/parity
if [ -d "$HOME/dsl/site" ]; then
  PYTHONPATH=$PWD:$DSL python3 ci/parity_csa.py jit --dir /tmp/parity 2>&1 | tee "$OUT/parity-jit.log"
  python3 ci/parity_csa.py aot --dir /tmp/parity 2>&1 | tee "$OUT/parity-aot.log"
  python3 ci/parity_csa.py compare --dir /tmp/parity 2>&1 | tee "$OUT/parity.log"; rc=$((rc | ${PIPESTATUS[0]}))
  # 3. first call and host cost per call, both sides, one run
  PYTHONPATH=$PWD:$DSL python3 bench/bench_csa.py 2>&1 | tee "$OUT/bench.log"
else
  echo "no ~/dsl/site: parity and the cudnn side of the benchmark skipped" | tee "$OUT/parity.log"
  python3 bench/bench_csa.py 2>&1 | tee "$OUT/bench.log"
fi
fi
# 4./5. DSA indexer backward and sparse attention backward (SM90 path on the H200): JIT-vs-AOT parity
# (INDEXER_QUICK=1 / SPARSE_QUICK=1: a few cases), then the bench. One family: dsa_family NAME QUICK
dsa_family() {
  local name=$1 quick=$2 dir=/tmp/parity-$1
  rm -rf "$dir"
  if [ -d "$HOME/dsl/site" ]; then
    PYTHONPATH=$PWD:$DSL python3 ci/parity_$name.py jit --dir "$dir" ${quick:+--quick} 2>&1 | tee "$OUT/parity-$name-jit.log"
    python3 ci/parity_$name.py aot --dir "$dir" 2>&1 | tee "$OUT/parity-$name-aot.log"
    python3 ci/parity_$name.py compare --dir "$dir" 2>&1 | tee "$OUT/parity-$name.log"; rc=$((rc | ${PIPESTATUS[0]}))
    cp "$dir/parity.json" "$OUT/parity-$name.json" 2>/dev/null
    PYTHONPATH=$PWD:$DSL python3 bench/bench_$name.py 2>&1 | tee "$OUT/bench-$name.log"
  else
    echo "no ~/dsl/site: $name parity and the cudnn side of its benchmark skipped" | tee "$OUT/parity-$name.log"
    python3 bench/bench_$name.py 2>&1 | tee "$OUT/bench-$name.log"
  fi
  rm -rf "$dir"  # a few GB of saved inputs and outputs
}
if want indexer; then dsa_family indexer "${INDEXER_QUICK:-}"; fi
if want sparse; then dsa_family sparse "${SPARSE_QUICK:-}"; fi
exit $rc
