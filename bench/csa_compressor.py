"""Time to first call and host cost per op call: dsa-aot vs cudnn's JIT path vs torch.add, one run.

    python bench/csa_compressor.py            # on a GPU machine; cudnn side runs only where cutlass imports

Each side's first call is measured in a fresh subprocess (import + load/compile + launch + sync), so
caches of this process do not flatter it. Warm host cost: median over 7 rounds of 500 calls each,
synchronising only at the end of a round (the kernels are tiny, so the host is the bottleneck).
Prints a table and the ratios of this run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUP = r"""
import torch
torch.manual_seed(0)
dev = torch.device("cuda", 0)
ratio, d, coff, B, seqlen = 128, 128, 2, 1, 8192
n = B * seqlen
kv = torch.randn(n, coff * d, device=dev, dtype=torch.bfloat16)
score = torch.randn_like(kv)
ape = torch.randn(ratio, coff * d, device=dev, dtype=torch.float32)
cu = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * seqlen
cuc = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * (seqlen // ratio)
nb = B * (seqlen // ratio)
out = torch.empty(nb, d, device=dev, dtype=torch.bfloat16)
torch.cuda.synchronize()
"""

AOT_FIRST = r"""
import sys, time, json
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cutlass", "cudnn", "tvm_ffi"):
            raise ImportError("blocked: the AOT side must not import the toolchain")
sys.meta_path.insert(0, _Block())
""" + SETUP + r"""
t0 = time.perf_counter()
import dsa_aot.csa
dsa_aot.csa.compressor_forward_into(out, kv, score, ape, cu, cuc, ratio=ratio, coff=coff)
torch.cuda.synchronize()
t1 = time.perf_counter()
from dsa_aot.runtime import load_stats
print(json.dumps({"first_ms": (t1 - t0) * 1e3, "load_ms": sum(load_stats().values())}))
"""

JIT_FIRST = SETUP + r"""
t0 = time.perf_counter()
from cudnn.csa.compressor import compressor_sm100_r128 as r
t_imp = time.perf_counter()
r.run_fwd_r128(kv, score, ape, cu, cuc, out, nb, ratio, d, coff)
torch.cuda.synchronize()
t1 = time.perf_counter()
print(json.dumps({"first_ms": (t1 - t0) * 1e3, "import_ms": (t_imp - t0) * 1e3, "compile_and_launch_ms": (t1 - t_imp) * 1e3}))
"""

WARM = SETUP + r"""
import time, json, statistics
def rounds(fn, n=500, k=7):
    fn(); torch.cuda.synchronize()
    res = []
    for _ in range(k):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(res)
out_d = {}
a, b = torch.randn(1024, device=dev), torch.randn(1024, device=dev)
out_d["torch.add"] = rounds(lambda: torch.add(a, b))
SIDE
print(json.dumps(out_d))
"""

AOT_WARM = WARM.replace("SIDE", r"""
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cutlass", "cudnn", "tvm_ffi"):
            raise ImportError("blocked")
import sys
sys.meta_path.insert(0, _Block())
import dsa_aot.csa
out_d["aot forward_into"] = rounds(lambda: dsa_aot.csa.compressor_forward_into(out, kv, score, ape, cu, cuc, ratio=ratio, coff=coff))
out_d["aot forward (allocates)"] = rounds(lambda: dsa_aot.csa.compressor_forward(kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=nb))
""")

JIT_WARM = WARM.replace("SIDE", r"""
from cudnn.csa.compressor import compressor_sm100_r128 as r
out_d["cudnn run_fwd_r128 (warm fast path)"] = rounds(lambda: r.run_fwd_r128(kv, score, ape, cu, cuc, out, nb, ratio, d, coff))
""")


def run(code):
    p = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    import importlib.util

    have_jit = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cudnn") is not None
    res = {"aot_first": run(AOT_FIRST), "aot_warm": run(AOT_WARM)}
    if have_jit:
        res["jit_first"] = run(JIT_FIRST)
        res["jit_warm"] = run(JIT_WARM)
    print(json.dumps(res, indent=1))
    print("\n| measurement (CSA r128 fwd, coff 2, d 128, 1x8192 tokens) | value |")
    print("|---|---:|")
    af, aw = res["aot_first"], res["aot_warm"]
    print(f"| AOT cubin load (cuLibraryLoadData + set-up) | {af.get('load_ms', float('nan')):.2f} ms |")
    print(f"| AOT first call (import dsa_aot + load + launch + sync) | {af.get('first_ms', float('nan')):.1f} ms |")
    for k, v in aw.items():
        print(f"| host per call: {k} | {v:.1f} us |")
    if have_jit:
        jf, jw = res["jit_first"], res["jit_warm"]
        print(f"| cudnn first call (module import + JIT + launch + sync) | {jf.get('first_ms', float('nan')) / 1e3:.2f} s |")
        for k, v in jw.items():
            if k != "torch.add":
                print(f"| host per call: {k} | {v:.1f} us |")
        if "first_ms" in jf and "first_ms" in af:
            print(f"\nratio first call cudnn/AOT: {jf['first_ms'] / af['first_ms']:.0f}x")
        k = "cudnn run_fwd_r128 (warm fast path)"
        if k in jw and "aot forward_into" in aw:
            print(f"ratio warm host cost AOT/cudnn: {aw['aot forward_into'] / jw[k]:.2f} (AOT/torch.add {aw['aot forward_into'] / aw['torch.add']:.2f})")


if __name__ == "__main__":
    main()
