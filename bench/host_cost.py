"""Host cost per call of the CSA forward and the indexer backward ``_into`` ops: this tree, and with
``--against DIR`` another checkout (e.g. the commit before the runtime became thread-safe), one run.

    python bench/host_cost.py [--against /path/to/other/checkout] [--rounds 5] [--calls 400]

Each (tree, op) runs in its own subprocess (the toolchain blocked), the trees interleaved over
``--rounds`` rounds so that drift on a shared machine hits both alike. A call is timed alone with
perf_counter_ns: it only enqueues work; the device is synchronised every 20 calls, outside the timing,
so the launch queue never fills. The median per call over all rounds is printed, and the ratio of the
two trees. Through ``torch.ops.dsa_aot`` (this tree only): the same call through the dispatcher.
With 8 threads (this tree only; an older runtime may mix up concurrent calls): the wall
time of 8 x ``--calls`` calls on 8 streams divided by the number of calls.

Shapes: a CSA forward (ratio 128, coff 2, d 128, 1 x 8192 tokens) and the
indexer backward (B1, S_q 4096, S_k 4096, H64, D128, top-k 512, bf16
d_index_k), each tree using the ``dsa_aot/_generated`` of its own checkout.
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
import sys, json, time, threading, math
sys.path[:0] = [TREE, BENCH]
from _harness import block_toolchain, per_call
block_toolchain()
import torch
dev = torch.device("cuda", 0)

def csa_inputs(seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    ratio, d, coff, seqlen = 128, 128, 2, 8192
    kv = torch.randn(seqlen, coff * d, device=dev, generator=g).bfloat16()
    score, ape = torch.randn_like(kv), torch.randn(ratio, coff * d, device=dev)
    cu = torch.tensor([0, seqlen], device=dev, dtype=torch.int32)
    cuc = torch.tensor([0, seqlen // ratio], device=dev, dtype=torch.int32)
    out = torch.empty(seqlen // ratio, d, device=dev, dtype=torch.bfloat16)
    if VIA == "torch.ops":
        import dsa_aot.library
        op = torch.ops.dsa_aot.csa_compressor_forward_into
        return lambda stream=None: op(out, kv, score, ape, cu, cuc, ratio, coff)
    import dsa_aot.csa
    return lambda stream=None: dsa_aot.csa.compressor_forward_into(out, kv, score, ape, cu, cuc, ratio=ratio, coff=coff, stream=stream)

def indexer_inputs(seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    B, S_q, S_k, H, D, topk = 1, 4096, 4096, 64, 128, 512
    q = (torch.randn(B, S_q, H, D, device=dev, generator=g) * D**-0.25).bfloat16()
    k = (torch.randn(B, S_k, D, device=dev, generator=g) * D**-0.25).bfloat16()
    w = (torch.randn(B, S_q, H, device=dev, generator=g) / math.sqrt(H)).bfloat16()
    idx = torch.rand(B * S_q, S_k, device=dev, generator=g).topk(topk, dim=-1).indices.int().view(B, S_q, topk).contiguous()
    att = torch.softmax(torch.randn(B, S_q, topk, device=dev, generator=g), dim=-1).contiguous()
    isc = torch.softmax(torch.randn(B, S_q, topk, device=dev, generator=g), dim=-1).contiguous()
    gl = torch.ones(1, device=dev)
    dq, dw, dk = torch.empty_like(q), torch.empty_like(w), torch.empty_like(k)
    ws = torch.empty(B * S_k * D * 4, dtype=torch.uint8, device=dev)
    if VIA == "torch.ops":
        import dsa_aot.library
        op = torch.ops.dsa_aot.dsa_indexer_backward_into
        return lambda stream=None: op(dq, dw, dk, q, w, k, att, isc, idx, gl, 1.0, 1.0, workspace=ws)
    import dsa_aot.dsa
    return lambda stream=None: dsa_aot.dsa.indexer_backward_into(dq, dw, dk, q, w, k, att, isc, idx, gl, 1.0, 1.0, stream=stream, workspace=ws)

make = {"csa_forward_into": csa_inputs, "indexer_backward_into": indexer_inputs}[OP]
"""

SINGLE = r"""
print(json.dumps(per_call(make(0), CALLS)))
"""

THREADS = r"""
n = 8
calls = [make(i) for i in range(n)]
streams = [torch.cuda.Stream() for _ in range(n)]
for c, s in zip(calls, streams):
    c(s)
torch.cuda.synchronize()
barrier = threading.Barrier(n + 1)
def work(i):
    with torch.cuda.stream(streams[i]):
        barrier.wait()
        for j in range(CALLS):
            calls[i](streams[i])
            if j % 20 == 19:
                streams[i].synchronize()
ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
for t in ts:
    t.start()
barrier.wait()
t0 = time.perf_counter_ns()
for t in ts:
    t.join()
torch.cuda.synchronize()
print(json.dumps([(time.perf_counter_ns() - t0) / (n * CALLS)]))
"""


def run(tree, op, body, calls, via="direct"):
    code = f"TREE = {tree!r}\nBENCH = {os.path.join(ROOT, 'bench')!r}\nOP = {op!r}\nCALLS = {calls}\nVIA = {via!r}\n" + PRELUDE + body
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    if p.returncode:
        raise SystemExit(f"{tree} {op}: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="another checkout (with its dsa_aot/_generated) to time in the same run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=400)
    a = ap.parse_args()
    trees = {"this tree": ROOT} | ({"other": os.path.abspath(a.against)} if a.against else {})
    ops = ("csa_forward_into", "indexer_backward_into")
    got = {(t, op): [] for t in trees for op in ops}
    threaded = {op: [] for op in ops}
    via_torch = {op: [] for op in ops}
    for _ in range(a.rounds):
        for op in ops:
            for t, path in trees.items():
                got[t, op] += run(path, op, SINGLE, a.calls)
            via_torch[op] += run(ROOT, op, SINGLE, a.calls, via="torch.ops")
            threaded[op] += run(ROOT, op, THREADS, a.calls)
    med = {k: statistics.median(v) / 1e3 for k, v in got.items()}
    print(json.dumps({f"{t} {op}": v for (t, op), v in med.items()} | {f"8 threads {op}": statistics.median(v) / 1e3 for op, v in threaded.items()}, indent=1))
    print(f"\n| host us per call (median of {a.rounds} x {a.calls} calls) | " + " | ".join(trees) + (" | ratio |" if a.against else " |"))
    print("|---|" + "---:|" * (len(trees) + bool(a.against)))
    for op in ops:
        row = [med[t, op] for t in trees]
        print(f"| {op} | " + " | ".join(f"{v:.1f}" for v in row) + (f" | {row[0] / row[1]:.2f} |" if a.against else " |"))
    for op in ops:
        v = statistics.median(via_torch[op]) / 1e3
        print(f"| {op} through torch.ops.dsa_aot (this tree; x direct call) | {v:.1f} ({v / med['this tree', op]:.2f}x) |" + (" - | - |" if a.against else ""))
    for op in ops:
        print(f"| {op}, 8 threads on 8 streams (wall / calls) | {statistics.median(threaded[op]) / 1e3:.1f} |" + (" - | - |" if a.against else ""))
    if a.against:
        print("\nratio = this tree / other, measured in this run")


if __name__ == "__main__":
    main()
