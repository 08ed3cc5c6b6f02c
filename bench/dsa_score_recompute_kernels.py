"""Per-kernel device time and launch configuration of the score recomputes, cudnn's JIT path vs dsa-aot, in
one process under torch.profiler (CUPTI): where a difference in bench/dsa_score_recompute.py's "device per call"
comes from (the kernel itself, its launch configuration, or the work around it).

    python bench/dsa_score_recompute_kernels.py [--calls 50] [--ops sparse_attention,sparse_indexer]

Needs cutlass and cudnn importable (the JIT side) and a build with the op's entries. Inputs: the ones
bench/dsa_score_recompute.py sets up (its SETUP). Both sides are warmed together (five calls each, alternating),
then each runs ``--calls`` calls under the profiler in turn. Prints, per side and kernel: calls, mean / min
device us, grid, block, dynamic shared memory, registers per thread; then the kernels' sum per call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dsa_score_recompute as _b  # noqa: E402  (its SETUP: the shapes and inputs of the bench)

API = "cudnn.deepseek_sparse_attention.score_recompute.api"

CALLS = {  # op -> (cudnn call, aot _into call), in SETUP's names
    "sparse_indexer": ("api.sparse_indexer_score_recompute_wrapper(*args, out=out)",
                       "dsa_aot.dsa.sparse_indexer_score_recompute_into(out, *args, workspace=workspace)"),
    "sparse_attention": ("api.sparse_attn_score_recompute_wrapper(*args_a, out=out)",
                         "dsa_aot.dsa.sparse_attn_score_recompute_into(out, *args_a, workspace=ws_a)"),
}


def _kernels(trace_path):
    """(name, duration us, launch config) of every kernel in a chrome trace, in order."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("cat") == "kernel":
            a = e.get("args", {})
            cfg = (tuple(a.get("grid", ())), tuple(a.get("block", ())), a.get("shared memory"), a.get("registers per thread"))
            out.append((e["name"], float(e["dur"]), cfg))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--ops", default=",".join(CALLS))
    a = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    env: dict = {}
    exec(_b.SETUP, env)  # noqa: S102  (the bench's own setup text)
    exec(f"import importlib\napi = importlib.import_module('{API}')\nimport dsa_aot.dsa", env)  # noqa: S102
    for op in a.ops.split(","):
        jit_call, aot_call = (compile(c, f"<{op}>", "eval") for c in CALLS[op])
        for _ in range(5):  # compile / load, then warm
            eval(jit_call, env)  # noqa: S307
            eval(aot_call, env)  # noqa: S307
        torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as d:
            rows = {}
            for side, call in (("cudnn", jit_call), ("aot", aot_call)):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(a.calls):
                        eval(call, env)  # noqa: S307
                    torch.cuda.synchronize()
                path = os.path.join(d, f"{side}.json")
                prof.export_chrome_trace(path)
                rows[side] = _kernels(path)
        print(f"\n### {op}: {a.calls} calls per side, {_b.SHAPE}\n")
        print("| side | kernel | calls | mean us | min us | grid | block | smem | regs |")
        print("|---|---|---:|---:|---:|---|---|---:|---:|")
        for side, ks in rows.items():
            for name, durs_cfg in _group(ks).items():
                durs, cfgs = durs_cfg
                for cfg in sorted(cfgs, key=repr):
                    print(f"| {side} | {name[:60]} | {len(durs)} | {statistics.mean(durs):.1f} | {min(durs):.1f} | {cfg[0]} | {cfg[1]} | {cfg[2]} | "
                          f"{cfg[3]} |")
        totals = {side: sum(d for _, d, _ in ks) / a.calls for side, ks in rows.items()}
        print(f"\ndevice us per call, kernels summed: cudnn {totals['cudnn']:.1f}, aot {totals['aot']:.1f} "
              f"(dsa_aot/cudnn {totals['aot'] / totals['cudnn']:.3f})")


def _group(ks):
    g: dict = {}
    for name, dur, cfg in ks:
        durs, cfgs = g.setdefault(name, ([], set()))
        durs.append(dur)
        cfgs.add(cfg)
    return g


if __name__ == "__main__":
    main()
