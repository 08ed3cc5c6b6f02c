#!/usr/bin/env bash
# The sharded build of .github/workflows/build-wheel.yml on one machine: N build processes (--jobs 1
# each) side by side, then merge and the wheel around the merged build. Usage: bash ci/build-sharded.sh [N]
# (AOT_MANIFEST picks another manifest; AOT_BALANCE an earlier build's <work>/report.json to split by its seconds;
# timings of each shard in _build-shards/shard-<i>.log).
# The compile zygotes of one canonical directory run one build at a time (dsa_aot/toolchain/zygote.py), so
# each shard here gets its own (AOT_CANONICAL_DIR): the layout-sensitive two-CTA kernels can then come
# out as another of their valid cubins than on a machine that uses the default path (docs/fidelity.md).
# The CI matrix runs each shard on its own machine at the default path: byte-identical to one build.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-4}
m=${AOT_MANIFEST:-manifests/default.toml}
bash ci/setup.sh .venv
rm -rf _build-shards && mkdir -p _build-shards
t0=$(date +%s)
for i in $(seq 1 "$n"); do
  AOT_CANONICAL_DIR="/tmp/dsa-aot-canonical-$(id -u)-s$i" .venv/bin/python -m dsa_aot build --manifest "$m" --shard "$i/$n" --jobs 1 \
    ${AOT_BALANCE:+--balance "$AOT_BALANCE"} \
    --out "_build-shards/partial-$i" --work "_build-shards/work-$i" > "_build-shards/shard-$i.log" 2>&1 &
done
fail=0
for job in $(jobs -p); do wait "$job" || fail=1; done
[ "$fail" = 0 ] || { tail -n 20 _build-shards/shard-*.log; exit 1; }
.venv/bin/python -m dsa_aot merge _build-shards/partial-* --manifest "$m" --out _build-shards/merged --work _build-shards/work-merged
rm -rf dist
AOT_PREBUILT=$PWD/_build-shards/merged AOT_MANIFEST="$m" .venv/bin/python -m pip wheel --no-build-isolation --no-deps -w dist .
echo "sharded build of $m: $n shards, $(( $(date +%s) - t0 )) s wall -> $(ls dist/*.whl)"
