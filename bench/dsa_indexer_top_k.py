"""DSA indexer top-k: time to first call and host cost per op call, dsa-aot vs cudnn's JIT path vs torch.add.

    python bench/dsa_indexer_top_k.py        # on a GPU machine; cudnn side runs only where cutlass and cudnn import

Shapes, float32 scores, top_k 2048, next_n 1, values returned, tie_break 0, not deterministic:

* decode: 64 rows x 65536 columns, seq_lens 60000 in every row (the small-occupancy kernel of
  bucket 65536);
* prefill: 4096 rows x 16384 columns, row t sees 12289 + t columns (the last 4096 queries of a causal
  16384-token prefill; the 512-thread large-occupancy kernel of bucket 16384).

cudnn's side is its public wrapper ``indexer_top_k_wrapper`` (allocates the outputs and the radix
scratch per call) and its class ``IndexerTopK(...)`` (check_support + compile once, then ``execute``
into the caller's outputs and workspace); the AOT side is ``dsa_aot.dsa.indexer_top_k`` (allocating),
``indexer_top_k_into`` (caller's buffers) and the plan ``dsa_aot.dsa.IndexerTopK(...).execute(...)``.

Each shape's first call is measured per side in a fresh subprocess after torch, CUDA and the inputs
are set up (a warm process): import of the op module + cubin load (AOT) or JIT compile (cudnn) +
launch + sync, so caches of this process do not flatter it. Warm host cost: median over 25 rounds of
20 calls, the device synchronised only between rounds; device time per call is measured back to back
with CUDA events (on the prefill shape the device time exceeds the host's: the host numbers are then
what a caller's thread pays, not the throughput). ``torch.add`` on 1024 elements is timed the same
way, in each side's process, as a yardstick.

Also printed, from the build's ``_build/report.json`` (when carried along): the CPU ``cute.compile``
seconds of the entries the AOT call loaded (what a JIT pays on the CPU), next to AOT's first-call time.
One table, the ratios of this run in its last rows. Without cudnn only the AOT rows are printed. The
subprocess runner, the import blocker of the AOT side, the timers and the report.json lookup are
bench/dsa_indexer_backward.py's.
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
SHAPE = "fp32, top_k 2048; decode 64 x 65536, seq_lens 60000; prefill 4096 x 16384, seq_lens 12289..16384"

SETUP = r"""
import torch
torch.manual_seed(0)
dev = torch.device("cuda", 0)
K = 2048
def shape(rows, cols, lens):
    x = torch.randn(rows, cols, device=dev)
    return dict(x=x, sl=lens.to(torch.int32).to(dev).contiguous(),
                idx=torch.empty(rows, K, dtype=torch.int32, device=dev), val=torch.empty(rows, K, device=dev),
                # the int32 radix scratch: rows x 2 (float32) x cols words, rounded up to 128 bytes (upstream's scratch_workspace_bytes)
                ws=torch.empty(-(-rows * 2 * cols * 4 // 128) * 128, dtype=torch.uint8, device=dev))
S = {"decode": shape(64, 65536, torch.full((64,), 60000)),
     "prefill": shape(4096, 16384, torch.arange(4096) + (16384 - 4096 + 1))}
torch.cuda.synchronize()
"""

TOPK = "cudnn.deepseek_sparse_attention.indexer_top_k"
COMPILED = f"import importlib\ncompiled = [repr(k) for k in importlib.import_module('{TOPK}.indexer_top_k_decode_varlen')._compile_cache]"

# (AOT, JIT) first-call scripts per shape
FIRST = {
    name: _bi.first_call_scripts(
        SETUP, f"dsa_aot.dsa.indexer_top_k(S['{name}']['x'], S['{name}']['sl'], K)", f"from {TOPK} import indexer_top_k_wrapper",
        f"indexer_top_k_wrapper(S['{name}']['x'], S['{name}']['sl'], K)", COMPILED,
    )
    for name in ("decode", "prefill")
}  # fmt: skip

WARM = SETUP + TIMERS

AOT_WARM = WARM.replace("SIDE", BLOCK + r"""
import dsa_aot.dsa
for nm, s in S.items():
    x, sl, idx, val, ws = s["x"], s["sl"], s["idx"], s["val"], s["ws"]
    alloc = lambda: dsa_aot.dsa.indexer_top_k(x, sl, K)
    into = lambda: dsa_aot.dsa.indexer_top_k_into(idx, val, x, sl, K, workspace=ws)
    plan = dsa_aot.dsa.IndexerTopK(idx, val, x, sl, K, workspace=ws)
    run = lambda: plan.execute(idx, val, x, sl, ws)
    out_d[f"{nm}: aot indexer_top_k (allocates)"] = rounds(alloc)
    out_d[f"{nm}: aot indexer_top_k_into"] = rounds(into)
    out_d[f"{nm}: aot IndexerTopK.execute (plan)"] = rounds(run)
    dev_d[f"{nm}: aot indexer_top_k (allocates)"] = device(alloc)
    dev_d[f"{nm}: aot indexer_top_k_into"] = device(into)
""")

JIT_WARM = WARM.replace("SIDE", rf"""
from {TOPK} import IndexerTopK, indexer_top_k_wrapper
for nm, s in S.items():
    x, sl, idx, val, ws = s["x"], s["sl"], s["idx"], s["val"], s["ws"]
    alloc = lambda: indexer_top_k_wrapper(x, sl, K)
    obj = IndexerTopK(x, sl, K)
    assert obj.check_support()
    obj.compile()
    run = lambda: obj.execute(x, sl, out_indices=idx, out_values=val, workspace=ws)
    out_d[f"{{nm}}: cudnn indexer_top_k_wrapper (allocates)"] = rounds(alloc)
    out_d[f"{{nm}}: cudnn IndexerTopK.execute (caller buffers)"] = rounds(run)
    dev_d[f"{{nm}}: cudnn indexer_top_k_wrapper (allocates)"] = device(alloc)
    dev_d[f"{{nm}}: cudnn IndexerTopK.execute (caller buffers)"] = device(run)
""")

# warm host keys per shape: AOT allocating, _into, plan; cudnn wrapper, class execute
KEYS = ("aot indexer_top_k (allocates)", "aot indexer_top_k_into", "aot IndexerTopK.execute (plan)",
        "cudnn indexer_top_k_wrapper (allocates)", "cudnn IndexerTopK.execute (caller buffers)")  # fmt: skip
_num = _bi._num


def measure(have_jit):
    """Every timing script in its own fresh process (bench/dsa_indexer_backward.measure_scripts)."""
    return _bi.measure_scripts(have_jit, FIRST, AOT_WARM, JIT_WARM)


def _ratio(a, b):
    return a / b if b == b and b else float("nan")


def report(res, have_jit):
    aw, jw = _bi.first_call_and_warm_rows(res, have_jit, f"DSA indexer top-k, {SHAPE}", FIRST)

    # the ratios of this run, in the same table
    ah, jh = aw.get("host", {}), jw.get("host", {})
    a_add, j_add = _num(ah, "torch.add"), _num(jh, "torch.add")
    for name in FIRST:
        a_alloc, a_into, a_plan, j_alloc, j_exec = (_num(ah if k.startswith("aot") else jh, f"{name}: {k}") for k in KEYS)
        a_first = _num(res[f"aot_first.{name}"], "first_ms")
        print(f"| {name}: ratio AOT warm host / torch.add: allocating, _into, plan | {_ratio(a_alloc, a_add):.2f}, {_ratio(a_into, a_add):.2f}, "
              f"{_ratio(a_plan, a_add):.2f} |")
        compile_s = res[f"cpu_compile_s.{name}"]
        if compile_s and a_first == a_first:
            print(f"| {name}: ratio CPU compile of the used entries / AOT first call | {sum(compile_s.values()) * 1e3 / a_first:.0f}x |")
        if have_jit:
            j_first = _num(res.get(f"jit_first.{name}", {}), "first_ms")
            print(f"| {name}: ratio first call cudnn / AOT | {_ratio(j_first, a_first):.0f}x |")
            print(f"| {name}: ratio warm host AOT / cudnn: allocating (aot / wrapper), _into / execute, plan / execute | "
                  f"{_ratio(a_alloc, j_alloc):.2f}, {_ratio(a_into, j_exec):.2f}, {_ratio(a_plan, j_exec):.2f} |")
            print(f"| {name}: ratio cudnn warm host / torch.add: wrapper, execute | {_ratio(j_alloc, j_add):.2f}, {_ratio(j_exec, j_add):.2f} |")


def main(argv=None):
    import argparse
    import importlib.util

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Runs every measurement in fresh subprocesses; no options.").parse_args(argv)
    have_jit = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cudnn") is not None
    report(measure(have_jit), have_jit)


if __name__ == "__main__":
    main()
