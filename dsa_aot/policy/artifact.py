"""The shipped build's on-disk contract, one piece for both sides of it.

A build directory holds:
  index.json               the build: tools, targets per arch, and per (family, arch series) its index file
                           and that file's sha256
  index.sha256             the sha256 of index.json
  index/<family>.<series>.json
                           that family's entries for that series' arches, the table of their kernels (name and
                           parameter sizes; an entry names its kernels by their place in it) and their groups:
                           per group its file, the file's sha256 and where each member (a cubin or a launcher
                           source, by its sha256) lies once decompressed
  packs/<group>.xz         one xz stream of a group's members, concatenated

Each file is covered by the one above it, down to every cubin and launcher by its own sha256 (checked after
decompression). Cubins are grouped per (arch series, family, op), a family's launchers per arch series,
in streams of about ``GROUP_BYTES`` (the trade-off: docs/artifact.md). A
group is decompressed only as far as the member asked for (:func:`read_member`): a first call pays for the
members before its own in the stream, not for the whole group.

:mod:`dsa_aot.toolchain.pack` writes it (:func:`dsa_aot.toolchain.pack.write_tree`) and checks a finished
build with this code before it ships (``check-build``); :mod:`dsa_aot.runtime.index` reads it with the same
code, so what passes the build's check is what the runtime accepts. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from pathlib import Path

from ..errors import KernelNotFoundError, LaunchError

__all__ = ["FORMAT", "GROUP_BYTES", "series", "index_name", "load_index", "load_family", "open_group", "read_member", "read_checked", "lookup_key", "lookup_fields"]

FORMAT = 3

# bytes of members per group before compression (docs/artifact.md has the measurements behind it)
GROUP_BYTES = 2 << 20


def series(arch: str) -> str:
    """The arches whose cubins share an index and groups: one major compute capability (sm_100a and sm_103a:
    "sm_10x"; sm_90a: "sm_9x")."""
    return arch.rstrip("abcdefghijklmnopqrstuvwxyz")[:-1] + "x"


def index_name(family: str, arch: str) -> str:
    """The name of the index holding ``family``'s entries for ``arch``."""
    return f"{family}.{series(arch)}"


def read_checked(root: Path, rel, sha256: str, what: str) -> bytes:
    """The bytes of build file ``rel`` (inside ``root``), refused unless their sha256 is ``sha256``."""
    if not isinstance(rel, str) or not isinstance(sha256, str):
        raise LaunchError(f"the build's index names a {what} as {rel!r} with sha256 {sha256!r} (expected strings). Reinstall or rebuild the wheel")
    # a relative path of plain names stays inside the build (checked on the string: resolving every file's
    # path took 26 ms of a 93-entry preload on the H200's host)
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or any(x in ("", ".", "..") for x in parts):
        raise LaunchError(f"the build's index names {what} {rel!r}, outside the build directory {root}. Reinstall or rebuild the wheel; nothing was launched")
    path = os.path.join(root, rel)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise LaunchError(f"cannot read {what} {path}: {e.strerror}. Reinstall or rebuild the wheel; nothing was launched") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise LaunchError(f"{what} {path} is corrupted: sha256 {got} != {sha256} recorded at build time. Reinstall or rebuild the wheel; nothing was launched")
    return data


def lookup_fields(d: dict, derived=()) -> tuple:
    """Key fields ``d`` as the index looks them up (hashable, in order), ``derived`` ones left out."""
    return tuple(sorted((k, v) for k, v in d.items() if k not in derived))


# "cubin" and "launcher" name the groups that hold them, "sha256" and "launcher_sha256" the members
_FIELDS = {"id": str, "family": str, "op": str, "key": dict, "arch": str, "cubin": str, "sha256": str, "launcher": str,
           "launcher_sha256": str, "kernels": list, "params": dict}
_FIELDS_ITEMS = tuple(_FIELDS.items())


def lookup_key(e):
    """The key ``e`` is looked up by (the op's own key fields: derived ones, such as a schedule list,
    are not looked up), or None when the entry lacks a field the runtime needs."""
    if not isinstance(e, dict):
        return None
    for k, t in _FIELDS_ITEMS:  # a loop, not any(<genexpr>): a third of a family index's checks on the build machine
        if not isinstance(e.get(k), t):
            return None
    derived = e.get("derived", ("schedule",))
    if not isinstance(derived, list | tuple):
        return None
    if "target" in e and not (isinstance(e["target"], dict) and isinstance(e["target"].get("sm_count"), int)):
        return None
    try:
        k = lookup_fields(e["key"], derived)
        hash(k)
    except TypeError:
        return None
    return k


def _json(path: Path, text: bytes):
    try:
        return json.loads(text)
    except ValueError as e:
        raise LaunchError(f"{path} is not valid JSON ({e}). Reinstall or rebuild the wheel") from None


def load_index(root: Path) -> dict:
    """``index.json`` of build directory ``root``, checked: against ``index.sha256``, its format, not a debug build
    (unless AOT_ALLOW_DEBUG_BUILD=1), its table of indexes and targets. The entries are read per (family,
    arch series) (:func:`load_family`)."""
    path = root / "index.json"
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise KernelNotFoundError(
            f"no build found: {path} is missing. Build the kernels first: `python -m dsa_aot build` (from a source checkout) or install the dsa-aot wheel"
        ) from None
    except OSError as e:
        raise LaunchError(f"cannot read {path}: {e.strerror}. Reinstall or rebuild the wheel") from None
    try:
        want = (root / "index.sha256").read_text().strip()
    except OSError:
        raise LaunchError(f"{root / 'index.sha256'} is missing: the build is incomplete. Reinstall or rebuild the wheel") from None
    if hashlib.sha256(text).hexdigest() != want:
        raise LaunchError(f"{path} is corrupted: its sha256 is not the one in index.sha256. Reinstall or rebuild the wheel; nothing was launched")
    doc = _json(path, text)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise KernelNotFoundError(f"{path}: index format {doc.get('format') if isinstance(doc, dict) else None!r} is not {FORMAT}; "
                                  f"rebuild with this version of dsa-aot")
    if doc.get("for_shipping") is False and os.environ.get("AOT_ALLOW_DEBUG_BUILD") != "1":
        raise LaunchError(f"{path} is a debug build (compiled with --debug-dump), not for shipping; rebuild without it, "
                          f"or set AOT_ALLOW_DEBUG_BUILD=1 to use it anyway")
    fams, arches = doc.get("indexes"), doc.get("arches")
    ok = isinstance(fams, dict) and all(isinstance(f, dict) and isinstance(f.get("index"), str) and isinstance(f.get("sha256"), str)
                                        and isinstance(f.get("family"), str) for f in fams.values())
    ok = ok and isinstance(arches, dict) and all(isinstance(v, list) and all(isinstance(n, int) for n in v) for v in arches.values())
    if not ok:
        raise LaunchError(f"{path}: malformed table of indexes or targets. Reinstall or rebuild the wheel")
    return doc


def _kernel_table(fdoc) -> list | None:
    """The index's kernels as [(name, [parameter sizes])], or None when malformed."""
    table = fdoc.get("kernels")
    if not isinstance(table, list):
        return None
    ok = all(isinstance(k, list) and len(k) == 2 and isinstance(k[0], str) and isinstance(k[1], list)
             and all(isinstance(n, int) and n >= 0 for n in k[1]) for k in table)
    return table if ok else None


def _resolve(e, table):
    """Entry ``e`` with its kernels named (``kernels`` [names], ``params`` {name: sizes}), as the runtime uses
    it; ``e`` unchanged (then refused by :func:`lookup_key`) when it names no kernel of ``table``."""
    ks = e.get("kernels") if isinstance(e, dict) else None
    if not isinstance(ks, list) or not all(isinstance(i, int) and 0 <= i < len(table) for i in ks):
        return e
    return dict(e, kernels=[table[i][0] for i in ks], params={table[i][0]: table[i][1] for i in ks})


def load_family(root: Path, doc: dict, name: str):
    """Index ``name`` (:func:`index_name`; from ``doc``, :func:`load_index`), checked: its file against the sha256
    ``doc`` records, every entry's fields (of its family and series), every group an entry names holding the
    member it names. Returns (the index's document, its entries' kernels named, each entry's lookup key)."""
    ref = doc["indexes"][name]
    family = ref["family"]
    path = root / ref["index"]
    fdoc = _json(path, read_checked(root, ref["index"], ref["sha256"], f"index {name}"))
    groups = fdoc.get("groups") if isinstance(fdoc, dict) else None
    entries = fdoc.get("entries") if isinstance(fdoc, dict) else None
    table = _kernel_table(fdoc) if isinstance(fdoc, dict) else None
    if not isinstance(groups, dict) or not isinstance(entries, list) or table is None:
        raise LaunchError(f"{path}: not a family index (no groups, kernels or entries). Reinstall or rebuild the wheel")
    entries = [_resolve(e, table) for e in entries]
    keys = [lookup_key(e) if isinstance(e, dict) and e.get("family") == family and isinstance(e.get("arch"), str)
            and index_name(family, e["arch"]) == name else None for e in entries]
    bad = [i for i, k in enumerate(keys) if k is None]
    if bad:
        raise LaunchError(f"{path}: {len(bad)} malformed entries (first: #{bad[0]}). Reinstall or rebuild the wheel")
    for e in entries:
        for g, sha, what in ((e["cubin"], e["sha256"], "cubin"), (e["launcher"], e["launcher_sha256"], "launcher")):
            grp = groups.get(g)
            if not isinstance(grp, dict) or not isinstance(grp.get("members"), dict) or sha not in grp["members"]:
                raise LaunchError(f"{path}: entry {e['id']} names {what} {sha[:16]}… in group {g!r}, which does not hold it. "
                                  f"Reinstall or rebuild the wheel; nothing was launched")
    return fdoc, entries, keys


class _Stream:
    """A group's xz stream, decompressed as far as asked (its file checked by sha256 first)."""

    def __init__(self, root: Path, name: str, grp: dict):
        self.name, self.grp = name, grp
        self.pending = read_checked(root, grp.get("file"), grp.get("sha256"), f"group {name}")
        self.dec = None  # made at the first read: a process that finds its members kept decompresses nothing
        self.data = bytearray()

    def upto(self, end: int) -> bytearray:
        """The stream's first ``end`` bytes (fewer only at its end), its length checked against the index."""
        if self.dec is None:
            self.dec = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        dec, grp = self.dec, self.grp
        try:
            while len(self.data) < end and not dec.eof and (self.pending or not dec.needs_input):
                self.data += dec.decompress(self.pending, max_length=end - len(self.data))
                self.pending = b""
        except lzma.LZMAError as e:  # reached only if the file matches its sha256: a build that wrote a bad stream
            raise LaunchError(f"group {self.name} ({grp['file']}) does not decompress ({e}). Rebuild the wheel; nothing was launched") from None
        n, want = len(self.data), grp.get("bytes")
        if not isinstance(want, int) or n > want or (dec.eof and n != want) or (n < end and not dec.eof):
            raise LaunchError(f"group {self.name} ({grp['file']}) holds {n} bytes{'' if dec.eof else ' or more'}, its index says {want}. "
                              f"Rebuild the wheel; nothing was launched")
        return self.data


def open_group(root: Path, fdoc: dict, group: str, cache: dict) -> _Stream:
    """Group ``group`` of a family index ``fdoc``: its file read and checked by sha256 once per ``cache``
    ({group: its stream}, kept by the caller, which serialises calls per group); decompressed on demand."""
    stream = cache.get(group)
    if stream is None:
        stream = cache[group] = _Stream(root, group, fdoc["groups"][group])
    return stream


def read_member(root: Path, fdoc: dict, group: str, sha256: str, what: str, cache: dict | None = None) -> bytes:
    """Member ``sha256`` of ``group`` of a family index ``fdoc`` (:func:`load_family`), checked by its sha256;
    its group's stream decompressed up to the member's end only (``cache``: :func:`open_group`'s)."""
    grp = fdoc["groups"][group]
    stream = open_group(root, fdoc, group, {} if cache is None else cache)
    where = grp["members"][sha256]
    ok = isinstance(where, list) and len(where) == 2 and all(isinstance(x, int) and x >= 0 for x in where)
    data = stream.upto(sum(where)) if ok else b""
    ok = ok and sum(where) <= len(data)
    part = bytes(data[where[0] : where[0] + where[1]]) if ok else b""
    got = hashlib.sha256(part).hexdigest()
    if got != sha256:
        raise LaunchError(f"{what} in group {group} ({grp['file']}) is corrupted: sha256 {got} != {sha256} recorded at build time. "
                          f"Reinstall or rebuild the wheel; nothing was launched")
    return part
