"""Compare the cubins of two builds entry by entry.

    python ci/compare_builds.py A B

A and B: a build directory (``dsa_aot/_generated``), its ``index.json``, or a JSON file {entry id:
cubin sha256}. Prints how many entries have the same cubin sha256, which differ and which one side
lacks; with two directories, also whether every file of the two trees is byte-identical. Exit status 1
when any entry differs or is missing.
"""

from __future__ import annotations

import filecmp
import json
import sys
from pathlib import Path


def shas(path: Path) -> dict:
    p = path / "index.json" if path.is_dir() else path
    doc = json.loads(p.read_text())
    if isinstance(doc, dict) and "indexes" in doc:  # format 2: the entries are in the indexes per (family, arch series)
        return {e["id"]: e["sha256"] for f in doc["indexes"].values() for e in json.loads((p.parent / f["index"]).read_text())["entries"]}
    if isinstance(doc, dict) and "entries" in doc:  # format 1
        return {e["id"]: e["sha256"] for e in doc["entries"]}
    return dict(doc)


def _tree_diffs(a: Path, b: Path, rel=Path(".")) -> list:
    c = filecmp.dircmp(a / rel, b / rel)
    out = [str(rel / n) for n in c.left_only + c.right_only + c.funny_files]
    _, mismatch, errors = filecmp.cmpfiles(a / rel, b / rel, c.common_files, shallow=False)
    out += [str(rel / n) for n in mismatch + errors]
    for d in c.common_dirs:
        out += _tree_diffs(a, b, rel / d)
    return out


def main(argv=None) -> int:
    a, b = (Path(x) for x in (argv or sys.argv[1:]))
    sa, sb = shas(a), shas(b)
    same = sorted(k for k in sa.keys() & sb.keys() if sa[k] == sb[k])
    diff = sorted(k for k in sa.keys() & sb.keys() if sa[k] != sb[k])
    only = sorted(sa.keys() ^ sb.keys())
    print(f"{len(sa)} / {len(sb)} entries: {len(same)} same cubin, {len(diff)} differ, {len(only)} on one side only")
    for k in diff:
        print(f"  differs: {k}")
    for k in only:
        print(f"  only in {'A' if k in sa else 'B'}: {k}")
    bad = bool(diff or only)
    if a.is_dir() and b.is_dir():
        files = _tree_diffs(a, b)
        print("trees: byte-identical" if not files else f"trees: {len(files)} files differ: {', '.join(files[:10])}")
        bad |= bool(files)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
