"""DSA dense indexer backward: time to first call and host cost per op call, dsa-aot vs cudnn's JIT path vs torch.add.

    python bench/dsa_dense_indexer_backward.py        # on a GPU machine; cudnn side runs only where cutlass and cudnn import

Shape: a dense warm-up step of the compressed indexer, H 64, D 128, ratio 4, B 1, S_q 4096 against
S_k 1024 compressed keys, bf16 ``d_index_k`` (the fp32 accumulator in the caller's workspace),
sm_scale 1/sqrt(128). cudnn's side is its public wrapper ``dense_indexer_backward_wrapper`` (SM90 path:
zero fp32 dK, ScoreGradDenseSm90, IndexerBackwardSm90(is_dense=True), bf16 cast); the AOT side is
``dsa_aot.dsa.dense_indexer_backward`` (outputs and workspace given, as cudnn's) and ``_into``. Every call
overwrites ``index_score`` with the score-grad signal; the loops reuse that buffer (host and device
work do not depend on its values). First call per side in a fresh subprocess after torch, CUDA and the
inputs are set up; warm host cost as bench/dsa_indexer_backward.py measures it (its runner, import
blocker and timers).
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
SHAPE = "H64 D128 ratio 4, B1 S_q 4096 S_k 1024, bf16 dK"

SETUP = r"""
import torch
torch.manual_seed(0)
dev = torch.device("cuda", 0)
B, S_q, S_k, H, D, R = 1, 4096, 1024, 64, 128, 4
index_q = (torch.randn(B, S_q, H, D, device=dev) * D**-0.25).bfloat16()
index_k = (torch.randn(B, S_k, D, device=dev) * D**-0.25).bfloat16()
weights = (torch.randn(B, S_q, H, device=dev) / H**0.5).bfloat16()
index_score = torch.randn(B, S_q, S_k, device=dev)
index_lse = torch.logsumexp(index_score, -1)
attn_score = torch.rand(B, S_q, S_k, device=dev)
attn_l1norm = attn_score.sum(-1)
grad_loss = torch.ones(1, device=dev)
d_index_q, d_weights, d_index_k = torch.empty_like(index_q), torch.empty_like(weights), torch.empty_like(index_k)
workspace = torch.empty(-(-B * S_k * D * 4 // 128) * 128, dtype=torch.uint8, device=dev)
args = (index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss)
KW = dict(sm_scale=128 ** -0.5, ratio=R, d_index_q=d_index_q, d_weights=d_weights, d_index_k=d_index_k, workspace=workspace)
torch.cuda.synchronize()
"""

API = "cudnn.deepseek_sparse_attention.indexer_backward"
_COMPILED = (f"import importlib\nm = importlib.import_module('{API}.dense_indexer_backward_sm90')\n"
             f"compiled = [repr(k) for k in (*m._dense_compile_cache, *m._dense_score_grad_compile_cache)]")

FIRST = {
    "dense": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.dense_indexer_backward(*args, **KW)", f"from {API}.api import dense_indexer_backward_wrapper",
                                    "dense_indexer_backward_wrapper(*args, **KW)", _COMPILED),
}

WARM = SETUP + TIMERS

AOT_WARM = WARM.replace("SIDE", BLOCK + r"""
import dsa_aot.dsa
INTO = (d_index_q, d_weights, d_index_k, *args)
out_d["aot (outputs given)"] = rounds(lambda: dsa_aot.dsa.dense_indexer_backward(*args, **KW))
out_d["aot _into"] = rounds(lambda: dsa_aot.dsa.dense_indexer_backward_into(*INTO, sm_scale=KW["sm_scale"], ratio=R, workspace=workspace))
dev_d["aot _into"] = device(lambda: dsa_aot.dsa.dense_indexer_backward_into(*INTO, sm_scale=KW["sm_scale"], ratio=R, workspace=workspace))
""")

JIT_WARM = WARM.replace("SIDE", rf"""
from {API}.api import dense_indexer_backward_wrapper
out_d["cudnn (outputs given)"] = rounds(lambda: dense_indexer_backward_wrapper(*args, **KW))
dev_d["cudnn"] = device(lambda: dense_indexer_backward_wrapper(*args, **KW))
""")

_num = _bi._num


def measure(have_jit):
    """Every timing script in its own fresh process (bench/dsa_indexer_backward.measure_scripts)."""
    return _bi.measure_scripts(have_jit, FIRST, AOT_WARM, JIT_WARM)


def report(res, have_jit, title=f"DSA dense indexer backward, {SHAPE}"):
    aw, jw = _bi.first_call_and_warm_rows(res, have_jit, title, ["dense"])
    print()
    a_add = _num(aw.get("host", {}), "torch.add")
    a_first, a_call, a_into = _num(res["aot_first.dense"], "first_ms"), _num(aw.get("host", {}), "aot (outputs given)"), _num(aw.get("host", {}), "aot _into")
    print(f"AOT warm / torch.add: op {a_call / a_add:.2f}, _into {a_into / a_add:.2f}")
    if have_jit:
        j_first, j_warm, j_add = _num(res.get("jit_first.dense", {}), "first_ms"), _num(jw.get("host", {}), "cudnn (outputs given)"), _num(jw.get("host", {}), "torch.add")
        print(f"ratio first call cudnn/AOT (this run): {j_first / a_first:.0f}x; warm host cost AOT/cudnn (this run): op {a_call / j_warm:.2f}, "
              f"_into {a_into / j_warm:.2f} (cudnn/torch.add {j_warm / j_add:.2f})")


def main(argv=None):
    import argparse
    import importlib.util

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Runs every measurement in fresh subprocesses; no options.").parse_args(argv)
    have_jit = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cudnn") is not None
    report(measure(have_jit), have_jit)


if __name__ == "__main__":
    main()
