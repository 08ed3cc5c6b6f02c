#!/bin/bash
# zygote experiments: apply a perturbation to the clone, compile the entry through the compile stage, revert
cd /work/d576; source /work/main/.venv/bin/activate; export PYTHONPATH=/work/d576
ID=${ID:-'dsa_sparse_attention_backward.bwd_d576.nodeterministic.heads128.nosingle_query.nosplit.topk512.notopk_length.nowide.sm_100a'}
Z=dsa_aot/toolchain/zygote.py
run() { rm -rf /tmp/d576/z_$1; h=$(nice -n 10 python /tmp/d576/comp.py $ID /tmp/d576/z_$1 2>&1 | grep CUBIN); echo "ZEXP $1 $h"; git checkout -q -- dsa_aot; }
for v in "$@"; do
 case $v in
  base) ;;
  blank1) printf '\n' >> $Z ;;                             # one byte more at the end of zygote.py
  comment16) printf '# 0123456789abc\n' >> $Z ;;           # 16 bytes more
  samelen) sed -i '57s/every fork message allocates the same/EVERY FORK MESSAGE ALLOCATES THE SAME/' $Z ;;  # same length, other content
  leak*) n=${v#leak}; sed -i "s/^    t0 = time.perf_counter()\$/    import ctypes; ctypes.CDLL(None).malloc($n)\n    t0 = time.perf_counter()/" dsa_aot/toolchain/compile.py ;;
 esac
 git diff --stat | tail -1
 run $v
done
