#!/bin/bash
# the entry's spec compile in the trees before (1c2daa0: package aot; 3fa4360: dsa_aot), as they are and with the backend-process prototype
source /work/main/.venv/bin/activate
ID=${ID:-'dsa_sparse_attention_backward.bwd_d576.nodeterministic.heads128.nosingle_query.nosplit.topk512.notopk_length.nowide.sm_100a'}
for t in "$@"; do
  tree=${t%%:*}; mode=${t##*:}
  cd /tmp/d576/$tree; pkg=dsa_aot; [ -d aot ] && pkg=aot
  git checkout -q -- . ; rm -f $pkg/toolchain/backend.py
  if [ $mode = proto ]; then
    cp /work/d576/dsa_aot/toolchain/backend.py $pkg/toolchain/backend.py
    python3 - $pkg/toolchain/zygote.py <<'PY'
import sys
p=sys.argv[1]; s=open(p).read()
old='''        req = pickle.loads((io / f"req-{ticket}.pickle").read_bytes())\n'''
new=old+'''        from .backend import install  # the PTX compiler runs in a canonical process of its own (issue 30 prototype)\n\n        canon = str(canonical_dir())\n        install([p for p in sys.path if p.startswith(canon + "/s")], str(canonical_dir() / "be" / ticket))\n'''
assert old in s; open(p,'w').write(s.replace(old,new))
PY
  fi
  rm -rf /tmp/d576/o_$tree_$mode
  h=$(PKG=$pkg PYTHONPATH=/tmp/d576/$tree nice -n 10 python /tmp/d576/comp.py $ID /tmp/d576/o_${tree}_$mode 2>&1 | grep -E 'CUBIN|Error')
  echo "OLDEXP $tree $mode $(git log -1 --format=%h) $h"
  git checkout -q -- . ; rm -f $pkg/toolchain/backend.py
done
