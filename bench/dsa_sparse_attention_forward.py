"""DSA sparse attention forward: time to first call and host cost per op call, dsa-aot vs cudnn's JIT path vs torch.add.

    python bench/dsa_sparse_attention_forward.py   # on an SM100 GPU machine; cudnn side runs only where cutlass and cudnn import

Upstream has no SM90 kernel: on another GPU the bench says so and exits 2. Not yet run (no SM100 GPU
here). Shapes: H 64, D 576 (the MLA latent), bf16, top-k 2048 slots with indexer_topk 2048, a sink:

* prefill: S_q 4096 queries over S_kv 65536 latent rows;
* decode: S_q 64 queries (a batch of decode steps) over S_kv 65536.

cudnn's side is its public wrapper ``sparse_attention_forward_wrapper`` (allocates the four outputs);
the AOT side is ``dsa_aot.dsa.sparse_attention_forward`` (allocating) and ``sparse_attention_forward_into``.
First calls in fresh subprocesses after torch, CUDA and the inputs are set up; warm host cost the median
over 25 rounds of 20 calls; device time back to back with CUDA events. The runner, blocker and timers
are bench/dsa_indexer_backward.py's.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dsa_indexer_backward as _bi  # noqa: E402  (the indexer bench: its runner, blocker, timers)
import dsa_indexer_forward as _fw  # noqa: E402  (its report: the same rows, prefill / decode, allocating / _into)

BLOCK = _bi.BLOCK
TIMERS = _fw.TIMERS
SHAPE = "H64 D576 bf16, top-k 2048 (indexer_topk 2048), sink: prefill S_q 4096, decode S_q 64, S_kv 65536"

SETUP = r"""
import torch
torch.manual_seed(0)
dev = torch.device("cuda", 0)
H, D, K, SKV = 64, 576, 2048, 65536
kv = torch.randn(SKV, D, device=dev).bfloat16()
sink = torch.randn(H, device=dev)
pq = (torch.randn(4096, H, D, device=dev) * 0.05).bfloat16()
pidx = torch.randint(0, SKV, (4096, K), dtype=torch.int32, device=dev)
dq = (torch.randn(64, H, D, device=dev) * 0.05).bfloat16()
didx = torch.randint(0, SKV, (64, K), dtype=torch.int32, device=dev)
def outs(n):
    return (torch.empty(n, H, 512, dtype=torch.bfloat16, device=dev), *(torch.empty(n, H, device=dev) for _ in range(3)))
pout, dout = outs(4096), outs(64)
KW = dict(attn_sink=sink, indexer_topk=2048)
torch.cuda.synchronize()
"""

API = "cudnn.deepseek_sparse_attention.sparse_attention_forward"
_COMPILED = f"import importlib\ncompiled = [repr(k) for k in importlib.import_module('{API}._interface_sm100')._compile_cache]"

FIRST = {
    "prefill": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.sparse_attention_forward(pq, kv, pidx, **KW)", f"from {API}.api import sparse_attention_forward_wrapper",
                                      "sparse_attention_forward_wrapper(pq, kv, pidx, **KW)", _COMPILED),
    "decode": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.sparse_attention_forward(dq, kv, didx, **KW)", f"from {API}.api import sparse_attention_forward_wrapper",
                                     "sparse_attention_forward_wrapper(dq, kv, didx, **KW)", _COMPILED),
}  # fmt: skip

WARM = SETUP + TIMERS

AOT_WARM = WARM.replace("SIDE", BLOCK + r"""
import dsa_aot.dsa
out_d["aot prefill (allocates)"] = rounds(lambda: dsa_aot.dsa.sparse_attention_forward(pq, kv, pidx, **KW))
out_d["aot prefill _into"] = rounds(lambda: dsa_aot.dsa.sparse_attention_forward_into(*pout, pq, kv, pidx, **KW))
dev_d["aot prefill _into"] = device(lambda: dsa_aot.dsa.sparse_attention_forward_into(*pout, pq, kv, pidx, **KW))
out_d["aot decode (allocates)"] = rounds(lambda: dsa_aot.dsa.sparse_attention_forward(dq, kv, didx, **KW))
out_d["aot decode _into"] = rounds(lambda: dsa_aot.dsa.sparse_attention_forward_into(*dout, dq, kv, didx, **KW))
dev_d["aot decode _into"] = device(lambda: dsa_aot.dsa.sparse_attention_forward_into(*dout, dq, kv, didx, **KW))
""")

JIT_WARM = WARM.replace("SIDE", rf"""
from {API}.api import sparse_attention_forward_wrapper
out_d["cudnn prefill (allocates)"] = rounds(lambda: sparse_attention_forward_wrapper(pq, kv, pidx, **KW))
dev_d["cudnn prefill"] = device(lambda: sparse_attention_forward_wrapper(pq, kv, pidx, **KW))
out_d["cudnn decode (allocates)"] = rounds(lambda: sparse_attention_forward_wrapper(dq, kv, didx, **KW))
dev_d["cudnn decode"] = device(lambda: sparse_attention_forward_wrapper(dq, kv, didx, **KW))
""")

KEYS = _fw.KEYS  # the same row names: prefill / decode, allocating / _into / cudnn


def sm100_main(doc, argv, what, first, aot_warm, jit_warm, title):
    """The main of an SM100-only family's bench: on another GPU say so and exit 2, else measure and report."""
    import argparse
    import importlib.util
    import subprocess

    argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog="Runs every measurement in fresh subprocesses; no options.").parse_args(argv)
    major = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_capability()[0])"], capture_output=True, text=True)
    if major.stdout.strip() != "10":
        print(f"this GPU is not SM100 (capability major {major.stdout.strip() or '?'}): cudnn's {what} exists for SM100 only")
        sys.exit(2)
    have_jit = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cudnn") is not None
    _fw.report(_bi.measure_scripts(have_jit, first, aot_warm, jit_warm), have_jit, title)


def main(argv=None):
    sm100_main(__doc__, argv, "sparse attention forward", FIRST, AOT_WARM, JIT_WARM, f"DSA sparse attention forward, {SHAPE}")


if __name__ == "__main__":
    main()
