"""Host cost per call of this tree's ops against an earlier tree's, in ONE process: an A/B without the
process-to-process spread (about +-20 % on the shared H200) that separate processes carry.

    python bench/ab.py --before ROOT [--rounds 9] [--calls 300]     # on a GPU, with dsa_aot/_generated built

ROOT is a checkout of an earlier commit whose ``dsa_aot/_generated`` is this tree's build (a symlink), or a
build made with that commit where the build format changed between the two (the same cubins). Its
package is imported a second time as ``dsa_aot_before`` (its relative imports stay inside it; what it names
by absolute path, the policy registry and the generated launchers, is this tree's: the same code in both
trees for these ops), so both op implementations run side by side on the same build, inputs and stream.
The rows: every case of bench/host_floor.py (its inputs made once, shared by the two trees), its plan, ``_into``
and allocating forms. Each round times ``--calls`` calls of every row in both trees, the order of the two alternating per round;
a call is timed alone (the device synchronised every 20 calls, outside the timing). Printed: the median per
call over all rounds per tree, and the median of the per-round ratios this / before.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # this tree's dsa_aot, as host_floor's PRELUDE does in its subprocesses
from _harness import per_call  # noqa: E402


def _before(root):
    pkg = os.path.join(os.path.abspath(root), "dsa_aot")
    spec = importlib.util.spec_from_file_location("dsa_aot_before", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dsa_aot_before"] = mod
    spec.loader.exec_module(mod)
    return mod


def _namespaces(pkg):
    """``dsa_aot.csa`` / ``dsa_aot.dsa`` of one tree, gathered from its op modules (its own export() imports this
    tree's by absolute name)."""
    from types import SimpleNamespace

    from dsa_aot.policy.families import FAMILIES

    spaces = {"csa": SimpleNamespace(), "dsa": SimpleNamespace()}
    for family, fam in FAMILIES.items():
        mod = importlib.import_module(f"{pkg}.ops.{family}")
        for n in mod.__all__:
            setattr(spaces[fam.namespace], n, getattr(mod, n))
    return SimpleNamespace(**spaces)


def rows(cases, torch):
    """{tree: {"case: row": fn}}: bench/host_floor.py's cases (their inputs made once, shared by both trees), each
    case's AOT rows run once per tree."""
    from host_floor import CASES, ROOT

    out = {"this": {}, "before": {}}
    for case in cases:
        setup, aot, _ = CASES[case]
        env = {"ROOT": ROOT, "sys": sys, "os": os, "math": __import__("math"), "torch": torch, "dev": torch.device("cuda", 0)}
        torch.manual_seed(0)
        exec(setup, env)  # noqa: S102 (the benchmark's own case text)
        body = re.sub(r"^import dsa_aot\.\w+\n", "", aot, flags=re.M)
        for tree, pkg in (("this", "dsa_aot"), ("before", "dsa_aot_before")):
            g = dict(env, dsa_aot=_namespaces(pkg), rows={})
            exec(body, g)  # noqa: S102
            out[tree].update({f"{case}: {r}": fn for r, fn in g["rows"].items()})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, metavar="ROOT")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--cases", default=None, help="comma-separated bench/host_floor.py cases (default: all)")
    a = ap.parse_args(argv)
    import torch

    from host_floor import CASES

    _before(a.before)
    sides = rows([c for c in CASES if a.cases is None or c in a.cases.split(",")], torch)
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
