"""Time to first call and host cost per op call, dsa-aot vs cudnn's JIT vs torch.add: one benchmark for every family.

    python bench/run.py [FAMILY ...] [--calls N] [--case NAME]   # on a GPU; the cudnn side runs where cutlass and cudnn import

A family's cases, inputs and calls are its parity declaration's (ci/parity/<family>.py, ``Parity.bench``
names the cases timed: realistic shapes; default its first case). Each (case, side) runs in a fresh
subprocess, so that no cache of another measurement flatters it: torch, CUDA and the inputs are set up
first (a warm process; the cudnn side with a fresh DSL file cache and no keep mode, as in production:
harness.production_jit), then the op's import (dsa_aot, with cutlass and cudnn blocked; or cudnn's modules)
and the first call, synchronised (the AOT's includes its lazy cubin loads, cudnn's its JIT compile); then
the warm host microseconds per call (median of ``--calls``, the device synchronised every few calls
outside the timed ones), the AOT ``_into`` form's, device microseconds per call (CUDA events) and
``torch.add`` on 16 elements timed the same way in that process as a yardstick. The ratios are of one run.
Exit status 2 when no family named has a kernel for this GPU.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ci", "parity"))


def child(side, family, name, calls):
    """One side of one case in this (fresh) process: prints one json line."""
    import harness as H

    H.install_blocker() if side == "aot" else H.production_jit()
    import time

    import torch

    par = importlib.import_module(family).PARITY
    spec = dict(par.cases(False))[name]
    x = H.to_cuda(par.inputs(spec))
    torch.cuda.synchronize()
    prof = None
    if os.environ.get("BENCH_PROFILE"):  # bench/startup.py --profile: where the import and first call spend their time
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    api = par.jit.setup() if side == "jit" else importlib.import_module(par.aot.module)
    import_ms = 1e3 * (time.perf_counter() - t0)
    call = par.jit.call if side == "jit" else par.aot.call
    b = par.buffers(side, api, spec, x)
    first_s, res = H.first_call(lambda: call(api, spec, x, b))
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.environ["BENCH_PROFILE"])
    again_s, _ = H.first_call(lambda: call(api, spec, x, b))  # the same call again, synchronised: what is not start-up
    out = dict(import_ms=import_ms, first_ms=1e3 * first_s, again_ms=1e3 * again_s, warm_us=H.warm_us(lambda: call(api, spec, x, b), calls, par.sync_every))
    if side == "aot" and par.aot.into is not None:
        bi = H.into_buffers(par, api, spec, x, {n: res[n] for n in par.outputs(spec)})
        out["into_us"] = H.warm_us(lambda: par.aot.into(api, spec, x, bi), calls, par.sync_every)
    out.update(device_us=H.device_us(lambda: call(api, spec, x, b)), add_us=H.torch_add_us(calls))
    print("BENCH " + json.dumps(out))


def measure(side, family, name, calls):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    r = subprocess.run([sys.executable, __file__, "--child", side, family, name, "--calls", str(calls)], capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("BENCH ")]
    if r.returncode or not lines:
        print(f"{family} {name} {side}: FAILED\n{r.stdout[-2000:]}{r.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][6:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help="default: every registered family")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--case", default="", help="time this case only (a name of the family's cases)")
    ap.add_argument("--child", nargs=3, metavar=("SIDE", "FAMILY", "CASE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(*a.child, a.calls)
    import torch

    from dsa_aot.policy.families import FAMILIES

    cap = torch.cuda.get_device_capability()
    arch = f"sm_{cap[0]}{cap[1]}a"
    have_jit = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "cudnn"))
    rows, ratios, failed = [], [], False
    for fam in a.families or FAMILIES:
        par = importlib.import_module(fam).PARITY
        if par.arches and arch not in par.arches:
            print(f"{fam}: no kernel for {arch}: skipped")
            continue
        if par.covers and arch not in par.covers:
            print(f"{fam}: its parity declaration does not cover {arch} yet (ci/parity/{fam}.py): not timed", file=sys.stderr)
            failed = True
            continue
        for name in [a.case] if a.case else (par.bench or [par.cases(False)[0][0]]):
            got = {s: measure(s, fam, name, a.calls) for s in (("aot", "jit") if have_jit else ("aot",))}
            failed |= any(v is None for v in got.values())
            for side, m in got.items():
                if m:
                    rows.append((fam, name, "dsa-aot" if side == "aot" else "cudnn JIT", f"{m['import_ms']:.1f}", f"{m['first_ms']:.1f}",
                                 f"{m['warm_us']:.1f}", f"{m['into_us']:.1f}" if "into_us" in m else "", f"{m['device_us']:.1f}", f"{m['add_us']:.1f}"))
            j, o = got.get("jit"), got["aot"]
            if j and o:
                ratios.append(f"{fam} {name}: first call cudnn / dsa-aot {j['first_ms'] / o['first_ms']:.0f}x; warm host dsa-aot / cudnn "
                              f"{o['warm_us'] / j['warm_us']:.2f} (_into {o.get('into_us', float('nan')) / j['warm_us']:.2f}); per torch.add: "
                              f"dsa-aot {o['warm_us'] / o['add_us']:.2f}, cudnn {j['warm_us'] / j['add_us']:.2f}")
    if not rows and not failed:
        return 2
    head = ("family", "case", "side", "import ms", "first call ms", "warm host us", "_into us", "device us", "torch.add us")
    print(f"device: {torch.cuda.get_device_name()} ({arch}); --calls {a.calls}" + ("" if have_jit else "; no cutlass/cudnn here: dsa-aot only"))
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    print("\n".join(["", *ratios]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
