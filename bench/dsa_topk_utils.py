"""DSA top-k index utilities (local_to_global, compactify): time to first call and host cost per op call, dsa-aot vs cudnn's JIT path vs torch.add.

    python bench/dsa_topk_utils.py        # on a GPU machine; cudnn side runs only where cutlass and cudnn import

Shapes: local_to_global on (B1, S_q 4096, topk 2048) int32 local ids, seqlen_k 8192 ((B, S_q, K) ids,
no cu_seqlens); compactify on 4096 rows x 2048 int32 ids; a quarter of the ids -1 in both. cudnn's
side is its public wrappers ``local_to_global_wrapper`` / ``compactify_wrapper``, which allocate their
outputs (upstream has no form that takes them); the AOT side is timed in both its allocating and its
``_into`` form.

Each op's first call is measured per side in a fresh subprocess after torch, CUDA and the inputs are
set up (a warm process): import of the op module + cubin load (AOT) or JIT compile (cudnn) + launch +
sync, so caches of this process do not flatter it. Warm host cost: median over 25 rounds of 20 calls,
the device synchronised only between rounds; device time per call is measured back to back with CUDA
events. ``torch.add`` on 1024 elements is timed the same way, in each side's process, as a yardstick.

Also printed, from the build's ``_build/report.json`` (when carried along): the CPU ``cute.compile``
seconds of the entries the AOT call loaded (what a JIT pays on the CPU), next to AOT's first-call time.
Without cudnn only the AOT rows are printed. The subprocess runner, the import blocker of the AOT side,
the timers and the report.json lookup are bench/dsa_indexer_backward.py's.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dsa_indexer_backward as _bi  # noqa: E402  (the indexer bench: its runner, blocker, timers)

BLOCK = _bi.BLOCK
assert _bi.WARM.startswith(_bi.SETUP)
TIMERS = _bi.WARM[len(_bi.SETUP) :]  # rounds() / device() / torch.add yardstick, then SIDE
SHAPE = "local_to_global B1 S_q 4096 topk 2048 int32, seqlen_k 8192; compactify 4096 x 2048 int32; 25 % -1 ids"

SETUP = r"""
import torch
torch.manual_seed(0)
dev = torch.device("cuda", 0)
B, S_q, K, S_k, ROWS, COLS = 1, 4096, 2048, 8192, 4096, 2048
def ids(shape, hi):
    x = torch.randint(0, hi, shape, dtype=torch.int32, device=dev)
    return torch.where(torch.rand(shape, device=dev) < 0.25, torch.full_like(x, -1), x).contiguous()
local = ids((B, S_q, K), S_k)              # local top-k ids, (B, S_q, K)
cmp_in = ids((ROWS, COLS), B * S_k)       # global ids to compact, (rows, cols)
gidx = torch.empty(local.shape, dtype=torch.int32, device=dev)
cmp_out, cmp_len = torch.empty_like(cmp_in), torch.empty(ROWS, dtype=torch.int32, device=dev)
torch.cuda.synchronize()
"""

TOPK = "cudnn.deepseek_sparse_attention.indexer_top_k"

# (AOT, JIT) first-call scripts per op
FIRST = {
    "local_to_global": _bi.first_call_scripts(
        SETUP, "dsa_aot.dsa.local_to_global(local, S_k)", f"from {TOPK} import local_to_global_wrapper", "local_to_global_wrapper(local, S_k)",
        f"import importlib\ncompiled = [repr(k) for k in importlib.import_module('{TOPK}.local_to_global_dsl')._compile_cache]",
    ),
    "compactify": _bi.first_call_scripts(
        SETUP, "dsa_aot.dsa.compactify(cmp_in)", f"from {TOPK} import compactify_wrapper", "compactify_wrapper(cmp_in)",
        f"import importlib\ncompiled = [repr(k) for k in importlib.import_module('{TOPK}.compactify')._compile_cache]",
    ),
}  # fmt: skip

WARM = SETUP + TIMERS

AOT_WARM = WARM.replace("SIDE", BLOCK + r"""
import dsa_aot.dsa
out_d["aot local_to_global (allocates)"] = rounds(lambda: dsa_aot.dsa.local_to_global(local, S_k))
out_d["aot local_to_global_into"] = rounds(lambda: dsa_aot.dsa.local_to_global_into(gidx, local, S_k))
dev_d["aot local_to_global_into"] = device(lambda: dsa_aot.dsa.local_to_global_into(gidx, local, S_k))
out_d["aot compactify (allocates)"] = rounds(lambda: dsa_aot.dsa.compactify(cmp_in))
out_d["aot compactify_into"] = rounds(lambda: dsa_aot.dsa.compactify_into(cmp_out, cmp_len, cmp_in))
dev_d["aot compactify_into"] = device(lambda: dsa_aot.dsa.compactify_into(cmp_out, cmp_len, cmp_in))
""")

JIT_WARM = WARM.replace("SIDE", rf"""
from {TOPK} import compactify_wrapper, local_to_global_wrapper
out_d["cudnn local_to_global_wrapper (allocates)"] = rounds(lambda: local_to_global_wrapper(local, S_k))
dev_d["cudnn local_to_global_wrapper"] = device(lambda: local_to_global_wrapper(local, S_k))
out_d["cudnn compactify_wrapper (allocates)"] = rounds(lambda: compactify_wrapper(cmp_in))
dev_d["cudnn compactify_wrapper"] = device(lambda: compactify_wrapper(cmp_in))
""")

# per op: (AOT allocating, AOT _into, cudnn) keys of the warm host table
KEYS = {
    "local_to_global": ("aot local_to_global (allocates)", "aot local_to_global_into", "cudnn local_to_global_wrapper (allocates)"),
    "compactify": ("aot compactify (allocates)", "aot compactify_into", "cudnn compactify_wrapper (allocates)"),
}
_num = _bi._num


def measure(have_jit):
    """Every timing script in its own fresh process (bench/dsa_indexer_backward.measure_scripts)."""
    return _bi.measure_scripts(have_jit, FIRST, AOT_WARM, JIT_WARM)


def report(res, have_jit):
    aw, jw = _bi.first_call_and_warm_rows(res, have_jit, f"DSA top-k utils, {SHAPE}", FIRST)

    print()
    a_add = _num(aw.get("host", {}), "torch.add")
    j_add = _num(jw.get("host", {}), "torch.add")
    for op, (k_alloc, k_into, k_jit) in KEYS.items():
        af = res[f"aot_first.{op}"]
        a_first, a_alloc, a_into = _num(af, "first_ms"), _num(aw.get("host", {}), k_alloc), _num(aw.get("host", {}), k_into)
        compile_s = res[f"cpu_compile_s.{op}"]
        line = f"{op}: AOT warm / torch.add: allocating {a_alloc / a_add:.2f}, _into {a_into / a_add:.2f}"
        if compile_s and a_first == a_first:
            line += f"; CPU compile of the used entries / AOT first call {sum(compile_s.values()) * 1e3 / a_first:.0f}x"
        print(line)
        if have_jit:
            j_first, j_warm = _num(res.get(f"jit_first.{op}", {}), "first_ms"), _num(jw.get("host", {}), k_jit)
            print(f"{op}: ratio first call cudnn/AOT (this run): {j_first / a_first:.0f}x; warm host cost AOT/cudnn (this run): "
                  f"allocating {a_alloc / j_warm:.2f}, _into {a_into / j_warm:.2f} (cudnn/torch.add {j_warm / j_add:.2f})")


def main(argv=None):
    import argparse
    import importlib.util

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Runs every measurement in fresh subprocesses; no options.").parse_args(argv)
    have_jit = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cudnn") is not None
    report(measure(have_jit), have_jit)


if __name__ == "__main__":
    main()
