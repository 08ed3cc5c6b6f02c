"""How big to make a build's groups: the wheel's size against what a fresh process's first load decompresses.

    python bench/groups.py [BUILD] [--mib 1,2,4]   # default dsa_aot/_generated; CPU only

BUILD's entries and members are packed again by the pack stage's own ``write_tree`` with groups of each size
(``--mib``); per size: the groups, the xz bytes of the cubins, of the launchers and the indexes, the
directory zipped as a wheel zips it, and the time to read one entry's cubin and launcher from a fresh
process's view with no kept members (``policy.artifact.read_member``: the group file read and checked, its
stream decompressed up to the member), median, 90th percentile and max over every entry (one core). The
pack stage's choice is ``dsa_aot.policy.artifact.GROUP_BYTES`` (docs/artifact.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def zipped(root: Path) -> int:
    """The bytes of ``root`` in a zip as a wheel writes it (deflate, each file on its own)."""
    with tempfile.TemporaryDirectory() as d:
        with zipfile.ZipFile(Path(d) / "t.zip", "w", zipfile.ZIP_DEFLATED) as z:
            for p in sorted(root.rglob("*")):
                if p.is_file():
                    z.write(p, p.relative_to(root))
        return (Path(d) / "t.zip").stat().st_size


def first_reads(root: Path) -> list:
    """ms to read each entry's cubin and launcher with nothing decompressed yet."""
    from dsa_aot.policy.artifact import load_family, load_index, read_member

    doc, out = load_index(root), []
    for name in doc["indexes"]:
        fdoc, entries, _ = load_family(root, doc, name)
        for e in entries:
            t = time.perf_counter()
            cache: dict = {}
            read_member(root, fdoc, e["cubin"], e["sha256"], "cubin", cache)
            read_member(root, fdoc, e["launcher"], e["launcher_sha256"], "launcher", cache)
            out.append((time.perf_counter() - t) * 1e3)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", nargs="?", default=str(ROOT / "dsa_aot" / "_generated"))
    ap.add_argument("--mib", default="1,2,4")
    a = ap.parse_args(argv)
    from dsa_aot.runtime.index import Index
    from dsa_aot.toolchain.pack import write_tree

    ix = Index(Path(a.build))
    entries = ix.entries
    blobs = {}
    for e in entries:
        blobs[e["sha256"]], blobs[e["launcher_sha256"]] = ix.member(e, "cubin"), ix.member(e, "launcher")
    header = {k: ix.doc[k] for k in ("manifest", "tools", "for_shipping") if k in ix.doc}
    cub = {e["sha256"] for e in entries}
    print(f"{a.build}: {len(entries)} entries, {len(cub)} distinct cubins ({sum(len(blobs[s]) for s in cub) / 1e6:.2f} MB), "
          f"{len({e['launcher_sha256'] for e in entries})} launchers")
    print("| groups of | groups | cubins xz MB | launchers xz MB | indexes MB | zipped MB | first read median ms | p90 ms | max ms |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mib in map(float, a.mib.split(",")):
        with tempfile.TemporaryDirectory() as d:
            root = Path(d) / "gen"
            write_tree(root, header, entries, blobs, group_bytes=int(mib * (1 << 20)))
            packs = list((root / "packs").iterdir())
            size = {k: sum(p.stat().st_size for p in packs if (".launchers." in p.name) == k) for k in (False, True)}
            idx = sum(p.stat().st_size for p in (root / "index").iterdir())
            ms = sorted(first_reads(root))
            print(f"| {mib:g} MiB | {len(packs)} | {size[False] / 1e6:.2f} | {size[True] / 1e6:.3f} | {idx / 1e6:.2f} | {zipped(root) / 1e6:.2f} | "
                  f"{statistics.median(ms):.2f} | {ms[int(0.9 * (len(ms) - 1))]:.2f} | {ms[-1]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("AOT_CACHE", "off")
    sys.exit(main())
