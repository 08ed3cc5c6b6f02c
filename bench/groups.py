"""How to group a build's cubins: compressed size against the time one group takes to decompress.

    python bench/groups.py [BUILD]   # default dsa_aot/_generated; CPU only

For each grouping (one stream per arch; per (arch, family); per (arch, family, op); per (arch, family, op)
cut into groups of at most N MiB before compression; per (arch series, family, op) in 1 MiB groups with
the twins of a key on sm_100a and sm_103a side by side, as the pack stage does) the xz preset-6 size of all
groups and the median and max time to decompress one (``lzma.decompress``, one core), and the launchers
likewise. The pack stage's choice is ``dsa_aot.toolchain.pack.GROUP_BYTES`` (docs/artifact.md).
"""

from __future__ import annotations

import lzma
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def groups(members, cap):
    """(key, bytes) members in their order, grouped by key and cut at ``cap`` bytes: [[bytes, ...], ...]."""
    by: dict = {}
    for k, blob in members:
        chunks = by.setdefault(k, [[]])
        if chunks[-1] and sum(map(len, chunks[-1])) + len(blob) > cap:
            chunks.append([])
        chunks[-1].append(blob)
    return [c for cs in by.values() for c in cs]


def measure(gs):
    size, times = 0, []
    for g in gs:
        c = lzma.compress(b"".join(g), preset=6)
        t = time.perf_counter()
        lzma.decompress(c)
        times.append((time.perf_counter() - t) * 1e3)
        size += len(c)
    return len(gs), size, statistics.median(times), max(times)


def main(argv=None):
    from dsa_aot.runtime.index import Index

    root = Path((argv or sys.argv[1:] or [ROOT / "dsa_aot" / "_generated"])[0])
    ix = Index(root)
    from dsa_aot.policy.artifact import series as _series
    from dsa_aot.toolchain.pack import fill_order

    seen, cubins, launchers, twins = set(), [], [], []
    for e in fill_order(ix.entries):
        if e["sha256"] not in seen:
            seen.add(e["sha256"])
            twins.append(((_series(e["arch"]), e["family"], e["op"]), ix.member(e, "cubin")))
    seen = set()
    for e in ix.entries:
        for what, sha, out in (("cubin", e["sha256"], cubins), ("launcher", e["launcher_sha256"], launchers)):
            if sha not in seen:
                seen.add(sha)
                out.append(((e["arch"], e["family"], e["op"] if what == "cubin" else ""), ix.member(e, what)))
    raw = sum(len(b) for _, b in cubins)
    print(f"{root}: {len(ix.entries)} entries, {len(cubins)} distinct cubins ({raw / 1e6:.2f} MB), "
          f"{len(launchers)} launchers ({sum(len(b) for _, b in launchers) / 1e6:.2f} MB)")
    print("| members | grouping | groups | xz MB | decompress median ms | max ms |\n|---|---|---:|---:|---:|---:|")
    big = 1 << 40
    rows = [("one stream per arch", [((k[0],), b) for k, b in cubins], big), ("per (arch, family)", [(k[:2], b) for k, b in cubins], big),
            ("per (arch, family, op)", cubins, big)] + [(f"per (arch, family, op), {n} MiB groups", cubins, n << 20) for n in (4, 2, 1)] + [
            ("per (arch series, family, op), 1 MiB groups, twins side by side", twins, 1 << 20)]
    for name, ms, cap in rows:
        n, size, med, mx = measure(groups(ms, cap))
        print(f"| cubins | {name} | {n} | {size / 1e6:.2f} | {med:.1f} | {mx:.1f} |")
    for name, key in (("one stream per arch", lambda k: k[0]), ("per (arch, family)", lambda k: k[:2])):
        n, size, med, mx = measure(groups([(key(k), b) for k, b in launchers], big))
        print(f"| launchers | {name} | {n} | {size / 1e6:.3f} | {med:.1f} | {mx:.1f} |")


if __name__ == "__main__":
    main()
