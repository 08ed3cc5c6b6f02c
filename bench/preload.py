"""Start-up: ``dsa_aot.runtime.preload()`` of every entry of this build for GPU 0, and where its time goes.

    python bench/preload.py [--profile]   # on a GPU; each measurement in a fresh process, the toolchain blocked

``--profile`` prints cProfile's view of one fresh process's ``preload()`` instead (cache warmed first,
after torch initialised CUDA).

Fresh processes time ``preload()`` whole (``import dsa_aot.runtime`` included, as a server's start-up pays
it): the first with an empty bytecode cache (dsa_aot/runtime/bytecode.py), the others reading it; as the
process's first CUDA user (it pays cuInit and GPU 0's context) and after torch initialised CUDA (a
server's usual order); loading one entry at a time (as preload() does) and from 8 threads. Then
another fresh process loads every entry step by step, timing each step summed over the entries: the
cubin out of its group (each group read, checked and decompressed once) and its sha256, the launcher
likewise, its compile to bytecode, its execution, the
library load (cuLibraryLoadData) and the kernel handles; then the whole LoadedEntry again (files in
the page cache; its per-device set-up and launch state included). Prints a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = r"""
import sys, time, json, os
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
from _harness import block_toolchain
block_toolchain()
"""

WHOLE = PRELUDE + r"""
if TORCH_FIRST:  # a server's usual order: torch has initialised CUDA (driver and GPU 0's context) already
    import torch
    torch.zeros(1, device="cuda:0")
t0 = time.perf_counter()
import dsa_aot.runtime
if THREADS == 1:
    ms = dsa_aot.runtime.preload(0)
else:  # the same loads from a pool of threads (preload() loads in order: this measures why)
    from concurrent.futures import ThreadPoolExecutor
    from dsa_aot.runtime.index import index
    from dsa_aot.runtime.device import primary_context
    ix = index(); arch = ix.arch_for(0); primary_context(0)
    es = [e for e in ix.entries if e["arch"] == arch]
    with ThreadPoolExecutor(THREADS) as pool:
        ms = {e["id"]: le.load_ms for e, le in zip(es, pool.map(lambda e: ix.loaded(e, 0), es))}
t1 = time.perf_counter()
print(json.dumps({"entries": len(ms), "preload_ms": (t1 - t0) * 1e3, "sum_load_ms": sum(ms.values())}))
"""


def whole(threads, torch_first):
    return run(f"THREADS = {threads}\nTORCH_FIRST = {torch_first}\n" + WHOLE)


STEPS = PRELUDE + r"""
import hashlib, types
from pathlib import Path
from dsa_aot.runtime.index import index
from dsa_aot.runtime.driver import drv, check
from dsa_aot.runtime import loaded as L
ix = index()
arch = ix.arch_for(0)
es = [e for e in ix.entries if e["arch"] == arch]
d = drv()
dev = check(d.cuDeviceGet(0), "cuDeviceGet")
ctx = check(d.cuDevicePrimaryCtxRetain(dev), "retain")
d.cuCtxPushCurrent(ctx)
t = dict.fromkeys(["cubin from its group + sha256", "launcher from its group + sha256", "launcher compile (what the bytecode cache saves)",
                   "launcher check, code from the cache, exec, index checks",
                   "cuLibraryLoadData", "cuLibraryGetKernel per kernel", "whole LoadedEntry (again, files cached)"], 0.0)
for e in es:
    t0 = time.perf_counter(); data = ix.member(e, "cubin")
    t1 = time.perf_counter(); src = ix.member(e, "launcher")
    t2 = time.perf_counter(); code = compile(src, e["id"], "exec")
    t3 = time.perf_counter(); L._launcher_module(ix, e)  # check, code (from the bytecode cache), exec, index checks
    t4 = time.perf_counter(); lib = check(d.cuLibraryLoadData(data, None, None, 0, None, None, 0), "load")
    t5 = time.perf_counter()
    for sym in e.get("kernels") or ():
        check(d.cuLibraryGetKernel(lib, sym.encode()), "kernel")
    t6 = time.perf_counter(); L.LoadedEntry(ix, e, 0)
    t7 = time.perf_counter()
    t["cubin from its group + sha256"] += t1 - t0
    t["launcher from its group + sha256"] += t2 - t1
    t["launcher compile (what the bytecode cache saves)"] += t3 - t2
    t["launcher check, code from the cache, exec, index checks"] += t4 - t3
    t["cuLibraryLoadData"] += t5 - t4
    t["cuLibraryGetKernel per kernel"] += t6 - t5
    t["whole LoadedEntry (again, files cached)"] += t7 - t6
print(json.dumps({"entries": len(es), "cubin_mb": sum(e["cubin_bytes"] for e in es) / 1e6} | {k: v * 1e3 for k, v in t.items()}))
"""


def run(code):
    p = subprocess.run([sys.executable, "-c", f"ROOT = {ROOT!r}\n" + code], capture_output=True, text=True, cwd="/")
    if p.returncode:
        raise SystemExit(p.stderr.strip()[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


PROFILE = PRELUDE + r"""
import cProfile, io, pstats
import torch
torch.zeros(1, device="cuda:0")  # torch initialised CUDA first, as in a server: the profile is preload's own
import dsa_aot.runtime
pr = cProfile.Profile()
pr.enable()
dsa_aot.runtime.preload(0)
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
print(s.getvalue())
"""


def main():
    import tempfile

    if "--profile" in sys.argv[1:]:  # where a fresh process's preload() goes (bytecode cache warmed first)
        os.environ.setdefault("AOT_CACHE", tempfile.mkdtemp(prefix="dsa-aot-cache-bench-"))
        whole(1, False)
        p = subprocess.run([sys.executable, "-c", f"ROOT = {ROOT!r}\n" + PROFILE], capture_output=True, text=True, cwd="/")
        print(p.stdout or p.stderr[-3000:])
        return

    os.environ["AOT_CACHE"] = tempfile.mkdtemp(prefix="dsa-aot-cache-bench-")  # empty at the first run
    runs = [("bytecode cache empty", whole(1, False))]
    for torch_first in (False, True):
        for threads in (1, 8):
            for _ in range(2):
                runs.append((f"{'after torch initialised CUDA' if torch_first else 'first CUDA user'}, {threads} thread(s)", whole(threads, torch_first)))
    steps = run(STEPS)
    print(json.dumps({"whole": runs, "steps": steps}, indent=1))
    print(f"\n| preload() of {runs[0][1]['entries']} entries, fresh process each, `import dsa_aot.runtime` included | ms | entries' own load ms, summed |")
    print("|---|---:|---:|")
    for label, w in runs:
        print(f"| {label} | {w['preload_ms']:.1f} | {w['sum_load_ms']:.1f} |")
    print(f"\n| step, summed over {steps['entries']} entries ({steps['cubin_mb']:.1f} MB of cubins) | ms |")
    print("|---|---:|")
    for k, v in steps.items():
        if k not in ("entries", "cubin_mb"):
            print(f"| {k} | {v:.1f} |")


if __name__ == "__main__":
    main()
