#!/usr/bin/env bash
# The GPU run on the H200 test machine (no package index there): GPU tests, then per kernel family the
# JIT-vs-AOT parity (ci/parity/<family>.py on ci/parity/harness.py) and the benchmark (bench/run.py <family>).
# Expects: dsa_aot/_generated built on a CPU machine (python -m dsa_aot build) and carried along; for the JIT
# side, the DSL chunks of ../shared/tools/dsl-chunks.sh already in ~/dsl (see docs/gpu-results.md).
# Logs go to $OUT (or ./gpu-logs).
#   PARITY="family ..."  families to run parity and bench for (default: every registered family;
#                        "none" for the tests only)
#   QUICK="family ..."   families whose parity runs its quick case list (--quick)
#   BENCH=0              parity only, no bench/run.py (a short device session)
#   TESTS=0              no GPU tests (run in an earlier call)
# A parity script exits 2 when its family has no kernel for this GPU (dsa_sparse_attention_forward is
# SM100 only): the family is reported not applicable and skipped, not failed.
set -uo pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
DSL="$HOME/dsl/site:$HOME/dsl/site/nvidia_cutlass_dsl/dsl_packages"
{ nvidia-smi -L; python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"; } 2>&1 | tee "$OUT/env.log"
rc=0
# 1. GPU tests of the AOT ops (cutlass is not on the path here)
if [ "${TESTS:-1}" != 0 ]; then python3 -m pytest -q -rs -m gpu tests/gpu 2>&1 | tee "$OUT/gpu-tests.log"; rc=$((rc | ${PIPESTATUS[0]})); fi
# 2. per family: JIT-vs-AOT parity (each side in its own process; the AOT side cannot import cutlass), then the bench
PARITY=${PARITY:-$(python3 -c "from dsa_aot.policy.families import FAMILIES; print(*FAMILIES)")}
QUICK=${QUICK:-}
for fam in $PARITY; do
  [ "$fam" = none ] && continue
  dir=/tmp/parity-$fam
  quick=""; case " $QUICK " in *" $fam "*) quick=--quick ;; esac
  rm -rf "$dir"
  if [ -d "$HOME/dsl/site" ]; then
    PYTHONPATH=$PWD:$DSL python3 ci/parity/$fam.py jit --dir "$dir" $quick 2>&1 | tee "$OUT/parity-$fam-jit.log"
    if [ "${PIPESTATUS[0]}" = 2 ]; then  # exit 2: the family has no kernel for this GPU (SM100-only families on the H200)
      echo "$fam: not applicable on this GPU (see parity-$fam-jit.log); parity and bench skipped" | tee "$OUT/parity-$fam.log"
      rm -rf "$dir"; continue
    fi
    python3 ci/parity/$fam.py aot --dir "$dir" 2>&1 | tee "$OUT/parity-$fam-aot.log"
    python3 ci/parity/$fam.py compare --dir "$dir" 2>&1 | tee "$OUT/parity-$fam.log"; rc=$((rc | ${PIPESTATUS[0]}))
    cp "$dir/parity.json" "$OUT/parity-$fam.json" 2>/dev/null
    [ "${BENCH:-1}" != 0 ] && PYTHONPATH=$PWD:$DSL python3 bench/run.py $fam 2>&1 | tee "$OUT/bench-$fam.log"
  else
    echo "no ~/dsl/site: $fam parity and the cudnn side of its benchmark skipped" | tee "$OUT/parity-$fam.log"
    python3 bench/run.py $fam 2>&1 | tee "$OUT/bench-$fam.log"  # exits 2 where the family has no kernel for this GPU
  fi
  rm -rf "$dir"  # a few GB of saved inputs and outputs
done
exit $rc
