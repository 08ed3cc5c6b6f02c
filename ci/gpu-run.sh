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
if want indexer; then
# 4. DSA indexer backward (SM90 path on the H200): JIT-vs-AOT parity (INDEXER_QUICK=1: S_q 1024 only), then the bench
rm -rf /tmp/parity-indexer
if [ -d "$HOME/dsl/site" ]; then
  PYTHONPATH=$PWD:$DSL python3 ci/parity_indexer.py jit --dir /tmp/parity-indexer ${INDEXER_QUICK:+--quick} 2>&1 | tee "$OUT/parity-indexer-jit.log"
  python3 ci/parity_indexer.py aot --dir /tmp/parity-indexer 2>&1 | tee "$OUT/parity-indexer-aot.log"
  python3 ci/parity_indexer.py compare --dir /tmp/parity-indexer 2>&1 | tee "$OUT/parity-indexer.log"; rc=$((rc | ${PIPESTATUS[0]}))
  cp /tmp/parity-indexer/parity.json "$OUT/parity-indexer.json" 2>/dev/null
  PYTHONPATH=$PWD:$DSL python3 bench/bench_indexer.py 2>&1 | tee "$OUT/bench-indexer.log"
else
  echo "no ~/dsl/site: indexer parity and the cudnn side of the indexer benchmark skipped" | tee "$OUT/parity-indexer.log"
  python3 bench/bench_indexer.py 2>&1 | tee "$OUT/bench-indexer.log"
fi
rm -rf /tmp/parity-indexer  # a few GB of saved inputs and outputs
fi
if want sparse; then
# 5. DSA sparse attention backward (SM90 path on the H200): JIT-vs-AOT parity (SPARSE_QUICK=1: 5 cases), then the bench
rm -rf /tmp/parity-sparse
if [ -d "$HOME/dsl/site" ]; then
  PYTHONPATH=$PWD:$DSL python3 ci/parity_sparse.py jit --dir /tmp/parity-sparse ${SPARSE_QUICK:+--quick} 2>&1 | tee "$OUT/parity-sparse-jit.log"
  python3 ci/parity_sparse.py aot --dir /tmp/parity-sparse 2>&1 | tee "$OUT/parity-sparse-aot.log"
  python3 ci/parity_sparse.py compare --dir /tmp/parity-sparse 2>&1 | tee "$OUT/parity-sparse.log"; rc=$((rc | ${PIPESTATUS[0]}))
  cp /tmp/parity-sparse/parity.json "$OUT/parity-sparse.json" 2>/dev/null
  PYTHONPATH=$PWD:$DSL python3 bench/bench_sparse.py 2>&1 | tee "$OUT/bench-sparse.log"
else
  echo "no ~/dsl/site: sparse parity and the cudnn side of the sparse benchmark skipped" | tee "$OUT/parity-sparse.log"
  python3 bench/bench_sparse.py 2>&1 | tee "$OUT/bench-sparse.log"
fi
rm -rf /tmp/parity-sparse  # a few GB of saved inputs and outputs
fi
exit $rc
