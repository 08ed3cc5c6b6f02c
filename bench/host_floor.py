"""Host cost per call at the floor: plans, functional ``_into`` and allocating forms against cudnn's
warm path, with the raw launch and ``torch.add`` of the same run (issue 12's table).

    python bench/host_floor.py [--rounds 3] [--calls 300]     # on a GPU; cudnn rows where cutlass and cudnn import

Every (side, case) runs in its own subprocess, the sides interleaved over ``--rounds`` rounds so that
drift on a shared machine hits both alike; the AOT side with the toolchain blocked. A call is timed
alone with perf_counter_ns (it only enqueues work); the device is synchronised every 20 calls, outside
the timing, so the launch queue never fills. The median per call over all rounds is printed.

Rows, AOT side: ``plan.execute`` (dsa_aot.csa.CompressorForward, ...), the functional ``_into`` op, the
allocating op; the floor: one ``cuLaunchKernelEx`` of the plan's first kernel with its prebuilt
config and parameters (the driver call every launch makes; through ctypes instead of cuda-python it
measured the same, 5.2 vs 5.0 us on the H200), and ``torch.add`` of two 1024-element tensors. cudnn side: its warm launch path with outputs given (CSA: ``run_fwd(_r128)`` /
``run_bwd(_r128)``, its public CSA wrappers refuse SM90; DSA: the public wrappers) and the same with
the torch allocations its wrappers make.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = r"""
import sys, json, time, math, os
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
from _harness import block_toolchain, per_call
if SIDE == "aot":
    block_toolchain()
import torch
dev = torch.device("cuda", 0)
torch.manual_seed(0)

rows = {}
"""

CSA_SETUP = r"""
R, d, coff, seqlen = RATIO, 128, 2, 8192
kv = torch.randn(seqlen, coff * d, device=dev).bfloat16()
score, ape = torch.randn_like(kv), torch.randn(R, coff * d, device=dev)
cu = torch.tensor([0, seqlen], device=dev, dtype=torch.int32)
cuc = torch.tensor([0, seqlen // R], device=dev, dtype=torch.int32)
nb = seqlen // R
out = torch.empty(nb, d, device=dev, dtype=torch.bfloat16)
go = torch.randn(nb, d, device=dev).bfloat16()
gkv, gs, gape = torch.empty_like(kv), torch.empty_like(score), torch.zeros_like(ape)
ws = torch.empty(64 << 20, dtype=torch.uint8, device=dev) if DET else None
"""

def _csa_forward(ratio):
    mod, fn = ("compressor_sm100_r128", "run_fwd_r128") if ratio == 128 else ("compressor_sm100", "run_fwd")
    return CSA_SETUP.replace("RATIO", str(ratio)).replace("DET", "False"), r"""
import dsa_aot.csa
P = dsa_aot.csa.CompressorForward(out, kv, score, ape, cu, cuc, ratio=R, coff=coff)
rows["plan.execute"] = lambda: P.execute(out, kv, score, ape, cu, cuc)
rows["functional _into"] = lambda: dsa_aot.csa.compressor_forward_into(out, kv, score, ape, cu, cuc, ratio=R, coff=coff)
rows["allocating"] = lambda: dsa_aot.csa.compressor_forward(kv, score, ape, cu, cuc, ratio=R, coff=coff, total_comp=nb)
""", f"""
from cudnn.csa.compressor.{mod} import {fn} as f
""" + r"""
rows["cudnn, outputs given"] = lambda: f(kv, score, ape, cu, cuc, out, nb, R, d, coff)
rows["cudnn, allocating"] = lambda: f(kv, score, ape, cu, cuc, torch.empty(nb, d, device=dev, dtype=torch.bfloat16), nb, R, d, coff)
"""


def _csa_backward(ratio, det):
    mod, fn = ("compressor_sm100_r128", "run_bwd_r128") if ratio == 128 else ("compressor_sm100", "run_bwd")
    return CSA_SETUP.replace("RATIO", str(ratio)).replace("DET", str(det)), r"""
import dsa_aot.csa
P = dsa_aot.csa.CompressorBackward(gkv, gs, gape, kv, score, ape, cu, cuc, go, ratio=R, coff=coff, deterministic=DET, workspace=ws)
rows["plan.execute"] = lambda: P.execute(gkv, gs, gape, kv, score, ape, cu, cuc, go, ws)
rows["functional _into"] = lambda: dsa_aot.csa.compressor_backward_into(gkv, gs, gape, kv, score, ape, cu, cuc, go, ratio=R, coff=coff, deterministic=DET,
                                                                    workspace=ws)
rows["allocating"] = lambda: dsa_aot.csa.compressor_backward(kv, score, ape, cu, cuc, go, ratio=R, coff=coff, deterministic=DET)
""".replace("DET", str(det)), f"""
from cudnn.csa.compressor.{mod} import {fn} as f
import dsa_aot.csa
need = dsa_aot.csa.backward_workspace_bytes(nb, R, d, coff) if {det} else 0
""" + r"""
rows["cudnn, outputs given"] = lambda: f(kv, score, ape, cu, cuc, go, gkv, gs, gape, nb, R, d, coff, deterministic=DET, workspace=ws)
rows["cudnn, allocating"] = lambda: f(kv, score, ape, cu, cuc, go, torch.empty_like(kv), torch.empty_like(score),
                                      torch.empty_like(ape) if DET else torch.zeros_like(ape), nb, R, d, coff, deterministic=DET,
                                      workspace=torch.empty(need, dtype=torch.uint8, device=dev) if DET else None)
""".replace("DET", str(det))


CASES = {
    "CSA forward r128": _csa_forward(128),
    "CSA forward r4": _csa_forward(4),
    "CSA backward r4 det": _csa_backward(4, True),
    "CSA backward r128 det": _csa_backward(128, True),
    "CSA backward r2 atomic": _csa_backward(2, False),
    "DSA indexer backward": (r"""
B, S_q, S_k, H, D, topk = 1, 4096, 4096, 64, 128, 512
q = (torch.randn(B, S_q, H, D, device=dev) * D**-0.25).bfloat16()
k = (torch.randn(B, S_k, D, device=dev) * D**-0.25).bfloat16()
w = (torch.randn(B, S_q, H, device=dev) / math.sqrt(H)).bfloat16()
idx = torch.rand(B * S_q, S_k, device=dev).topk(topk, dim=-1).indices.int().view(B, S_q, topk).contiguous()
att = torch.softmax(torch.randn(B, S_q, topk, device=dev), dim=-1).contiguous()
isc = torch.softmax(torch.randn(B, S_q, topk, device=dev), dim=-1).contiguous()
gl = torch.ones(1, device=dev)
dq, dw, dk = torch.empty_like(q), torch.empty_like(w), torch.empty_like(k)
ws = torch.empty(B * S_k * D * 4, dtype=torch.uint8, device=dev)
""", r"""
import dsa_aot.dsa
P = dsa_aot.dsa.IndexerBackward(dq, dw, dk, q, w, k, att, isc, idx, gl, 1.0, 1.0, workspace=ws)
rows["plan.execute"] = lambda: P.execute(dq, dw, dk, q, w, k, att, isc, idx, gl, ws)
rows["functional _into"] = lambda: dsa_aot.dsa.indexer_backward_into(dq, dw, dk, q, w, k, att, isc, idx, gl, 1.0, 1.0, workspace=ws)
rows["allocating"] = lambda: dsa_aot.dsa.indexer_backward(q, w, k, att, isc, idx, gl, sm_scale=1.0)
""", r"""
from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_wrapper as f
rows["cudnn, outputs given"] = lambda: f(q, w, k, att, isc, idx, gl, sm_scale=1.0, loss_coeff=1.0, d_index_q=dq, d_weights=dw, d_index_k=dk, workspace=ws)
rows["cudnn, allocating"] = lambda: f(q, w, k, att, isc, idx, gl, sm_scale=1.0)
"""),
    "DSA sparse attention backward": (r"""
sys.path.insert(0, os.path.join(ROOT, "ci", "parity"))
from dsa_sparse_attention_backward import SEED, case, make_inputs
_, spec = case(**SEED, label="seed-")
x, _ = make_inputs(spec, device="cuda")
S_q, S_kv, H, D = spec["s_q"], spec["s_kv"], spec["h"], spec["d"]
args = tuple(x[k].to(dev) for k in ("q", "kv", "out", "dout", "lse", "attn_sink", "topk_idxs"))
dq, dkv, d_sink = torch.empty_like(args[0]), torch.empty_like(args[1]), torch.empty_like(args[5])
r = lambda n, m: -(-n // m) * m
ws = torch.empty(2 * r(r(S_q, 64) * H * 4, 128) + r(r(S_kv, 64) * r(D, 32) * 4, 128), dtype=torch.uint8, device=dev)
""", r"""
import dsa_aot.dsa
P = dsa_aot.dsa.SparseAttentionBackward(dq, dkv, d_sink, *args, workspace=ws)
rows["plan.execute"] = lambda: P.execute(dq, dkv, d_sink, *args, workspace=ws)
rows["functional _into"] = lambda: dsa_aot.dsa.sparse_attention_backward_into(dq, dkv, d_sink, *args, workspace=ws)
rows["allocating"] = lambda: dsa_aot.dsa.sparse_attention_backward(*args)
""", r"""
from cudnn.deepseek_sparse_attention.sparse_attention_backward import sparse_attention_backward_wrapper as f
rows["cudnn, outputs given"] = lambda: f(*args, dq=dq, dkv=dkv, workspace=ws)
rows["cudnn, allocating"] = lambda: f(*args)
"""),
    "DSA indexer top-k": (r"""
n_rows, cols, K = 64, 8192, 2048
x = torch.randn(n_rows, cols, device=dev)
sl = torch.full((n_rows,), cols, dtype=torch.int32, device=dev)
idx, val = torch.empty(n_rows, K, dtype=torch.int32, device=dev), torch.empty(n_rows, K, device=dev)
""", r"""
import dsa_aot.dsa
ws = torch.empty(dsa_aot.dsa.indexer_top_k_workspace_bytes(x), dtype=torch.uint8, device=dev)
P = dsa_aot.dsa.IndexerTopK(idx, val, x, sl, K, workspace=ws)
rows["plan.execute"] = lambda: P.execute(idx, val, x, sl, ws)
rows["functional _into"] = lambda: dsa_aot.dsa.indexer_top_k_into(idx, val, x, sl, K, workspace=ws)
rows["allocating"] = lambda: dsa_aot.dsa.indexer_top_k(x, sl, K)
""", r"""
from cudnn.deepseek_sparse_attention.indexer_top_k import indexer_top_k_wrapper
rows["cudnn, allocating"] = lambda: indexer_top_k_wrapper(x, sl, K)
"""),
    "DSA local_to_global": (r"""
B, S_q, K, S_k = 2, 1024, 2048, 8192
local = torch.randint(0, S_k, (B, S_q, K), dtype=torch.int32, device=dev)
g = torch.empty_like(local)
""", r"""
import dsa_aot.dsa
P = dsa_aot.dsa.LocalToGlobal(g, local, S_k)
rows["plan.execute"] = lambda: P.execute(g, local)
rows["functional _into"] = lambda: dsa_aot.dsa.local_to_global_into(g, local, S_k)
rows["allocating"] = lambda: dsa_aot.dsa.local_to_global(local, S_k)
""", r"""
from cudnn.deepseek_sparse_attention.indexer_top_k import local_to_global_wrapper
rows["cudnn, allocating"] = lambda: local_to_global_wrapper(local, S_k)
"""),
    "DSA compactify": (r"""
rows_, cols = 4096, 2048
ids = torch.randint(-1, 8192, (rows_, cols), dtype=torch.int32, device=dev)
out, n = torch.empty_like(ids), torch.empty(rows_, dtype=torch.int32, device=dev)
""", r"""
import dsa_aot.dsa
P = dsa_aot.dsa.Compactify(out, n, ids)
rows["plan.execute"] = lambda: P.execute(out, n, ids)
rows["functional _into"] = lambda: dsa_aot.dsa.compactify_into(out, n, ids)
rows["allocating"] = lambda: dsa_aot.dsa.compactify(ids)
""", r"""
from cudnn.deepseek_sparse_attention.indexer_top_k import compactify_wrapper
rows["cudnn, allocating"] = lambda: compactify_wrapper(ids)
"""),
}


def _dense_score(attention):
    """The dense score recompute on SM90, BSHD (one KV head, 64 q heads, ratio 4): the transposed copy, a fill, the launch."""
    name, d, aux = ("attn", 512, "lse") if attention else ("indexer", 128, "weights")
    scale = "0.0625" if attention else "1.0"
    mk = "torch.randn(B, S_q, H, device=dev)" + ("" if attention else ".bfloat16()")
    return (rf"""
B, S_q, S_k, H, D = 1, 1024, 1024, 64, {d}
q, k = torch.randn(B, S_q, H, D, device=dev).bfloat16(), torch.randn(B, S_k, 1, D, device=dev).bfloat16()
aux = {mk}
out, den = torch.empty(B, S_q, S_k, device=dev), torch.empty(B, S_q, device=dev)
""", rf"""
import dsa_aot.dsa
ws = torch.empty(dsa_aot.dsa.dense_{name}_score_recompute_workspace_bytes(aux.shape), dtype=torch.uint8, device=dev)
P = dsa_aot.dsa.Dense{name.capitalize()}ScoreRecompute(out, den, q, k, aux, workspace=ws, {'softmax_scale' if attention else 'sm_scale'}={scale}, ratio=4)
rows["plan.execute"] = lambda: P.execute(out, den, q, k, aux, workspace=ws)
rows["functional _into"] = lambda: dsa_aot.dsa.dense_{name}_score_recompute_into(out, den, q, k, aux, {scale}, 4, workspace=ws)
rows["allocating"] = lambda: dsa_aot.dsa.dense_{name}_score_recompute(q, k, aux, {'' if attention else 'sm_scale='}{scale}, ratio=4)
""", rf"""
from cudnn.deepseek_sparse_attention.score_recompute import dense_{name}_score_recompute_wrapper as f
rows["cudnn, outputs given"] = lambda: f(q, k, aux, {'' if attention else 'sm_scale='}{scale}, out=out, denom_out=den, ratio=4)
rows["cudnn, allocating"] = lambda: f(q, k, aux, {'' if attention else 'sm_scale='}{scale}, ratio=4)
""")


CASES["DSA dense indexer score recompute"] = _dense_score(False)
CASES["DSA dense attention score recompute"] = _dense_score(True)

FLOOR = r"""
import dsa_aot.runtime.driver as _drv
E0 = P._call.run.__globals__["E0"]  # the plan's first entry, its launch state built by the calls above
_launch = _drv.drv().cuLaunchKernelEx
rows["floor: one cuLaunchKernelEx, prebuilt config"] = lambda: _launch(E0.cfgs[0], E0.funcs[0], E0._param_addrs[0], 0)
a, b = torch.randn(1024, device=dev), torch.randn(1024, device=dev)
rows["floor: torch.add (1024 elements)"] = lambda: torch.add(a, b)
"""

MEASURE = r"""
out_ns = {name: per_call(fn, CALLS) for name, fn in rows.items() if name.startswith(("plan", "functional", "allocating", "cudnn"))}
if SIDE == "aot":
""" + "".join("    " + line + "\n" for line in FLOOR.strip().splitlines()) + r"""
    out_ns.update({name: per_call(fn, CALLS) for name, fn in rows.items() if name.startswith("floor")})
print(json.dumps(out_ns))
"""


def run(side, case, calls, root=ROOT):
    """One (side, case) in a fresh process; ``root``: the source tree the AOT side imports dsa_aot from."""
    setup, aot_rows, jit_rows = CASES[case]
    code = f"ROOT = {root!r}\nSIDE = {'aot' if side.startswith('aot') else side!r}\nCALLS = {calls}\n" + PRELUDE + setup + (jit_rows if side == "cudnn" else aot_rows) + MEASURE
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    import importlib.util

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--before", metavar="ROOT", default=None,
                    help="another source tree (an earlier commit, with the same _generated build) measured interleaved as a third side: "
                         "the table then gives this tree's cost over that one's per row")
    a = ap.parse_args()
    cases = [c for c in CASES if c in a.cases.split(",")]
    sides = ["aot"] + (["aot@before"] if a.before else []) + (["cudnn"] if importlib.util.find_spec("cutlass") and importlib.util.find_spec("cudnn") else [])
    got, errors = {}, {}
    for _ in range(a.rounds):
        for case in cases:
            for side in sides:
                res = run(side, case, a.calls, os.path.abspath(a.before) if side == "aot@before" else ROOT)
                if side == "aot@before":
                    res = {f"before: {k}": v for k, v in res.items()} if "error" not in res else res
                if "error" in res:
                    errors[side, case] = res["error"]
                    continue
                for name, ns in res.items():
                    got.setdefault((case, name), []).extend(ns)
    med = {k: statistics.median(v) / 1e3 for k, v in got.items()}
    print(json.dumps({f"{c} | {n}": round(v, 2) for (c, n), v in med.items()} | {f"error {s} {c}": e for (s, c), e in errors.items()}, indent=1))
    print(f"\n| host us per call (median, {a.rounds} rounds x {a.calls} calls) | plan.execute | functional _into | allocating | "
          "cudnn, outputs given | cudnn, allocating | _into / cudnn given | allocating / cudnn allocating |")
    print("|---|" + "---:|" * 7)
    nan = float("nan")
    for c in cases:
        v = [med.get((c, n), nan) for n in ("plan.execute", "functional _into", "allocating", "cudnn, outputs given", "cudnn, allocating")]
        print(f"| {c} | " + " | ".join(f"{x:.1f}" for x in v) + f" | {v[1] / v[3]:.2f} | {v[2] / v[4]:.2f} |")
    print("\n| floor, in the AOT processes (median over every case) | host us per call |")
    print("|---|---:|")
    for n in ("floor: one cuLaunchKernelEx, prebuilt config", "floor: torch.add (1024 elements)"):
        vals = [x for (c, m), v in got.items() if m == n for x in v]
        if vals:
            print(f"| {n[len('floor: '):]} | {statistics.median(vals) / 1e3:.1f} |")
    if a.before:
        print(f"\n| host us per call, this tree vs --before {a.before} (same run, interleaved) | this tree | before | this / before |")
        print("|---|---:|---:|---:|")
        for c in cases:
            for n in ("plan.execute", "functional _into", "allocating"):
                x, y = med.get((c, n), nan), med.get((c, "before: " + n), nan)
                print(f"| {c}: {n} | {x:.2f} | {y:.2f} | {x / y:.3f} |")
    if errors:
        print("\nerrors:", json.dumps({f"{s} {c}": e for (s, c), e in errors.items()}, indent=1))


if __name__ == "__main__":
    main()
