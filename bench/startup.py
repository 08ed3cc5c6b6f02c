"""Start-up in fresh processes: import and first call of one op per family, and preload() of every entry, for
this tree and (``--before``) another tree with its own build, in one run.

    python bench/startup.py [FAMILY ...] [--before DIR] [--runs 5]   # on a GPU

DIR holds a ``dsa_aot`` package with its ``_generated`` build (an earlier commit's ``git archive`` and the build
made with it: the two trees may differ in their build format). Per family the case is its parity
declaration's first bench case; both trees' sources are byte-compiled first (as an installed wheel's are);
each run is a fresh process as bench/run.py's dsa-aot side makes it: torch, CUDA and the inputs are set
up first (a server's order), then the op's import and its first call, synchronised; the figure is import + first call. Run 0 of each tree starts with an empty bytecode cache
(the first start on a machine: dsa_aot/runtime/bytecode.py); runs 1.. share a warm one, and their median
and max are the table's. ``preload()`` of every entry for GPU 0 likewise, after torch's CUDA init.
Prints a table and the ratios of the two trees, measured in this run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "ci", "parity")]

PRELOAD = r"""
import sys, time, json, os
sys.path[:0] = [os.path.join(ROOT, "bench")]
from _harness import block_toolchain
block_toolchain()
import torch
torch.zeros(1, device="cuda:0")
t0 = time.perf_counter()
import dsa_aot.runtime
ms = dsa_aot.runtime.preload(0)
torch.cuda.synchronize()
print("BENCH " + json.dumps({"entries": len(ms), "ms": (time.perf_counter() - t0) * 1e3}))
"""


# every child's bytecode, of every package, in one place this run fills first (installed packages have theirs:
# without it, each process of a machine whose packages were installed without .pyc files, or with
# PYTHONDONTWRITEBYTECODE set, compiled cuda-python's pure-Python modules again, 15 of them, ~6 ms under cProfile)
PYC = ""


def _env(**kw):
    env = dict(os.environ, PYTHONPYCACHEPREFIX=PYC, **kw)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run(tree, cache, args, profile=""):
    env = _env(PYTHONPATH=tree, AOT_CACHE=cache, AOT_BYTECODE_CACHE=cache, BENCH_PROFILE=profile)  # the before tree may know only the second
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd="/")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("BENCH ")]
    if r.returncode or not lines:
        raise SystemExit(f"{tree}: {' '.join(args[:4])} failed\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return json.loads(lines[-1][6:])


def first_call(tree, cache, family, case, profile=""):
    """(import + first call, the import, the same call again) in ms, of one fresh process."""
    m = _run(tree, cache, [os.path.join(ROOT, "bench", "run.py"), "--child", "aot", family, case, "--calls", "5"], profile)
    return m["import_ms"] + m["first_ms"], m["import_ms"], m.get("again_ms", float("nan"))


def profile(family, case, cache, top=14):
    """One more process of this tree (warm bytecode cache) under cProfile: the functions with the most own time."""
    import pstats

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "prof")
        total = first_call(ROOT, cache, family, case, path)[0]
        st = pstats.Stats(path)
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
        lines = [f"  {tt * 1e3:7.2f} ms own {ct * 1e3:7.2f} ms cum {nc:5d}x {os.path.basename(f)}:{ln} {fn}" for (f, ln, fn), (_, nc, tt, ct, _) in rows]
        return f"{family} / {case}: import + first call {total:.1f} ms under cProfile\n" + "\n".join(lines)


def preload(tree, cache):
    m = _run(tree, cache, ["-c", f"ROOT = {ROOT!r}\n" + PRELOAD])
    return m["ms"], m["entries"]


def series(fn, runs):
    """Run 0 with an empty bytecode cache, runs 1..runs with the cache it left: (cold, [warm...])."""
    with tempfile.TemporaryDirectory() as cache:
        cold = fn(cache)
        return cold, [fn(cache) for _ in range(runs)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help="default: every registered family with a kernel for this GPU")
    ap.add_argument("--before", default="", help="another tree (dsa_aot and its _generated) to measure beside this one")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also profile one more first call of this tree per family (cProfile, own time)")
    a = ap.parse_args(argv)
    import torch

    from dsa_aot.policy.families import FAMILIES

    cap = torch.cuda.get_device_capability()
    arch = f"sm_{cap[0]}{cap[1]}a"
    trees = {"this": ROOT} | ({"before": os.path.abspath(a.before)} if a.before else {})
    ratios = []
    global PYC
    PYC = tempfile.mkdtemp(prefix="dsa-aot-bench-pyc-")
    for p in trees.values():  # as pip installs a wheel: the sources byte-compiled (else each first call compiles ~40 modules)
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(p, "dsa_aot")], check=True, stdout=subprocess.DEVNULL, env=_env())
    # and what the children import from the environment (torch, cuda-python, the harness)
    subprocess.run([sys.executable, "-c", "import torch, cuda.bindings.driver, harness, _harness"], check=True, cwd="/",
                   env=_env(PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "ci", "parity"), os.path.join(ROOT, "bench")])))
    head = ("op", "case", "tree", "cold cache ms", "median ms", "max ms", "of it the import", "the call again")
    print(f"device: {torch.cuda.get_device_name()} ({arch}); {a.runs} fresh processes per row after one with an empty bytecode cache; "
          f"import + first call, synchronised, after torch's CUDA init and the inputs; medians of the import alone and of the same call "
          f"made again in the process (synchronised: the op's own host and device time, which is not start-up)")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)

    def row(*r):  # printed as measured: a run cut short by a time limit keeps what it measured
        print("| " + " | ".join(r) + " |", flush=True)

    for fam in a.families or FAMILIES:
        par = importlib.import_module(fam).PARITY
        if par.arches and arch not in par.arches:
            continue
        case = (par.bench or [par.cases(False)[0][0]])[0]
        got = {t: series(lambda c, p=p: first_call(p, c, fam, case), a.runs) for t, p in trees.items()}
        if a.profile:
            with tempfile.TemporaryDirectory() as c:
                first_call(ROOT, c, fam, case)  # warm the bytecode cache, as the table's median runs have it
                print(profile(fam, case, c), flush=True)
        for t, (cold, warm) in got.items():
            med = lambda i: statistics.median(w[i] for w in warm)  # noqa: E731
            row(fam, case, t, f"{cold[0]:.1f}", f"{med(0):.1f}", f"{max(w[0] for w in warm):.1f}", f"{med(1):.1f}", f"{med(2):.1f}")
        if "before" in got:
            m = {t: statistics.median(w[0] for w in got[t][1]) for t in got}
            ratios.append(f"{fam}: first call median this / before {m['this'] / m['before']:.2f}")
    pre = {t: series(lambda c, p=p: preload(p, c), a.runs) for t, p in trees.items()}
    for t, (cold, warm) in pre.items():
        row(f"preload() ({cold[1]} entries)", "", t, f"{cold[0]:.1f}", f"{statistics.median(w[0] for w in warm):.1f}", f"{max(w[0] for w in warm):.1f}", "", "")
    if "before" in pre:
        ratios.append(f"preload() median this / before {statistics.median(w[0] for w in pre['this'][1]) / statistics.median(w[0] for w in pre['before'][1]):.2f}")
    print("\n".join(["", *ratios]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
