"""DSA sparse attention backward: time to first call and host cost per op call, dsa-aot vs cudnn's JIT path vs torch.add.

    python bench/dsa_sparse_attention_backward.py        # on a GPU machine; cudnn side runs only where cutlass and cudnn import

Shape: the seed repro, S_q = S_kv = 2048, H64, D512 (D_v 512), topk 512, attention sink, no
topk_length, bf16, default softmax scale; on the H200 upstream's SM90 path (zero the fp32 dKV
accumulator and d_sink, preprocess, main, postprocess). Inputs: ``ci/parity/dsa_sparse_attention_backward.make_inputs`` of the
parity's seed case (out / lse from a forward over the selected keys).

Each side's first call is measured in a fresh subprocess after torch, CUDA and the inputs are set up
(a warm process): import of the op module + cubin load (AOT) or JIT compile (cudnn) + launch + sync,
so caches of this process do not flatter it. Warm host cost: median over 25 rounds of 20 calls, the
device synchronised only between rounds (the device time of one call exceeds its host time, so long
rounds would fill the launch queue and measure the device instead); device time per call is measured
back to back with CUDA events. ``dq``, ``dkv`` and the workspace are given (cudnn's SM90 workspace
size); ``d_sink`` is allocated by the op on both sides, as upstream's wrapper does.

Also printed, from ``dsa_aot/_generated/report.json``: the CPU ``cute.compile`` seconds of the entries the
AOT call loaded (what a JIT pays on the CPU), next to AOT's first-call time. Without cudnn only the
AOT rows are printed. The subprocess runner, the import blocker of the AOT side, the timers and the
report.json lookup are bench/dsa_indexer_backward.py's.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dsa_indexer_backward as _bi  # noqa: E402  (the indexer bench: its report and scripts)

BLOCK = _bi.BLOCK
assert _bi.WARM.startswith(_bi.SETUP)
TIMERS = _bi.WARM[len(_bi.SETUP) :]  # rounds() / device() / torch.add yardstick, then SIDE
SHAPE = "S_q 2048 S_kv 2048 H64 D512 topk 512, sink, bf16"

SETUP = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.getcwd(), "ci", "parity"))
from dsa_sparse_attention_backward import SEED, case, make_inputs
dev = torch.device("cuda", 0)
_, spec = case(**SEED, label="seed-")
x, _ = make_inputs(spec, device="cuda")
S_q, S_kv, H, D = spec["s_q"], spec["s_kv"], spec["h"], spec["d"]
args = tuple(x[k].to(dev) for k in ("q", "kv", "out", "dout", "lse", "attn_sink", "topk_idxs"))
dq, dkv = torch.empty_like(args[0]), torch.empty_like(args[1])
r = lambda n, m: -(-n // m) * m
ws_bytes = 2 * r(r(S_q, 64) * H * 4, 128) + r(r(S_kv, 64) * r(D, 32) * 4, 128)  # cudnn's flash_attn_bwd_sm90_workspace_size
workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)
given = dict(dq=dq, dkv=dkv, workspace=workspace)
torch.cuda.synchronize()
"""

AOT_FIRST, JIT_FIRST = _bi.first_call_scripts(
    SETUP, "dsa_aot.dsa.sparse_attention_backward(*args, **given)",
    "from cudnn.deepseek_sparse_attention.sparse_attention_backward import sparse_attention_backward_wrapper",
    "sparse_attention_backward_wrapper(*args, **given)",
    "from cudnn.deepseek_sparse_attention.sparse_attention_backward._interface_sm90 import flash_attn_bwd_sm90 as f\n"
    "compiled = [repr(k) for c in (f.compile_cache_pre, f.compile_cache, f.compile_cache_post) for k in c]",
)

WARM = SETUP + TIMERS

AOT_WARM = WARM.replace("SIDE", BLOCK + r"""
import dsa_aot.dsa
fn = lambda: dsa_aot.dsa.sparse_attention_backward(*args, **given)
out_d["aot sparse_attention_backward (outputs + workspace given)"] = rounds(fn)
dev_d["aot sparse_attention_backward"] = device(fn)
out_d["aot sparse_attention_backward (allocates outputs + workspace)"] = rounds(lambda: dsa_aot.dsa.sparse_attention_backward(*args))
if hasattr(dsa_aot.dsa, "sparse_attention_backward_into"):
    d_sink = torch.empty_like(args[5])
    out_d["aot sparse_attention_backward_into"] = rounds(lambda: dsa_aot.dsa.sparse_attention_backward_into(dq, dkv, d_sink, *args, workspace=workspace))
""")

JIT_WARM = WARM.replace("SIDE", r"""
from cudnn.deepseek_sparse_attention.sparse_attention_backward import sparse_attention_backward_wrapper
fn = lambda: sparse_attention_backward_wrapper(*args, **given)
out_d["cudnn sparse_attention_backward_wrapper (outputs + workspace given)"] = rounds(fn)
dev_d["cudnn sparse_attention_backward_wrapper"] = device(fn)
out_d["cudnn sparse_attention_backward_wrapper (allocates outputs + workspace)"] = rounds(lambda: sparse_attention_backward_wrapper(*args))
""")

AOT_KEY = "aot sparse_attention_backward (outputs + workspace given)"
JIT_KEY = "cudnn sparse_attention_backward_wrapper (outputs + workspace given)"


def main():
    _bi.report("DSA sparse attention backward", SHAPE, (AOT_FIRST, AOT_WARM, JIT_FIRST, JIT_WARM), AOT_KEY, JIT_KEY)


if __name__ == "__main__":
    main()
