"""Lines per kernel family: what adding or changing a family costs.

    python ci/family_lines.py [--check]

Per registered family, the lines of its policy (dsa_aot/policy/<family>.py), ops (dsa_aot/ops/<family>.py),
spec (kernels/<family>.py), bench (bench/<family>.py) and parity (ci/parity/<family>.py) files, their sum
(the family's non-test code) and the lines of its tests (tests/**/test_<family>*.py, ref_<family>*.py and
the refs' tests). The budget (issue 30): at most 900 lines of non-test code, or at most 300 per public op
for a family of more than three ops (public ops: the op module's allocating functions, not their
``_into`` forms, sizing helpers or plan classes). ``--check`` exits 1 when a family is over it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"policy": "dsa_aot/policy/{f}.py", "ops": "dsa_aot/ops/{f}.py", "kernels": "kernels/{f}.py", "bench": "bench/{f}.py",
         "parity": "ci/parity/{f}.py"}  # bench: none since bench/run.py times every family's parity declaration (counted if one returns)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def public_ops(family: str) -> list:
    mod = importlib.import_module(f"dsa_aot.ops.{family}")
    helpers = set(getattr(mod, "HELPERS", ()))
    return [n for n in mod.__all__ if not n.endswith(("_into", "_bytes")) and n not in helpers and not isinstance(getattr(mod, n), type)
            and callable(getattr(mod, n))]


def test_files(family: str) -> list:
    short = "csa" if family.startswith("csa_") else family.removeprefix("dsa_")  # tests/gpu/test_csa_ops.py, ref_csa.py
    pats = [f"test_{family}*.py", f"test_{short}*.py", f"ref_{short}*.py", f"test_ref_{short}*.py"]
    out = set()
    for pat in pats:
        out |= set((ROOT / "tests").rglob(pat))
    return sorted(out)


def table() -> list:
    sys.path.insert(0, str(ROOT))
    from dsa_aot.policy.families import FAMILIES

    rows = []
    for f in FAMILIES:
        parts = {k: lines(ROOT / v.format(f=f)) for k, v in PARTS.items()}
        code = sum(parts.values())
        ops = public_ops(f)
        budget = 300 * len(ops) if len(ops) > 3 else 900
        rows.append({"family": f, **parts, "code": code, "public ops": len(ops), "budget": budget, "tests": sum(lines(p) for p in test_files(f)),
                     "ok": code <= budget})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a family is over its budget")
    a = ap.parse_args(argv)
    rows = table()
    cols = ["family", *PARTS, "code", "public ops", "budget", "tests"]
    print("| " + " | ".join(cols) + " | within |")
    print("|---|" + "---:|" * (len(cols) - 1) + "---|")
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + f" | {'yes' if r['ok'] else 'NO'} |")
    print("| total | " + " | ".join(str(sum(r[c] for r in rows)) for c in cols[1:]) + " | |")
    return 1 if a.check and not all(r["ok"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
