"""DSA fused indexer forward + top-k: time to first call and host cost per op call, dsa-aot vs cudnn's JIT path vs torch.add.

    python bench/dsa_indexer_forward_top_k.py   # on an SM100 GPU machine; cudnn side runs only where cutlass and cudnn import

Upstream's fused op is SM100 only: on another GPU the bench says so and exits 2 (the H200 measures its
tail, stage 2 and local-to-global, in ci/parity/dsa_indexer_forward_top_k.py). Not yet run (no SM100
GPU here). Shapes: the DeepSeek-V3.2 indexer, H64 D128 bf16, ratio 4 over compressed keys, top-k 2048,
global ids, softmax (upstream's defaults):

* prefill: B 1, S_q 8192 queries over S_k 2048 compressed keys (one launch of each kernel);
* decode: B 64, S_q 1 (a batch of decode steps, causal offsets 8191) over S_k 2048.

cudnn's side is its public wrapper ``indexer_forward_top_k_wrapper`` (allocates the outputs and the
candidate buffer); the AOT side is ``dsa_aot.dsa.indexer_forward_top_k`` (the same) and
``indexer_forward_top_k_into`` (caller buffers). First calls in fresh subprocesses after torch, CUDA
and the inputs are set up; warm host cost the median over 25 rounds of 20 calls; device time back to
back with CUDA events. The runner, blocker and timers are bench/dsa_indexer_backward.py's.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dsa_indexer_backward as _bi  # noqa: E402  (the indexer bench: its runner, blocker, timers)
import dsa_indexer_forward as _fw  # noqa: E402  (its report: the same rows, prefill / decode, allocating / _into)
import dsa_sparse_attention_forward as _sf  # noqa: E402  (the SM100-only main)

BLOCK = _bi.BLOCK
TIMERS = _fw.TIMERS
SHAPE = "H64 D128 bf16, ratio 4, top-k 2048, global ids, softmax: prefill B 1 S_q 8192, decode B 64 S_q 1 (offsets 8191), S_k 2048"

SETUP = r"""
import torch
torch.manual_seed(0)
dev = torch.device("cuda", 0)
H, D, K, SK = 64, 128, 2048, 2048
pq = torch.randn(1, 8192, H, D, device=dev).bfloat16()
pk = torch.randn(1, SK, 1, D, device=dev).bfloat16()
pw = torch.randn(1, 8192, H, device=dev).bfloat16()
dq = torch.randn(64, 1, H, D, device=dev).bfloat16()
dk = torch.randn(64, SK, 1, D, device=dev).bfloat16()
dw = torch.randn(64, 1, H, device=dev).bfloat16()
doff = torch.full((64,), 8191, dtype=torch.int32, device=dev)
def outs(lead):
    return (torch.empty(*lead, K, dtype=torch.int32, device=dev), torch.empty(*lead, K, device=dev), torch.empty(*lead, K, device=dev))
pout, dout = outs((1, 8192)), outs((64, 1))
torch.cuda.synchronize()
"""

API = "cudnn.deepseek_sparse_attention.indexer_forward"
_COMPILED = ("import importlib\nm = importlib.import_module('cudnn.deepseek_sparse_attention.indexer_forward._compressed_top_k_sm100')\n"
             "s2 = importlib.import_module('cudnn.deepseek_sparse_attention.indexer_top_k.compress_top_k_sm100')\n"
             "compiled = [repr(k) for k in m._compile_cache] + [repr(k) for k in s2._compile_cache]")

FIRST = {
    "prefill": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.indexer_forward_top_k(pq, pk, pw, K)", f"from {API}.api import indexer_forward_top_k_wrapper",
                                      "indexer_forward_top_k_wrapper(pq, pk, pw, K)", _COMPILED),
    "decode": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.indexer_forward_top_k(dq, dk, dw, K, q_causal_offsets=doff)",
                                     f"from {API}.api import indexer_forward_top_k_wrapper",
                                     "indexer_forward_top_k_wrapper(dq, dk, dw, K, q_causal_offsets=doff)", _COMPILED),
}  # fmt: skip

WARM = SETUP + TIMERS

AOT_WARM = WARM.replace("SIDE", BLOCK + r"""
import dsa_aot.dsa
pcand = torch.empty(dsa_aot.dsa.compress_topk_cand_buffer_size(1, 8192, SK, 4), device=dev)
dcbo = dsa_aot.dsa.cand_batch_offsets(64, 1, 4, doff)
dcand = torch.empty(dsa_aot.dsa.compress_topk_cand_buffer_size(64, 1, SK, 4, q_causal_offsets=doff), device=dev)
out_d["aot prefill (allocates)"] = rounds(lambda: dsa_aot.dsa.indexer_forward_top_k(pq, pk, pw, K))
out_d["aot prefill _into"] = rounds(lambda: dsa_aot.dsa.indexer_forward_top_k_into(*pout, None, pcand, pq, pk, pw, K))
dev_d["aot prefill _into"] = device(lambda: dsa_aot.dsa.indexer_forward_top_k_into(*pout, None, pcand, pq, pk, pw, K))
out_d["aot decode (allocates)"] = rounds(lambda: dsa_aot.dsa.indexer_forward_top_k(dq, dk, dw, K, q_causal_offsets=doff, cand_buffer=dcand,
                                                                                cand_batch_offsets=dcbo))
out_d["aot decode _into"] = rounds(lambda: dsa_aot.dsa.indexer_forward_top_k_into(*dout, None, dcand, dq, dk, dw, K, q_causal_offsets=doff,
                                                                                cand_batch_offsets=dcbo))
dev_d["aot decode _into"] = device(lambda: dsa_aot.dsa.indexer_forward_top_k_into(*dout, None, dcand, dq, dk, dw, K, q_causal_offsets=doff,
                                                                                cand_batch_offsets=dcbo))
""")

JIT_WARM = WARM.replace("SIDE", rf"""
from {API}.api import indexer_forward_top_k_wrapper
from {API}._compressed_top_k_sm100 import compress_topk_cand_buffer_size, _bshd_cand_batch_offsets
dcbo = _bshd_cand_batch_offsets(64, 1, 4, doff)
dcand = torch.empty(compress_topk_cand_buffer_size(64, 1, SK, 4, q_causal_offsets=doff), device=dev)
out_d["cudnn prefill (allocates)"] = rounds(lambda: indexer_forward_top_k_wrapper(pq, pk, pw, K))
dev_d["cudnn prefill"] = device(lambda: indexer_forward_top_k_wrapper(pq, pk, pw, K))
out_d["cudnn decode (allocates)"] = rounds(lambda: indexer_forward_top_k_wrapper(dq, dk, dw, K, q_causal_offsets=doff, cand_buffer=dcand,
                                                                                 cand_batch_offsets=dcbo))
dev_d["cudnn decode"] = device(lambda: indexer_forward_top_k_wrapper(dq, dk, dw, K, q_causal_offsets=doff, cand_buffer=dcand,
                                                                     cand_batch_offsets=dcbo))
""")

KEYS = _fw.KEYS  # the same row names: prefill / decode, allocating / _into / cudnn


def main(argv=None):
    _sf.sm100_main(__doc__, argv, "fused indexer forward + top-k", FIRST, AOT_WARM, JIT_WARM, f"DSA fused indexer forward + top-k, {SHAPE}")


if __name__ == "__main__":
    main()
