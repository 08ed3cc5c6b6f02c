"""Where a plan.execute's microseconds go, for every case of bench/host_floor.py (same set-up, same plan).

    python bench/plan_profile.py [--cases "CSA forward r128,DSA indexer backward"]   # on a GPU; toolchain blocked

Per case, in one process (median per call over ``--calls`` calls, the device synchronised every 20
outside the timing, bench/_harness.py):
- ``execute (all)`` and its parts timed alone: the probe (the tensors matched to the plan, their data
  pointers read and checked), ``stream_handle``, the plan's ``run`` body;
- the ``run`` body once more, step by step *in sequence*: the same code with a clock read after each
  line (each entry's ``prepare``, each memset, each ``fire``, each torch step), so that what a step
  costs after the one before it is seen, not only alone;
- the floor of that process: one ``cuLaunchKernelEx`` of the plan's first kernel with its prebuilt
  config and parameters, ``cuCtxGetCurrent``, and ``torch.add`` of two 1024-element tensors.
Prints one JSON object per case and the plan's code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from _harness import block_toolchain, per_call  # noqa: E402  (bench/, this script's directory)

import host_floor  # noqa: E402


def med(fn, calls):
    return round(statistics.median(per_call(fn, calls)) / 1e3, 2)


def in_sequence(c, p, s, ts, calls):
    """The median µs of each line of ``c.run``'s body when the body runs whole (a clock read after each line)."""
    import torch

    steps_src = []  # the body's statements: a line at the body's indent, with the deeper lines and else: that follow it
    for line in c.source.splitlines()[1:]:
        if line.startswith("     ") or line.strip() == "else:":
            steps_src[-1] += "\n" + line
        else:
            steps_src.append(line)
    body = steps_src
    lines = ["def timed(p, s, x, ts, stream, _t):", "    _t.append(_ns())"]
    for stmt in body:
        lines += [stmt, "    _t.append(_ns())"]
    env = dict(c.run.__globals__, _ns=time.perf_counter_ns)
    exec(compile("\n".join(lines) + "\n", "<timed plan>", "exec"), env)  # noqa: S102  (the plan's own code, clock reads added)
    steps = [[] for _ in body]
    for i in range(calls + 20):
        t = []
        env["timed"](p, s, c.x, ts, None, t)
        if i >= 20:
            for k in range(len(body)):
                steps[k].append(t[k + 1] - t[k])
        if i % 20 == 19:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    def label(stmt):
        return "the last call's prepared launches, reused (if m[0] == (p, s, x): ...)" if stmt.startswith("    if m[0]") else " ".join(stmt.split())[:90]

    return {f"in sequence: {label(stmt)}": round(statistics.median(v) / 1e3, 2) for stmt, v in zip(body, steps)}


def profile(case, calls):
    import torch

    from dsa_aot.ops.gpu import stream_handle
    import dsa_aot.runtime.driver as drv

    setup, aot_rows, _ = host_floor.CASES[case]
    g = {"ROOT": host_floor.ROOT, "SIDE": "aot", "CALLS": calls, "__name__": "case"}
    exec(host_floor.PRELUDE.replace("block_toolchain()", "pass") + setup + aot_rows, g)  # noqa: S102  (host_floor's own set-up)
    P, P_exec = g["P"], g["rows"]["plan.execute"]
    P_exec()
    c = P._call
    captured = []  # the tensors execute() hands the probe, in plan order
    orig = c.probe

    def spy(t):
        captured.append(t)
        return orig(t)

    c.probe = spy
    P_exec()
    c.probe = orig
    ts = captured[0]
    res = {"execute (all)": med(P_exec, calls)}
    res["probe: match, data_ptr, pointer checks"] = med(lambda: c.probe(ts), calls)
    res["stream_handle(None)"] = med(lambda: stream_handle(None, c.dev), calls)
    p, s = c.probe(ts), stream_handle(None, c.dev)
    res["run (launches and torch steps)"] = med(lambda: c.run(p, s, c.x, ts, None), calls)
    res.update(in_sequence(c, p, s, ts, calls))
    le = c.run.__globals__["E0"]
    launch = drv.drv().cuLaunchKernelEx
    if le.last[0] is not None:  # a config that launched: the floor replays it
        res["floor: cuLaunchKernelEx, prebuilt config"] = med(lambda: launch(le.cfgs[0], le.funcs[0], le._param_addrs[0], 0), calls)
    res["floor: cuCtxGetCurrent"] = med(le._get_ctx, calls)
    a, b = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda")
    res["floor: torch.add"] = med(lambda: torch.add(a, b), calls)
    print(case, json.dumps(res, indent=1))
    print(case, "source:\n" + c.source, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(host_floor.CASES))
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    block_toolchain()
    for case in [c for c in host_floor.CASES if c in a.cases.split(",")]:
        profile(case, a.calls)


if __name__ == "__main__":
    main()
