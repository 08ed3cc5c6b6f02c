"""Where a plan.execute's microseconds go: each step of ``execute`` timed on its own (median per call over
2000 calls, the device synchronised every 20), for the CSA forward r128 and the indexer backward of
bench/host_floor.py, with the driver floor and torch.add of the same process. Prints the plans' code too.

    python bench/plan_profile.py        # on a GPU; the toolchain is blocked from importing
"""
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import block_toolchain, per_call  # noqa: E402  (bench/, this script's directory)

block_toolchain()
import torch  # noqa: E402
import aot.csa, aot.dsa
from aot.ops._support import recheck, stream_handle, memset0
dev = torch.device("cuda", 0)

def med(fn, n=2000):
    return round(statistics.median(per_call(fn, n)) / 1e3, 2)

def pieces(P, ts, label):
    c = P._call
    g = c.run.__globals__
    res = {"execute (all)": med(lambda: P.execute(*ts))}
    from aot.ops.plan import matches
    match = lambda: matches(c, ts)
    res["match tensors to the plan"] = med(match)
    res["data_ptr of every tensor"] = med(lambda: [None if t is None else t.data_ptr() for t in ts])
    res["recheck (pointers, alignment, overlap)"] = med(lambda: recheck(ts, c.foot))
    res["stream_handle(None)"] = med(lambda: stream_handle(None, 0))
    p, s = recheck(ts, c.foot), stream_handle(None, 0)
    res["run (launches and torch steps)"] = med(lambda: c.run(p, s, c.x, ts, None))
    entries = [g[k] for k in sorted(g) if k.startswith("E") and k[1:].isdigit()]
    le = entries[0]
    import aot.runtime.driver as drv
    py = drv.drv().cuLaunchKernelEx
    res["floor: cuLaunchKernelEx via cuda-python"] = med(lambda: py(le.cfgs[0], le.funcs[0], le._param_addrs[0], 0))
    res["entry 0 _launch of its last call (ctx check, dims, launch)"] = med(lambda: le._launch(le._last_seq)) if le._last_seq else None
    res["cuCtxGetCurrent"] = med(lambda: le._get_ctx())
    res["memset0 (4 KiB)"] = med(lambda: memset0(p[0], 4096, s, 0))
    for k, le in enumerate(entries):  # every entry of the call: its raw launches and its locked launch of the prepared call
        prep = le._prepared
        if prep is not None:
            res[f"E{k} fire() of the prepared call (lock, ctx check, {len(prep.seq)} launch(es))"] = med(prep.fire)
            for j, (i, dims, _) in enumerate(prep.seq):
                res[f"E{k} launch {j}: raw cuLaunchKernelEx ({len(le.mod.LAUNCHES[i]['params'])} params, attrs {[a for a, _ in le.mod.LAUNCHES[i]['attrs']]})"] = med(
                    lambda i=i: py(le.cfgs[i], le.funcs[i], le._param_addrs[i], 0))
    for j, fn in enumerate(v for k, v in sorted(g.items()) if k.startswith("T") and k[1:].isdigit()):
        res[f"T{j} torch step"] = med(lambda fn=fn: fn(ts, None))
    a, b = torch.randn(1024, device=dev), torch.randn(1024, device=dev)
    res["torch.add"] = med(lambda: torch.add(a, b))
    print(label, json.dumps(res, indent=1))
    print(label, "source:\n" + c.source)

R, d, coff, seqlen = 128, 128, 2, 8192
kv = torch.randn(seqlen, coff * d, device=dev).bfloat16(); score, ape = torch.randn_like(kv), torch.randn(R, coff * d, device=dev)
cu = torch.tensor([0, seqlen], device=dev, dtype=torch.int32); cuc = torch.tensor([0, seqlen // R], device=dev, dtype=torch.int32)
out = torch.empty(seqlen // R, d, device=dev, dtype=torch.bfloat16)
ts = (out, kv, score, ape, cu, cuc)
pieces(aot.csa.CompressorForward(*ts, ratio=R, coff=coff), ts, "CSA forward r128")

B, S_q, S_k, H, D, topk = 1, 4096, 4096, 64, 128, 512
q = (torch.randn(B, S_q, H, D, device=dev) * D**-0.25).bfloat16(); k = (torch.randn(B, S_k, D, device=dev) * D**-0.25).bfloat16()
w = (torch.randn(B, S_q, H, device=dev) / math.sqrt(H)).bfloat16()
idx = torch.rand(B * S_q, S_k, device=dev).topk(topk, dim=-1).indices.int().view(B, S_q, topk).contiguous()
att = torch.softmax(torch.randn(B, S_q, topk, device=dev), dim=-1).contiguous(); isc = torch.softmax(torch.randn(B, S_q, topk, device=dev), dim=-1).contiguous()
gl = torch.ones(1, device=dev); dq, dw, dk = torch.empty_like(q), torch.empty_like(w), torch.empty_like(k)
ws = torch.empty(B * S_k * D * 4, dtype=torch.uint8, device=dev)
ts = (dq, dw, dk, q, w, k, att, isc, idx, gl, ws)
P = aot.dsa.IndexerBackward(*ts[:10], 1.0, 1.0, workspace=ws)
pieces(P, ts, "DSA indexer backward")
acc = ws[: 4 * B * S_k * D].view(torch.float32).view(B, S_k, D)
print("indexer: torch copy_ fp32 -> bf16 (the cast step)", med(lambda: dk.copy_(acc)))
