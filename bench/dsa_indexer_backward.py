"""DSA indexer backward: time to first call and host cost per op call, dsa-aot vs cudnn's JIT path vs torch.add.

    python bench/dsa_indexer_backward.py        # on a GPU machine; cudnn side runs only where cutlass and cudnn import

Shape: cudnn's anchor, B=1, S_q=4096, S_k=4096, H=64, D=128, topk=512, local ids, bf16 d_index_k,
default backend (on the H200 the SM90 path: zero fp32 dK, ScoreGradSm90, IndexerBackwardSm90, bf16
cast). cudnn measured 6.8 s first call and 153 us warm per op call for it.

Each side's first call is measured in a fresh subprocess after torch, CUDA and the inputs are set up
(a warm process): import of the op module + cubin load (AOT) or JIT compile (cudnn) + launch + sync,
so caches of this process do not flatter it. Warm host cost: median over 25 rounds of 20 calls, the
device synchronised only between rounds (the device time of one call exceeds its host time, so long
rounds would fill the launch queue and measure the device instead); device time per call is measured
back to back with CUDA events. Every call overwrites ``attn_score`` with the score-grad signal; the warm
loops reuse that buffer, which changes the values but not the host or device work.

Also printed, from the build's ``_build/report.json`` (carried along): the CPU ``cute.compile`` seconds of the entries the
AOT call loaded (what a JIT pays on the CPU), next to AOT's first-call time. Without cudnn only the
AOT rows are printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDNN_ANCHOR = {"first_s": 6.8, "warm_us": 153.0}
SHAPE = "B1 S_q 4096 S_k 4096 H64 D128 topk 512, bf16 dK"

SETUP = r"""
import math, torch
torch.manual_seed(0)
dev = torch.device("cuda", 0)
B, S_q, S_k, H, D, topk = 1, 4096, 4096, 64, 128, 512
index_q = (torch.randn(B, S_q, H, D, device=dev) * D**-0.25).bfloat16()
index_k = (torch.randn(B, S_k, D, device=dev) * D**-0.25).bfloat16()
weights = (torch.randn(B, S_q, H, device=dev) / math.sqrt(H)).bfloat16()
topk_indices = torch.rand(B * S_q, S_k, device=dev).topk(topk, dim=-1).indices.int().view(B, S_q, topk).contiguous()  # unique per row
attn_score = torch.softmax(2.0 * torch.randn(B, S_q, topk, device=dev), dim=-1).contiguous()
index_score = torch.softmax(1.5 * torch.randn(B, S_q, topk, device=dev), dim=-1).contiguous()
grad_loss = torch.ones(1, device=dev)
d_index_q, d_weights, d_index_k = torch.empty_like(index_q), torch.empty_like(weights), torch.empty_like(index_k)
workspace = torch.empty(-(-B * S_k * D * 4 // 128) * 128, dtype=torch.uint8, device=dev)  # fp32 dK accumulator of a bf16 d_index_k
args = (index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss)
given = dict(sm_scale=1.0, loss_coeff=1.0, d_index_q=d_index_q, d_weights=d_weights, d_index_k=d_index_k, workspace=workspace)
torch.cuda.synchronize()
"""

BLOCK = r"""
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cutlass", "cudnn", "tvm_ffi"):
            raise ImportError("blocked: the AOT side must not import the toolchain")
sys.meta_path.insert(0, _Block())
"""


def first_call_scripts(setup, aot_call, jit_import, jit_call, jit_compiled):
    """(AOT, JIT) first-call scripts: one set-up, then an import of the op and one synchronised call,
    timed; the AOT side cannot import the toolchain. ``jit_compiled``: code that sets ``compiled``, the
    keys the JIT side compiled."""
    aot = BLOCK + setup + f"""
import os, time, json
t0 = time.perf_counter()
import dsa_aot.dsa
{aot_call}
torch.cuda.synchronize()
t1 = time.perf_counter()
from dsa_aot.runtime import load_stats
stats = load_stats()
print(json.dumps({{"first_ms": (t1 - t0) * 1e3, "load_ms": sum(stats.values()), "loads": {{k[0]: v for k, v in stats.items()}},
                  "generated": os.path.join(os.path.dirname(dsa_aot.__file__), "_generated")}}))
"""
    jit = setup + f"""
import time, json
t0 = time.perf_counter()
{jit_import}
t_imp = time.perf_counter()
{jit_call}
torch.cuda.synchronize()
t1 = time.perf_counter()
{jit_compiled}
print(json.dumps({{"first_ms": (t1 - t0) * 1e3, "import_ms": (t_imp - t0) * 1e3, "compile_and_launch_ms": (t1 - t_imp) * 1e3,
                  "compiled": compiled}}))
"""
    return aot, jit


AOT_FIRST, JIT_FIRST = first_call_scripts(
    SETUP, "dsa_aot.dsa.indexer_backward(*args, **given)", "from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_wrapper",
    "indexer_backward_wrapper(*args, **given)",
    "from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_sm90 as k90\n"
    "compiled = [repr(k) for k in k90._compile_cache] + [repr(k) for k in k90._score_grad_cute_cache]",
)


WARM = SETUP + r"""
import time, json, statistics
def rounds(fn, n=20, k=25):
    fn(); torch.cuda.synchronize()
    res = []
    for _ in range(k):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        res.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()  # outside the timed region: the queue never fills
    return statistics.median(res)
def device(fn, n=20):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record(); b.synchronize()
    return a.elapsed_time(b) * 1e3 / n
out_d, dev_d = {}, {}
a, b = torch.randn(1024, device=dev), torch.randn(1024, device=dev)
out_d["torch.add"] = rounds(lambda: torch.add(a, b))
SIDE
print(json.dumps({"host": out_d, "device": dev_d}))
"""

AOT_WARM = WARM.replace("SIDE", BLOCK + r"""
import dsa_aot.dsa
fn = lambda: dsa_aot.dsa.indexer_backward(*args, **given)
out_d["aot indexer_backward (outputs + workspace given)"] = rounds(fn)
dev_d["aot indexer_backward"] = device(fn)
out_d["aot indexer_backward (allocates outputs + workspace)"] = rounds(lambda: dsa_aot.dsa.indexer_backward(*args, sm_scale=1.0))
out_d["aot indexer_backward_into"] = rounds(lambda: dsa_aot.dsa.indexer_backward_into(d_index_q, d_weights, d_index_k, *args, 1.0, 1.0, 128, False, None, workspace=workspace))
""")

JIT_WARM = WARM.replace("SIDE", r"""
from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_wrapper
fn = lambda: indexer_backward_wrapper(*args, **given)
out_d["cudnn indexer_backward_wrapper (outputs + workspace given)"] = rounds(fn)
dev_d["cudnn indexer_backward_wrapper"] = device(fn)
out_d["cudnn indexer_backward_wrapper (allocates outputs + workspace)"] = rounds(lambda: indexer_backward_wrapper(*args, sm_scale=1.0))
""")

AOT_KEY = "aot indexer_backward (outputs + workspace given)"
JIT_KEY = "cudnn indexer_backward_wrapper (outputs + workspace given)"


def run(code):
    p = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def cpu_compile_seconds(generated, ids):
    """{entry id: cute.compile seconds on the CPU build machine} from the build's report (``_build/report.json``
    in the repository; the shipped tree records no timings), {} when it was not carried along."""
    found = {}
    try:
        with open(os.path.join(ROOT, "_build", "report.json")) as f:
            for row in json.load(f):
                if row.get("id") in ids and row.get("compile_s") is not None:
                    found[row["id"]] = float(row["compile_s"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return found


def _num(d, k):
    v = d.get(k) if isinstance(d, dict) else None
    return v if isinstance(v, (int, float)) else float("nan")


def measure_scripts(have_jit, first, aot_warm, jit_warm):
    """Every timing script of a per-op bench in its own fresh process: ``first`` {name: (AOT, JIT)
    first-call scripts (first_call_scripts)}, the warm scripts of each side. {name: parsed json or
    {'error'}}, with the CPU compile seconds of the entries each AOT first call loaded."""
    res = {}
    for name, (aot_first, _) in first.items():
        res[f"aot_first.{name}"] = run(aot_first)
    res["aot_warm"] = run(aot_warm)
    if have_jit:
        for name, (_, jit_first) in first.items():
            res[f"jit_first.{name}"] = run(jit_first)
        res["jit_warm"] = run(jit_warm)
    for name in first:
        af = res[f"aot_first.{name}"]
        res[f"cpu_compile_s.{name}"] = cpu_compile_seconds(af["generated"], list(af.get("loads", {}))) if "generated" in af else {}
    return res


def first_call_and_warm_rows(res, have_jit, title, names):
    """The table head the per-op benches share: failures, per op ``names`` the AOT cubin load and first
    call (and the CPU compile seconds of those entries, cudnn's first call), then every warm host and
    device measurement of both sides."""
    print(json.dumps(res, indent=1))
    print(f"\n| measurement ({title}) | value |")
    print("|---|---:|")
    for side, r in res.items():
        if isinstance(r, dict) and "error" in r:
            print(f"| {side} FAILED | {str(r['error'])[:200]} |")
    for name in names:
        af, compile_s = res[f"aot_first.{name}"], res[f"cpu_compile_s.{name}"]
        loads = af.get("loads", {})
        print(f"| {name}: AOT cubin load ({len(loads)} entries: cuLibraryLoadData + set-up) | {_num(af, 'load_ms'):.2f} ms |")
        print(f"| {name}: AOT first call (import dsa_aot.dsa + load + launch + sync) | {_num(af, 'first_ms'):.1f} ms |")
        if compile_s:
            parts = ", ".join(f"{i.split('.', 1)[-1]} {s:.2f} s" for i, s in sorted(compile_s.items()))
            print(f"| {name}: CPU cute.compile of those entries (report.json: the JIT cost, paid on the build machine) | "
                  f"{sum(compile_s.values()):.2f} s ({parts}) |")
        if have_jit:
            jf = res.get(f"jit_first.{name}", {})
            print(f"| {name}: cudnn first call (module import + JIT + launch + sync) | {_num(jf, 'first_ms') / 1e3:.2f} s "
                  f"(import {_num(jf, 'import_ms') / 1e3:.2f} s, compile + launch {_num(jf, 'compile_and_launch_ms') / 1e3:.2f} s) |")
    aw, jw = res["aot_warm"], res.get("jit_warm", {})
    for side, where in ((aw, "AOT"), (jw, "cudnn")) if have_jit else ((aw, "AOT"),):
        for k, v in side.get("host", {}).items():
            print(f"| host per call: {k}{f' ({where} process)' if k == 'torch.add' else ''} | {v:.1f} us |")
        for k, v in side.get("device", {}).items():
            print(f"| device per call, back to back: {k} | {v:.1f} us |")
    return aw, jw


def report(title, shape, scripts, aot_key, jit_key, anchor=None):
    """Run the four timing scripts (dsa_aot/jit x first/warm) in fresh processes and print one table with
    the ratios of this run; the JIT rows only where cutlass and cudnn are importable."""
    import importlib.util

    aot_first, aot_warm, jit_first, jit_warm = scripts
    have_jit = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cudnn") is not None
    res = {"aot_first": run(aot_first), "aot_warm": run(aot_warm)}
    if have_jit:
        res["jit_first"] = run(jit_first)
        res["jit_warm"] = run(jit_warm)
    af, aw = res["aot_first"], res["aot_warm"]
    compile_s = cpu_compile_seconds(af["generated"], list(af.get("loads", {}))) if "generated" in af else {}
    res["cpu_compile_s"] = compile_s
    print(json.dumps(res, indent=1))

    print(f"\n| measurement ({title}, {shape}) | value |")
    print("|---|---:|")
    for side, r in res.items():
        if isinstance(r, dict) and "error" in r:
            print(f"| {side} FAILED | {r['error'][:200]} |")
    loads = af.get("loads", {})
    print(f"| AOT cubin load ({len(loads)} entries: cuLibraryLoadData + set-up) | {_num(af, 'load_ms'):.2f} ms |")
    print(f"| AOT first call (import dsa_aot.dsa + load + launch + sync) | {_num(af, 'first_ms'):.1f} ms |")
    if compile_s:
        parts = ", ".join(f"{i.split('.', 1)[-1]} {s:.1f} s" for i, s in sorted(compile_s.items()))
        print(f"| CPU cute.compile of those entries (report.json: the JIT cost, paid on the build machine) | {sum(compile_s.values()):.1f} s ({parts}) |")
    host, devt = aw.get("host", {}), aw.get("device", {})
    for k, v in host.items():
        print(f"| host per call: {k} | {v:.1f} us |")
    for k, v in devt.items():
        print(f"| device per call, back to back: {k} | {v:.1f} us |")
    jf, jw = res.get("jit_first", {}), res.get("jit_warm", {})
    if have_jit:
        print(f"| cudnn first call (module import + JIT + launch + sync) | {_num(jf, 'first_ms') / 1e3:.2f} s "
              f"(import {_num(jf, 'import_ms') / 1e3:.2f} s, compile + launch {_num(jf, 'compile_and_launch_ms') / 1e3:.2f} s) |")
        for k, v in jw.get("host", {}).items():
            if k != "torch.add":
                print(f"| host per call: {k} | {v:.1f} us |")
        for k, v in jw.get("device", {}).items():
            print(f"| device per call, back to back: {k} | {v:.1f} us |")
    if anchor:
        print(f"| cudnn's own measurement (anchor, same shape) | {anchor['first_s']} s first call, {anchor['warm_us']:.0f} us warm per op call |")

    print()
    a_first, a_warm, add = _num(af, "first_ms"), _num(host, aot_key), _num(host, "torch.add")
    if compile_s and a_first == a_first:
        print(f"ratio CPU compile of the used entries / AOT first call: {sum(compile_s.values()) * 1e3 / a_first:.0f}x")
    if anchor:
        print(f"ratio cudnn anchor first call / AOT first call: {anchor['first_s'] * 1e3 / a_first:.0f}x; "
              f"AOT warm / cudnn anchor warm: {a_warm / anchor['warm_us']:.2f}")
    print(f"AOT warm / torch.add: {a_warm / add:.2f}")
    if have_jit:
        j_first, j_warm = _num(jf, "first_ms"), _num(jw.get("host", {}), jit_key)
        print(f"ratio first call cudnn/AOT (this run): {j_first / a_first:.0f}x")
        print(f"ratio warm host cost AOT/cudnn (this run): {a_warm / j_warm:.2f} (cudnn/torch.add {j_warm / _num(jw.get('host', {}), 'torch.add'):.2f})")


def main():
    report("DSA indexer backward", SHAPE, (AOT_FIRST, AOT_WARM, JIT_FIRST, JIT_WARM), AOT_KEY, JIT_KEY, CUDNN_ANCHOR)


if __name__ == "__main__":
    main()
