"""DSA score recompute (sparse indexer and attention, dense indexer and attention): time to first call and host cost per op call, dsa-aot vs cudnn's JIT path vs torch.add.

    python bench/dsa_score_recompute.py        # on a GPU machine; cudnn side runs only where cutlass and cudnn import

Shapes: the indexer's predicted distribution of a training step, H 64, D 128, B 1, S_q 4096 queries
over S_k 4096 keys, top-k 2048 local ids, ``out`` given; and the attention's target over the same slots,
H 64, D 512, softmax_scale 512**-0.5. cudnn's side is its public wrappers
``sparse_indexer_score_recompute_wrapper`` / ``sparse_attn_score_recompute_wrapper`` (SM90 path: the
weights / LSE copied transposed, one launch); the AOT side is ``dsa_aot.dsa.sparse_*_score_recompute``
(out given, the workspace allocated per call) and ``_into`` (out and workspace given). The dense indexer:
H 64, B1, S_q 4096 over S_k 1024 keys (ratio 4), sm_scale 1/sqrt(128), ``out`` / ``denom_out`` given; the
dense attention the same at H64 D512, softmax_scale 512**-0.5. First call per side in a fresh subprocess after torch,
CUDA and the inputs are set up; warm host cost as bench/dsa_indexer_backward.py measures it (its
runner, import blocker and timers).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dsa_indexer_backward as _bi  # noqa: E402  (the indexer bench: its runner, blocker, timers)

BLOCK = _bi.BLOCK
assert _bi.WARM.startswith(_bi.SETUP)
TIMERS = _bi.WARM[len(_bi.SETUP) :]
SHAPE = "B1 S_q 4096 S_k 4096, top-k 2048; indexer H64 D128, attention H64 D512; dense S_k 1024 ratio 4"

SETUP = r"""
import torch
torch.manual_seed(0)
dev = torch.device("cuda", 0)
B, S_q, S_k, H, D, K = 1, 4096, 4096, 64, 128, 2048
q = (torch.randn(B, S_q, H, D, device=dev) * D**-0.25).bfloat16()
k = (torch.randn(B, S_k, D, device=dev) * D**-0.25).bfloat16()
w = (torch.randn(B, S_q, H, device=dev) / H**0.5).bfloat16()
ids = torch.rand(B * S_q, S_k, device=dev).topk(K, dim=-1).indices.int().view(B, S_q, K).contiguous()
out = torch.empty(B, S_q, K, device=dev)
workspace = torch.empty(-(-B * S_q * H * 2 // 128) * 128, dtype=torch.uint8, device=dev)  # the SM90 transposed weights
args = (q, k, w, ids)
DA, scale = 512, 512**-0.5
qa = torch.randn(B, S_q, H, DA, device=dev).bfloat16()
ka = torch.randn(B, S_k, DA, device=dev).bfloat16()
lse = (torch.rand(B, S_q, H, device=dev) * 2 + 7).contiguous()  # ~log(topk): O(1) probabilities
ws_a = torch.empty(-(-B * S_q * H * 4 // 128) * 128, dtype=torch.uint8, device=dev)  # the SM90 transposed LSE
args_a = (qa, ka, lse, ids, scale)
kd = (torch.randn(B, 1024, 1, D, device=dev) * 0.25).bfloat16()
logits_d, den_d = torch.empty(B, S_q, 1024, device=dev), torch.empty(B, S_q, device=dev)
kw_d = dict(sm_scale=128**-0.5, ratio=4)
kda = torch.randn(B, 1024, 1, DA, device=dev).bfloat16()
torch.cuda.synchronize()
"""

API = "cudnn.deepseek_sparse_attention.score_recompute"
_COMPILED = (f"import importlib\nm = importlib.import_module('{API}._interface_sm90')\n"
             f"compiled = [repr(k) for k in m._sparse_score_recompute.compile_cache]")

FIRST = {
    "sparse_indexer": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.sparse_indexer_score_recompute(*args, out=out)",
                                             f"from {API}.api import sparse_indexer_score_recompute_wrapper",
                                             "sparse_indexer_score_recompute_wrapper(*args, out=out)", _COMPILED),
    "sparse_attention": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.sparse_attn_score_recompute(*args_a, out=out)",
                                               f"from {API}.api import sparse_attn_score_recompute_wrapper",
                                               "sparse_attn_score_recompute_wrapper(*args_a, out=out)", _COMPILED),
    "dense_indexer": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.dense_indexer_score_recompute(q, kd, w, out=logits_d, denom_out=den_d, **kw_d)",
                                            f"from {API}.api import dense_indexer_score_recompute_wrapper",
                                            "dense_indexer_score_recompute_wrapper(q, kd, w, out=logits_d, denom_out=den_d, **kw_d)",
                                            _COMPILED.replace("_sparse_score_recompute", "_dense_score_recompute")),
    "dense_attention": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.dense_attn_score_recompute(qa, kda, lse, scale, out=logits_d, denom_out=den_d, ratio=4)",
                                              f"from {API}.api import dense_attn_score_recompute_wrapper",
                                              "dense_attn_score_recompute_wrapper(qa, kda, lse, scale, out=logits_d, denom_out=den_d, ratio=4)",
                                              _COMPILED.replace("_sparse_score_recompute", "_dense_score_recompute")),
}

WARM = SETUP + TIMERS

AOT_WARM = WARM.replace("SIDE", BLOCK + r"""
import dsa_aot.dsa
out_d["aot (out given)"] = rounds(lambda: dsa_aot.dsa.sparse_indexer_score_recompute(*args, out=out))
out_d["aot _into"] = rounds(lambda: dsa_aot.dsa.sparse_indexer_score_recompute_into(out, *args, workspace=workspace))
dev_d["aot _into"] = device(lambda: dsa_aot.dsa.sparse_indexer_score_recompute_into(out, *args, workspace=workspace))
out_d["attn aot (out given)"] = rounds(lambda: dsa_aot.dsa.sparse_attn_score_recompute(*args_a, out=out))
out_d["attn aot _into"] = rounds(lambda: dsa_aot.dsa.sparse_attn_score_recompute_into(out, *args_a, workspace=ws_a))
dev_d["attn aot _into"] = device(lambda: dsa_aot.dsa.sparse_attn_score_recompute_into(out, *args_a, workspace=ws_a))
out_d["dense aot (out given)"] = rounds(lambda: dsa_aot.dsa.dense_indexer_score_recompute(q, kd, w, out=logits_d, denom_out=den_d, **kw_d))
out_d["dense aot _into"] = rounds(lambda: dsa_aot.dsa.dense_indexer_score_recompute_into(logits_d, den_d, q, kd, w, workspace=workspace, **kw_d))
dev_d["dense aot _into"] = device(lambda: dsa_aot.dsa.dense_indexer_score_recompute_into(logits_d, den_d, q, kd, w, workspace=workspace, **kw_d))
out_d["dattn aot (out given)"] = rounds(lambda: dsa_aot.dsa.dense_attn_score_recompute(qa, kda, lse, scale, out=logits_d, denom_out=den_d, ratio=4))
out_d["dattn aot _into"] = rounds(lambda: dsa_aot.dsa.dense_attn_score_recompute_into(logits_d, den_d, qa, kda, lse, scale, 4, workspace=ws_a))
dev_d["dattn aot _into"] = device(lambda: dsa_aot.dsa.dense_attn_score_recompute_into(logits_d, den_d, qa, kda, lse, scale, 4, workspace=ws_a))
""")

JIT_WARM = WARM.replace("SIDE", rf"""
from {API}.api import (sparse_indexer_score_recompute_wrapper, sparse_attn_score_recompute_wrapper, dense_indexer_score_recompute_wrapper,
                       dense_attn_score_recompute_wrapper)
out_d["cudnn (out given)"] = rounds(lambda: sparse_indexer_score_recompute_wrapper(*args, out=out))
dev_d["cudnn"] = device(lambda: sparse_indexer_score_recompute_wrapper(*args, out=out))
out_d["attn cudnn (out given)"] = rounds(lambda: sparse_attn_score_recompute_wrapper(*args_a, out=out))
dev_d["attn cudnn"] = device(lambda: sparse_attn_score_recompute_wrapper(*args_a, out=out))
out_d["dense cudnn (out given)"] = rounds(lambda: dense_indexer_score_recompute_wrapper(q, kd, w, out=logits_d, denom_out=den_d, **kw_d))
dev_d["dense cudnn"] = device(lambda: dense_indexer_score_recompute_wrapper(q, kd, w, out=logits_d, denom_out=den_d, **kw_d))
out_d["dattn cudnn (out given)"] = rounds(lambda: dense_attn_score_recompute_wrapper(qa, kda, lse, scale, out=logits_d, denom_out=den_d, ratio=4))
dev_d["dattn cudnn"] = device(lambda: dense_attn_score_recompute_wrapper(qa, kda, lse, scale, out=logits_d, denom_out=den_d, ratio=4))
""")

_num = _bi._num


def measure(have_jit):
    """Every timing script in its own fresh process (bench/dsa_indexer_backward.measure_scripts)."""
    return _bi.measure_scripts(have_jit, FIRST, AOT_WARM, JIT_WARM)


def report(res, have_jit, title=f"DSA sparse score recompute, {SHAPE}"):
    aw, jw = _bi.first_call_and_warm_rows(res, have_jit, title, ["sparse_indexer", "sparse_attention", "dense_indexer", "dense_attention"])
    print()
    host = aw.get("host", {})
    a_add = _num(host, "torch.add")
    for op, pre in (("sparse_indexer", ""), ("sparse_attention", "attn "), ("dense_indexer", "dense "), ("dense_attention", "dattn ")):
        a_call, a_into = _num(host, f"{pre}aot (out given)"), _num(host, f"{pre}aot _into")
        print(f"{op}: AOT warm / torch.add: op {a_call / a_add:.2f}, _into {a_into / a_add:.2f}")
        if have_jit:
            a_first = _num(res[f"aot_first.{op}"], "first_ms")
            j_first, j_warm = _num(res.get(f"jit_first.{op}", {}), "first_ms"), _num(jw.get("host", {}), f"{pre}cudnn (out given)")
            print(f"{op}: ratio first call cudnn/AOT (this run): {j_first / a_first:.0f}x; warm host cost AOT/cudnn (this run): op "
                  f"{a_call / j_warm:.2f}, _into {a_into / j_warm:.2f} (cudnn/torch.add {j_warm / _num(jw.get('host', {}), 'torch.add'):.2f})")


def main(argv=None):
    import argparse
    import importlib.util

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Runs every measurement in fresh subprocesses; no options.").parse_args(argv)
    have_jit = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cudnn") is not None
    report(measure(have_jit), have_jit)


if __name__ == "__main__":
    main()
