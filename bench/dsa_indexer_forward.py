"""DSA indexer forward: time to first call and host cost per op call, dsa-aot vs cudnn's JIT path vs torch.add.

    python bench/dsa_indexer_forward.py        # on a GPU machine; cudnn side runs only where cutlass and cudnn import

Shapes (H 64 query heads, D 128, ratio 4, sm_scale 1/sqrt(128)):

* prefill: bf16 q / k, bf16 W, B 1, S_q 4096 against S_k 1024 compressed keys (scores 16 MiB);
* decode: fp8 q / k with fp32 per-token descales, bf16 W, B 8 sequences of 2 new tokens against
  S_k 4096 compressed keys, ``q_causal_offsets`` placing the tokens at the end of their context.

cudnn's side is its public wrapper ``indexer_forward_wrapper`` (SM90 path: allocates the scores,
fills them with -inf, launches); the AOT side is ``dsa_aot.dsa.indexer_forward`` (allocating) and
``indexer_forward_into`` (caller's scores). Each shape's first call is measured per side in a fresh
subprocess after torch, CUDA and the inputs are set up: import of the op module + cubin load (AOT) or
JIT compile (cudnn) + launch + sync. Warm host cost: median over 25 rounds of 20 calls, the device
synchronised only between rounds; device time per call back to back with CUDA events (on the prefill
shape the device time exceeds the host's). ``torch.add`` is timed the same way in each side's process
as a yardstick. The subprocess runner, the import blocker of the AOT side, the timers and the
report.json lookup are bench/dsa_indexer_backward.py's.
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
SHAPE = "H64 D128 ratio 4: prefill bf16 B1 S_q 4096 S_k 1024; decode fp8 B8 S_q 2 S_k 4096 with causal offsets"

SETUP = r"""
import torch
torch.manual_seed(0)
dev = torch.device("cuda", 0)
H, D, R, SC = 64, 128, 4, 128 ** -0.5
pq = (torch.randn(1, 4096, H, D, device=dev) * 0.25).bfloat16()
pk = (torch.randn(1, 1024, 1, D, device=dev) * 0.25).bfloat16()
pw = (torch.randn(1, 4096, H, device=dev) * 0.5).bfloat16()
dq = torch.randn(8, 2, H, D, device=dev).to(torch.float8_e4m3fn)
dk = torch.randn(8, 4096, 1, D, device=dev).to(torch.float8_e4m3fn)
dw = (torch.randn(8, 2, H, device=dev) * 0.5).bfloat16()
dqs = torch.rand(8, 2, H, device=dev) * 0.05 + 0.01
dks = torch.rand(8, 4096, 1, device=dev) * 0.05 + 0.01
doff = torch.full((8,), 4096 * R - 2, dtype=torch.int32, device=dev)
pscores = torch.empty(1, 4096, 1024, device=dev)
dscores = torch.empty(8, 2, 4096, device=dev)
PKW = dict(sm_scale=SC)
DKW = dict(sm_scale=SC, precision="fp8", q_scale=dqs, k_scale=dks, q_causal_offsets=doff)
torch.cuda.synchronize()
"""

API = "cudnn.deepseek_sparse_attention.indexer_forward"
_COMPILED = f"import importlib\ncompiled = [repr(k) for k in importlib.import_module('{API}._interface_sm90')._compile_cache]"

FIRST = {
    "prefill": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.indexer_forward(pq, pk, pw, R, **PKW)", f"from {API}.api import indexer_forward_wrapper",
                                      "indexer_forward_wrapper(pq, pk, pw, R, **PKW)", _COMPILED),
    "decode": _bi.first_call_scripts(SETUP, "dsa_aot.dsa.indexer_forward(dq, dk, dw, R, **DKW)", f"from {API}.api import indexer_forward_wrapper",
                                     "indexer_forward_wrapper(dq, dk, dw, R, **DKW)", _COMPILED),
}  # fmt: skip

WARM = SETUP + TIMERS

AOT_WARM = WARM.replace("SIDE", BLOCK + r"""
import dsa_aot.dsa
out_d["aot prefill (allocates)"] = rounds(lambda: dsa_aot.dsa.indexer_forward(pq, pk, pw, R, **PKW))
out_d["aot prefill _into"] = rounds(lambda: dsa_aot.dsa.indexer_forward_into(pscores, None, pq, pk, pw, R, **PKW))
dev_d["aot prefill _into"] = device(lambda: dsa_aot.dsa.indexer_forward_into(pscores, None, pq, pk, pw, R, **PKW))
out_d["aot decode (allocates)"] = rounds(lambda: dsa_aot.dsa.indexer_forward(dq, dk, dw, R, **DKW))
out_d["aot decode _into"] = rounds(lambda: dsa_aot.dsa.indexer_forward_into(dscores, None, dq, dk, dw, R, **DKW))
dev_d["aot decode _into"] = device(lambda: dsa_aot.dsa.indexer_forward_into(dscores, None, dq, dk, dw, R, **DKW))
""")

JIT_WARM = WARM.replace("SIDE", rf"""
from {API}.api import indexer_forward_wrapper
out_d["cudnn prefill (allocates)"] = rounds(lambda: indexer_forward_wrapper(pq, pk, pw, R, **PKW))
dev_d["cudnn prefill"] = device(lambda: indexer_forward_wrapper(pq, pk, pw, R, **PKW))
out_d["cudnn decode (allocates)"] = rounds(lambda: indexer_forward_wrapper(dq, dk, dw, R, **DKW))
dev_d["cudnn decode"] = device(lambda: indexer_forward_wrapper(dq, dk, dw, R, **DKW))
""")

KEYS = {
    "prefill": ("aot prefill (allocates)", "aot prefill _into", "cudnn prefill (allocates)"),
    "decode": ("aot decode (allocates)", "aot decode _into", "cudnn decode (allocates)"),
}
_num = _bi._num


def measure(have_jit):
    """Every timing script in its own fresh process (bench/dsa_indexer_backward.measure_scripts)."""
    return _bi.measure_scripts(have_jit, FIRST, AOT_WARM, JIT_WARM)


def report(res, have_jit, title=f"DSA indexer forward, {SHAPE}"):
    aw, jw = _bi.first_call_and_warm_rows(res, have_jit, title, [k.split(".", 1)[1] for k in res if k.startswith("aot_first.")])
    print()
    a_add, j_add = _num(aw.get("host", {}), "torch.add"), _num(jw.get("host", {}), "torch.add")
    for op, (k_alloc, k_into, k_jit) in KEYS.items():
        a_first, a_alloc, a_into = _num(res[f"aot_first.{op}"], "first_ms"), _num(aw.get("host", {}), k_alloc), _num(aw.get("host", {}), k_into)
        print(f"{op}: AOT warm / torch.add: allocating {a_alloc / a_add:.2f}, _into {a_into / a_add:.2f}")
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
