"""Per-kernel device time and launch configuration, cudnn's JIT path vs dsa-aot, in one process under
torch.profiler (CUPTI): where a difference in bench/run.py's "device us" comes from (the kernel itself, its
launch configuration, or the work around it).

    python bench/kernels.py FAMILY [--case NAME] [--calls 50]   # needs cutlass and cudnn importable, and a build

The case (default: the family's first bench case) and both calls are the family's parity declaration's
(ci/parity/<family>.py). Both sides are warmed together (five calls each, alternating), then each runs
``--calls`` calls under the profiler in turn. Prints, per side and kernel: calls, mean / min device us, grid,
block, dynamic shared memory, registers per thread; then the kernels' sum per call.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ci", "parity"))


def _kernels(trace_path):
    """name -> (durations us, launch configs) of every kernel in a chrome trace."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out: dict = {}
    for e in events:
        if e.get("cat") == "kernel":
            a = e.get("args", {})
            durs, cfgs = out.setdefault(e["name"], ([], set()))
            durs.append(float(e["dur"]))
            cfgs.add((tuple(a.get("grid", ())), tuple(a.get("block", ())), a.get("shared memory"), a.get("registers per thread")))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family")
    p.add_argument("--case", default="")
    p.add_argument("--calls", type=int, default=50)
    a = p.parse_args(argv)
    import harness as H
    import torch
    from torch.profiler import ProfilerActivity, profile

    H.production_jit()
    par = importlib.import_module(a.family).PARITY
    name = a.case or (par.bench or [par.cases(False)[0][0]])[0]
    spec = dict(par.cases(False))[name]
    x = H.to_cuda(par.inputs(spec))
    sides = {"cudnn": (par.jit.call, par.jit.setup()), "aot": (par.aot.call, importlib.import_module(par.aot.module))}
    calls = {s: (lambda f=f, api=api, b=par.buffers("jit" if s == "cudnn" else "aot", api, spec, x): f(api, spec, x, b)) for s, (f, api) in sides.items()}
    for _ in range(5):  # compile / load, then warm
        for c in calls.values():
            c()
    torch.cuda.synchronize()
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for side, c in calls.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(a.calls):
                    c()
                torch.cuda.synchronize()
            prof.export_chrome_trace(os.path.join(d, f"{side}.json"))
            rows[side] = _kernels(os.path.join(d, f"{side}.json"))
    print(f"\n### {a.family} {name}: {a.calls} calls per side\n")
    print("| side | kernel | calls | mean us | min us | grid | block | smem | regs |\n|---|---|---:|---:|---:|---|---|---:|---:|")
    for side, ks in rows.items():
        for kname, (durs, cfgs) in ks.items():
            for cfg in sorted(cfgs, key=repr):
                print(f"| {side} | {kname[:60]} | {len(durs)} | {statistics.mean(durs):.1f} | {min(durs):.1f} | {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} |")
    totals = {side: sum(sum(d) for d, _ in ks.values()) / a.calls for side, ks in rows.items()}
    print(f"\ndevice us per call, kernels summed: cudnn {totals['cudnn']:.1f}, aot {totals['aot']:.1f} (dsa_aot/cudnn {totals['aot'] / totals['cudnn']:.3f})")


if __name__ == "__main__":
    main()
