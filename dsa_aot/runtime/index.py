"""The shipped build's index: which entry serves (family, op, key, arch), and its loaded form per device.

Nothing here runs at import. ``index.json`` (the table of indexes) is read on first use; the index of a
family's entries for a GPU's arch series the first time one of its ops looks up an entry there; a group
file (checked by its sha256) the first time one of its entries loads, and decompressed only as far as that
entry's members unless an earlier process kept them (:mod:`dsa_aot.runtime.cache`); an entry is loaded
on a device the first time it is used there (or by :func:`dsa_aot.runtime.preload`), see
:mod:`dsa_aot.runtime.loaded`. The format: :mod:`dsa_aot.policy.artifact`.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..errors import ArchMismatchError, KernelNotFoundError
from ..policy.artifact import index_name, load_family, load_index, lookup_fields, open_group, read_member
from . import cache
from .device import arch_of, device

__all__ = ["Index", "index", "nearest", "GENERATED"]

GENERATED = Path(__file__).resolve().parent.parent / "_generated"


def _sms(e) -> int:
    return e.get("target", {}).get("sm_count", 0)


def _add_target(arch, sms, have, why) -> str:
    return (f"this GPU has {sms} SMs; this build's {arch} cubins are for {', '.join(map(str, sorted(have)))} SMs and {why}. Add a "
            f"[[target]] with arch = {arch!r}, sm_count = {sms} to the manifest and rebuild")


def nearest(by_sms: dict, sms):
    """Of one key's entries by target SM count, the one for ``sms`` SMs (the lower count on a tie; any when ``sms`` is None)."""
    return by_sms[min(by_sms, key=lambda n: (abs(n - (sms or n)), n))]


class Index:
    """A build directory: entries by (family, op, key, arch), read per (family, arch series).

    index.json is checked against ``index.sha256`` beside it, each index against the sha256 index.json
    records and every entry's fields against what the runtime needs before anything is looked up; the
    cubin and launcher an entry names are checked when it loads."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.doc = load_index(self.root)  # checked as the build tool checks it before shipping
        self.arches = sorted(self.doc["arches"])
        self._sms = {a: set(n) for a, n in self.doc["arches"].items()}
        self._families: dict = {}  # index name -> (its document, its entries, {(family, op, key, arch): {sm count: entry}})
        self._groups: dict = {}  # group -> its checked file, decompressed as far as asked (kept: a group serves several entries)
        self._members: dict = {}  # sha256 -> member bytes fetched ahead (prefetch)
        self._group_locks: dict = {}
        self._loaded: dict = {}
        self._loading: dict = {}
        self._lock = threading.Lock()

    def _family(self, name):
        """Index ``name`` (``index_name(family, arch)``), read once; None where the build has none."""
        f = self._families.get(name)
        if f is None and name in self.doc["indexes"]:
            with self._lock:
                f = self._families.get(name)
                if f is None:
                    fdoc, entries, keys = load_family(self.root, self.doc, name)
                    by_key: dict = {}
                    for e, k in zip(entries, keys):
                        by_key.setdefault((e["family"], e["op"], k, e["arch"]), {})[_sms(e)] = e
                    f = self._families[name] = (fdoc, entries, by_key)
        return f

    @property
    def entries(self) -> list:
        """Every entry of the build (reads every index)."""
        return [e for name in self.doc["indexes"] for e in self._family(name)[1]]

    def keys(self, arch) -> dict:
        """{(family, op, key, arch): {sm count: entry}} of every family, for ``arch`` (reads its series' indexes)."""
        names = [n for n, ref in self.doc["indexes"].items() if n == index_name(ref["family"], arch)]
        return {k: v for n in names for k, v in self._family(n)[2].items() if k[3] == arch}

    def member(self, entry, what: str) -> bytes:
        """The checked bytes of ``entry``'s ``what`` ("cubin" or "launcher").

        Its group's file is read and checked by its sha256 once per process whatever the source of the
        bytes: a fetched-ahead copy, one an earlier process kept, or the group decompressed up to the
        member (then kept for the next process). A kept copy is used only if it hashes to the sha256 the
        checked index names: it stands for bytes the intact group holds, as the build recorded them."""
        fdoc = self._family(index_name(entry["family"], entry["arch"]))[0]
        group, sha = (entry["cubin"], entry["sha256"]) if what == "cubin" else (entry["launcher"], entry["launcher_sha256"])
        with self._lock:
            lock = self._group_locks.setdefault(group, threading.Lock())
        with lock:  # one reader per group; other groups are read in parallel
            open_group(self.root, fdoc, group, self._groups)
            data = self._members.get(sha) or cache.member(sha)
            if data is None:
                data = read_member(self.root, fdoc, group, sha, f"{what} of {entry['id']}", self._groups)
                cache.keep_member(sha, data)
            return data

    def prefetch(self, entries, threads: int = 8) -> None:
        """Decompress ahead, one thread per group at a time (lzma lets go of the GIL), the cubins and launchers
        of ``entries`` that no earlier process kept, for loads that follow one after another
        (:func:`dsa_aot.runtime.preload`). Kept copies are left to the loads: read one after another they
        took 55 ms for the 718 ``sm_90a`` entries on the 2-core build machine, 180-190 ms in 8 threads."""
        by_group: dict = {}
        kept = cache.kept_members()
        for e in entries:
            for what, group, sha in (("cubin", e["cubin"], e["sha256"]), ("launcher", e["launcher"], e["launcher_sha256"])):
                if sha not in self._members and sha not in kept:
                    by_group.setdefault(group, []).append((e, what, sha))
        if not by_group:
            return
        from concurrent.futures import ThreadPoolExecutor  # (~8 ms to import: not when every member is kept)

        def fetch(items):
            for e, what, sha in items:
                self._members[sha] = self.member(e, what)

        with ThreadPoolExecutor(max_workers=min(threads, len(by_group))) as pool:
            for f in [pool.submit(fetch, items) for items in by_group.values()]:
                f.result()

    def drop_groups(self) -> None:
        """Let go of the groups' bytes and of what was fetched ahead (a later load reads them again)."""
        self._groups.clear()
        self._members.clear()

    def target_sm_count(self, arch, sms: int) -> int:
        """The SM count of the build's target of ``arch`` for a GPU with ``sms`` SMs, for the ops that bake it
        in (persistent grids): that GPU's own; ArchMismatchError naming the target to add when the build has
        none."""
        have = self._sms.get(arch)
        if not have:
            raise ArchMismatchError(f"this build has no target for {arch} (it has: {', '.join(self.arches)})")
        if sms not in have:
            raise ArchMismatchError(_add_target(arch, sms, have, "its persistent kernels bake the SM count in"))
        return sms

    def find(self, family, op, key: dict, arch, hint="", sms=None, exact=False):
        """The entry of (family, op, key) for a GPU of ``arch`` with ``sms`` SMs: the target with that SM
        count; where there is none, for an op that does not bake the SM count in (``exact`` false), the
        target with the nearest (the lower on a tie); otherwise ArchMismatchError naming the target to add."""
        fam = self._family(index_name(family, arch))
        try:
            by_sms = fam[2].get((family, op, lookup_fields(key), arch)) if fam else None
        except TypeError:  # an unhashable key value: no entry has it
            by_sms = None
        if by_sms:
            e = by_sms.get(sms)
            if e is not None:
                return e
            if exact and sms is not None:
                raise ArchMismatchError(_add_target(arch, sms, by_sms, f"{family}/{op} bakes the SM count into its cubins"))
            return nearest(by_sms, sms)
        if arch not in self.arches:
            raise ArchMismatchError(f"this build has no cubins for {arch} (it has: {', '.join(self.arches)}). Add a [[target]] with arch = {arch!r} to the manifest and rebuild")
        fields = "\n  ".join(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}" for k, v in sorted(key.items()))
        raise KernelNotFoundError(
            f"no shipped {family}/{op} entry for {key} on {arch}{hint}. Add to the manifest:\n"
            f"  [[bucket]]\n  family = {family!r}\n  op = {op!r}\n  {fields}\nand rebuild the wheel"
        )

    def arch_for(self, dev: int) -> str:
        """The arch of this build's cubins that GPU ``dev`` runs (ArchMismatchError when there is none)."""
        return arch_of(device(dev), self.arches)

    def loaded(self, entry, dev: int):
        """``entry`` loaded on GPU ``dev`` (loaded on first use, once per process)."""
        k = (entry["id"], dev)
        le = self._loaded.get(k)
        if le is None:
            from .loaded import LoadedEntry

            with self._lock:  # one lock per (entry, device): different entries load in parallel
                lock = self._loading.setdefault(k, threading.Lock())
            with lock:
                le = self._loaded.get(k)
                if le is None:
                    le = LoadedEntry(self, entry, dev)
                    self._loaded[k] = le
        return le


_INDEX = None
_INDEX_LOCK = threading.Lock()


def index() -> Index:
    global _INDEX
    if _INDEX is None:
        with _INDEX_LOCK:
            if _INDEX is None:
                _INDEX = Index(GENERATED)
    return _INDEX
