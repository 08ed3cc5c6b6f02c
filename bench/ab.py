"""Host cost per call of this tree's ops against an earlier tree's, in ONE process: an A/B without the
process-to-process spread (about +-20 % on the shared H200) that separate processes carry.

    python bench/ab.py --before ROOT [--rounds 9] [--calls 300]     # on a GPU, with dsa_aot/_generated built

ROOT is a checkout of an earlier commit whose ``dsa_aot/_generated`` is this tree's build (a symlink). Its
package is imported a second time as ``dsa_aot_before`` (its relative imports stay inside it; what it names
by absolute path, the policy registry and the generated launchers, is this tree's: the same code in both
trees for these ops), so both op implementations run side by side on the same build, inputs and stream.
Each round times ``--calls`` calls of every row in both trees, the order of the two alternating per round;
a call is timed alone (the device synchronised every 20 calls, outside the timing). Printed: the median per
call over all rounds per tree, and the median of the per-round ratios this / before.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _harness import per_call  # noqa: E402


def _before(root):
    pkg = os.path.join(os.path.abspath(root), "dsa_aot")
    spec = importlib.util.spec_from_file_location("dsa_aot_before", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dsa_aot_before"] = mod
    spec.loader.exec_module(mod)
    return mod


def rows(pkg, torch):
    """{row: fn} of one tree's ops (``pkg`` the package name), on the inputs of bench/host_floor.py's cases."""
    tk = importlib.import_module(f"{pkg}.ops.dsa_indexer_top_k")
    tu = importlib.import_module(f"{pkg}.ops.dsa_topk_utils")
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(64, 8192, device=dev, generator=g)
    sl = torch.full((64,), 8192, dtype=torch.int32, device=dev)
    idx, val = torch.empty(64, 2048, dtype=torch.int32, device=dev), torch.empty(64, 2048, device=dev)
    ws = torch.empty(tk.indexer_top_k_workspace_bytes(x), dtype=torch.uint8, device=dev)
    local = torch.randint(0, 8192, (2, 1024, 2048), dtype=torch.int32, device=dev, generator=g)
    gl = torch.empty_like(local)
    ids = torch.randint(-1, 8192, (4096, 2048), dtype=torch.int32, device=dev, generator=g)
    out, n = torch.empty_like(ids), torch.empty(4096, dtype=torch.int32, device=dev)
    p_tk, p_l2g, p_cmp = tk.IndexerTopK(idx, val, x, sl, 2048, workspace=ws), tu.LocalToGlobal(gl, local, 8192), tu.Compactify(out, n, ids)
    return {
        "indexer top-k: plan.execute": lambda: p_tk.execute(idx, val, x, sl, ws),
        "indexer top-k: _into": lambda: tk.indexer_top_k_into(idx, val, x, sl, 2048, workspace=ws),
        "indexer top-k: allocating": lambda: tk.indexer_top_k(x, sl, 2048),
        "local_to_global: plan.execute": lambda: p_l2g.execute(gl, local),
        "local_to_global: _into": lambda: tu.local_to_global_into(gl, local, 8192),
        "local_to_global: allocating": lambda: tu.local_to_global(local, 8192),
        "compactify: plan.execute": lambda: p_cmp.execute(out, n, ids),
        "compactify: _into": lambda: tu.compactify_into(out, n, ids),
        "compactify: allocating": lambda: tu.compactify(ids),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, metavar="ROOT")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args(argv)
    import torch

    _before(a.before)
    sides = {"this": rows("dsa_aot", torch), "before": rows("dsa_aot_before", torch)}
    for fns in sides.values():  # every entry loaded, every plan cached, before timing
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    ns = {(s, r): [] for s in sides for r in sides[s]}
    ratio = {r: [] for r in sides["this"]}
    for i in range(a.rounds):
        for r in sides["this"]:
            med = {}
            for s in (("this", "before") if i % 2 == 0 else ("before", "this")):
                t = per_call(sides[s][r], a.calls)
                ns[(s, r)] += t
                med[s] = statistics.median(t)
            ratio[r].append(med["this"] / med["before"])
    print(f"device: {torch.cuda.get_device_name()}; {a.rounds} rounds x {a.calls} calls per row and tree, one process; before: {a.before}")
    print("| row | this tree us | before us | this / before (median of rounds) | per-round range |\n|---|---:|---:|---:|---|")
    for r in ratio:
        this, before = statistics.median(ns[("this", r)]) / 1e3, statistics.median(ns[("before", r)]) / 1e3
        print(f"| {r} | {this:.2f} | {before:.2f} | {statistics.median(ratio[r]):.3f} | {min(ratio[r]):.2f}-{max(ratio[r]):.2f} |")


if __name__ == "__main__":
    main()
