"""Stage 5, pack: gather verified entries into the directory the wheel ships as ``dsa_aot/_generated``.

Layout: :mod:`dsa_aot.policy.artifact` (index.json, index/<family>.<series>.json, packs/<group>.xz; each
distinct cubin and launcher stored once per index). ``python -m dsa_aot unpack BUILD DIR`` writes its cubins and
launchers out as files, for reading.

Only what the runtime reads ships. The build records (each entry's lifter-check record, fidelity verdict,
cubin size and resources per kernel) go to the work directory (:func:`write_build_report`: report.json,
report.md, verify.json, fidelity.json).

The tree is a function of the entries: nothing in it records when, where or how fast it was built
(two builds of one manifest are byte-identical; the timings and the fidelity stage's full notes go to
the work directory's report, :func:`write_build_report`).

The tree is assembled in a temporary sibling directory and swapped in with os.replace, so a failed
pack never leaves a half-written build behind.

Public function: :func:`pack`.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

from ..policy.artifact import FORMAT, GROUP_BYTES, index_name, series
from .artifacts import read_meta
from .cubin import read_cubin
from ..errors import PackError

__all__ = ["pack", "write_tree", "unpack", "write_build_report", "check_build"]


def pack(entry_dirs, out_dir, manifest_path="", fidelity=None, partial=None) -> dict:
    """Pack compiled, lifted and verified ``entry_dirs`` into ``out_dir``; return the index dict (with the build records index.json leaves out).

    ``fidelity``: optional ``{entry id: verdict dict}`` from :func:`dsa_aot.toolchain.fidelity.check`; entries not in it
    use ``<entry dir>/fidelity.json`` when present, else "not checked". A "differs" or "error" verdict
    refuses the pack. ``partial``: ``{"only": regex, "entries": n, "of": manifest entries}`` for a build of
    some of the manifest's entries (``build --only``), recorded in the index (a whole build has no such key).
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".aot-pack-", dir=out_dir.parent))
    try:
        entries, tools, dumped, blobs = [], None, set(), {}
        for d in entry_dirs:
            d = Path(d)
            missing = [a for a in ("meta.json", "kernel.cubin", "launcher.py", "verify.json") if not (d / a).is_file()]
            if missing:
                raise PackError(f"{d.name}: missing {missing}; run the compile, lift and verify stages first (python -m dsa_aot build)")
            meta = read_meta(d)
            if meta.get("debug_dump"):
                dumped.add(meta["id"])
            ver = json.loads((d / "verify.json").read_text())
            if ver.get("verdict") != "ok":
                raise PackError(f"{d.name}: verify verdict is {ver.get('verdict')!r}; refusing to ship it")
            cubin = (d / "kernel.cubin").read_bytes()
            info = read_cubin(cubin)
            if info.arch != meta["arch"]:
                raise PackError(f"{d.name}: cubin is for {info.arch}, entry says {meta['arch']}")
            sha = hashlib.sha256(cubin).hexdigest()
            launcher = (d / "launcher.py").read_bytes()
            lsha = hashlib.sha256(launcher).hexdigest()
            blobs[sha], blobs[lsha] = cubin, launcher
            if tools is None:
                tools = meta["tools"]
            elif tools != meta["tools"]:
                raise PackError(f"{d.name}: built with {meta['tools']}, other entries with {tools}; rebuild all entries with one toolchain")
            fid = _fidelity(meta["id"], d, fidelity, sha)
            if fid["verdict"] in ("differs", "error", "ptx identical"):  # ptx identical: checked without adopting cudnn's cubin
                raise PackError(f"{d.name}: fidelity verdict is {fid['verdict']!r} ({fid.get('note')}); refusing to ship it")
            entries.append({
                "id": meta["id"],
                "family": meta["family"],
                "op": meta["op"],
                "key": meta["key"],
                # what the spec derived from the key (schedule, grid, ...): shown, not looked up by
                "derived": _derived(meta),
                "arch": meta["arch"],
                "target": meta["target"],
                "kernels": [k.name for k in info.kernels],
                "sha256": sha,
                "cubin_bytes": len(cubin),
                "launcher_sha256": lsha,
                # per kernel, the sizes of its parameters (the cubin's EIATTR_KPARAM_INFO): the runtime
                # holds the launcher to them before the first launch
                "params": {k.name: [p.size for p in k.params] for k in info.kernels},
                "resources": {k.name: _resources(k) for k in info.kernels},
                "fidelity": fid,
                "verify": ver,
            })
        ids = [e["id"] for e in entries]
        if len(set(ids)) != len(ids):
            raise PackError(f"duplicate entry ids: {sorted(i for i in set(ids) if ids.count(i) > 1)}")
        _same_cubin_for_every_sm_count(entries)
        # a build whose compiles kept PTX/cubin files (python -m dsa_aot build --debug-dump) is for reading, not for shipping
        header = {"manifest": _manifest_name(manifest_path), "tools": tools or {}, "for_shipping": not dumped}
        if partial is not None:
            header["partial"] = partial
        write_tree(tmp, header, [{k: v for k, v in e.items() if k not in _BUILD_RECORDS} for e in entries], blobs)
        index = dict(header, format=FORMAT, entries=entries, dumped=sorted(dumped))  # the build's view: with its records
        if out_dir.exists():
            old = out_dir.with_name(out_dir.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
        return index
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _json(doc) -> bytes:
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def _index_json(doc) -> bytes:
    """A family index: one line per entry and group (readable, and a third smaller than indented JSON)."""
    rows = []
    for k in sorted(doc):
        v = doc[k]
        if isinstance(v, dict) and k == "groups":
            body = "{\n" + ",\n".join(f"{json.dumps(g)}: {json.dumps(v[g], sort_keys=True, separators=(',', ':'))}" for g in sorted(v)) + "\n}"
        elif isinstance(v, list) and k in ("entries", "kernels"):
            body = "[\n" + ",\n".join(json.dumps(x, sort_keys=True, separators=(",", ":")) for x in v) + "\n]"
        else:
            body = json.dumps(v, sort_keys=True)
        rows.append(f"{json.dumps(k)}: {body}")
    return ("{\n" + ",\n".join(rows) + "\n}\n").encode()


def fill_order(es: list) -> list:
    """``es`` in the order their cubins fill groups: the entries' own (the manifest's: neighbours there are
    alike; ordered by key instead the 718 sm_90a cubins took 2.03 MB of xz, not 1.64), each entry's twins of
    other arches (the same op and key) right after the first of them."""
    first: dict = {}
    for i, e in enumerate(es):
        first.setdefault((e["op"], json.dumps(e["key"], sort_keys=True)), i)
    return sorted(es, key=lambda e: (first[e["op"], json.dumps(e["key"], sort_keys=True)], e["arch"], e.get("target", {}).get("sm_count", 0)))


def write_tree(root, header: dict, entries: list, blobs: dict, group_bytes: int = GROUP_BYTES) -> None:
    """Write the shipped tree of ``entries`` (their runtime fields, with ``sha256`` / ``launcher_sha256``) into
    ``root``: ``blobs`` {sha256: bytes} holds every cubin and launcher they name; ``header`` the build's fields
    (manifest, tools, for_shipping, partial). Each (family, arch series) has its own index; each distinct
    member is stored once in it, a cubin in a group of its op, a launcher in one of the family's launcher
    groups, each group closed when the next member would take it past ``group_bytes``. An entry's twins on the other arches of its series (the same key
    for sm_100a and sm_103a: cubins of one size that differ in about 1 % of their bytes) sit next to it,
    which halves their compressed size (docs/artifact.md). An entry names its kernels by their place in the
    index's table of (name, parameter sizes): a few distinct kernels serve hundreds of entries. The order
    is :func:`fill_order`'s, so two builds of one manifest are byte-identical."""
    root = Path(root)
    (root / "packs").mkdir(parents=True, exist_ok=True)
    (root / "index").mkdir(exist_ok=True)
    indexes: dict = {}
    for e in entries:
        indexes.setdefault(index_name(e["family"], e["arch"]), []).append(e)
    table, arches = {}, {}
    for iname, es in indexes.items():
        fam, ser = es[0]["family"], series(es[0]["arch"])
        groups: dict = {}  # name -> [members {sha: [offset, size]}, bytes]
        open_group: dict = {}  # op (or "launchers") -> the name of its group being filled
        count: dict = {}  # op (or "launchers") -> how many groups it has
        where: dict = {}  # sha -> the group holding it
        for e in fill_order(es):
            arches.setdefault(e["arch"], set()).add(e.get("target", {}).get("sm_count", 0))
            for sha, gkey in ((e["sha256"], e["op"]), (e["launcher_sha256"], "launchers")):
                if sha in where:
                    continue
                name = open_group.get(gkey)
                if name is None or (groups[name][1] and groups[name][1] + len(blobs[sha]) > group_bytes):
                    count[gkey] = count.get(gkey, -1) + 1
                    name = open_group[gkey] = f"{ser}.{fam}.{gkey}.{count[gkey]}"
                    groups[name] = [{}, 0]
                members = groups[name]
                members[0][sha] = [members[1], len(blobs[sha])]
                members[1] += len(blobs[sha])
                where[sha] = name
        kernels = sorted({(k, tuple(e["params"][k])) for e in es for k in e["kernels"]})
        kid = {k: i for i, k in enumerate(kernels)}
        out = [dict({k: v for k, v in e.items() if k != "params"}, cubin=where[e["sha256"]], launcher=where[e["launcher_sha256"]],
                    kernels=[kid[k, tuple(e["params"][k])] for k in e["kernels"]]) for e in es]
        gtable = {}
        for name, (members, size) in groups.items():
            blob = lzma.compress(b"".join(blobs[s] for s in members), format=lzma.FORMAT_XZ, preset=6)
            (root / "packs" / f"{name}.xz").write_bytes(blob)
            gtable[name] = {"file": f"packs/{name}.xz", "sha256": hashlib.sha256(blob).hexdigest(), "bytes": size, "members": members}
        text = _index_json({"family": fam, "series": ser, "groups": gtable, "kernels": [[k, list(p)] for k, p in kernels], "entries": out})
        (root / "index" / f"{iname}.json").write_bytes(text)
        table[iname] = {"family": fam, "index": f"index/{iname}.json", "sha256": hashlib.sha256(text).hexdigest(), "entries": len(out)}
    text = _json(dict(header, format=FORMAT, indexes=table, arches={a: sorted(n) for a, n in arches.items()}))
    (root / "index.json").write_bytes(text)
    (root / "index.sha256").write_text(hashlib.sha256(text).hexdigest() + "\n")  # the root of the chain of sha256s


def unpack(build_dir, out_dir) -> int:
    """Write the cubins and launchers of the build in ``build_dir`` into ``out_dir`` (``cubins/<sha256>.cubin``,
    ``launchers/<entry id>.py``), each checked as the runtime checks it; the number of entries."""
    from ..policy.artifact import load_family, load_index, read_member

    root, out = Path(build_dir), Path(out_dir)
    doc = load_index(root)
    (out / "cubins").mkdir(parents=True, exist_ok=True)
    (out / "launchers").mkdir(exist_ok=True)
    n = 0
    for name in doc["indexes"]:
        (fdoc, es, _), cache = load_family(root, doc, name), {}
        for e in es:
            (out / "cubins" / f"{e['sha256']}.cubin").write_bytes(read_member(root, fdoc, e["cubin"], e["sha256"], f"cubin of {e['id']}", cache))
            (out / "launchers" / f"{e['id']}.py").write_bytes(read_member(root, fdoc, e["launcher"], e["launcher_sha256"], f"launcher of {e['id']}", cache))
            n += 1
    return n


def _same_cubin_for_every_sm_count(entries) -> None:
    """An op its family's policy declares free of the SM count (not in ``SM_COUNT_OPS``) serves any target of
    a GPU's arch at run time: its entries for the SM counts of one arch must be one cubin. Refused otherwise
    (the claim is wrong: add the op to the policy's SM_COUNT_OPS)."""
    from ..policy.families import family_policy

    seen: dict = {}
    for e in entries:
        if e["op"] in family_policy(e["family"]).SM_COUNT_OPS:
            continue
        k = (e["family"], e["op"], json.dumps(e["key"], sort_keys=True), e["arch"])
        first = seen.setdefault(k, e)
        if first["sha256"] != e["sha256"]:
            raise PackError(f"{e['id']} and {first['id']}: different cubins for {e['target']['sm_count']} and {first['target']['sm_count']} SMs, "
                            f"but dsa_aot/policy/{e['family']}.py does not list {e['op']!r} in SM_COUNT_OPS (the runtime would serve any SM "
                            f"count with either): add it there")


def check_build(build_dir, manifest_path, allow_partial=False) -> dict:
    """A finished build (e.g. merged from shards on other machines) before it ships: what the runtime checks
    when it loads it (index.sha256, the index's format and every entry's fields, every cubin and launcher by
    its sha256: :mod:`dsa_aot.policy.artifact`, the code the runtime loads it with), for shipping, and holding exactly the
    entries of ``manifest_path``, each once. A partial build (``build --only``) is refused unless
    ``allow_partial``; then its entries must be some of the manifest's, in its order. Returns the index;
    PackError otherwise."""
    from ..errors import AotError
    from ..policy.artifact import load_family, load_index, read_member
    from . import manifest

    root = Path(build_dir)
    try:
        doc = load_index(root)
        fams = {f: load_family(root, doc, f)[:2] for f in doc["indexes"]}
    except AotError as e:
        raise PackError(f"{root} cannot ship as the build of {manifest_path}: {e}") from None
    problems = []
    if doc.get("for_shipping") is False:  # also under AOT_ALLOW_DEBUG_BUILD=1, which lets the runtime use it
        problems.append("a debug build (--debug-dump): not for shipping")
    entries = [e for _, es in fams.values() for e in es]
    for fdoc, _ in fams.values():
        cache: dict = {}
        for g, grp in fdoc["groups"].items():
            for sha in grp["members"]:
                try:
                    read_member(root, fdoc, g, sha, f"member {sha[:16]}…", cache)
                except AotError as err:
                    problems.append(str(err))
                    break
    want = [e.id for e in manifest.load(manifest_path).entries]
    order = {i: n for n, i in enumerate(want)}
    got = sorted((e["id"] for e in entries), key=lambda i: (order.get(i, len(order)), i))  # the index is kept by family
    part = doc.get("partial")
    if part is not None and not allow_partial:
        problems.append(f"a partial build (--only {part.get('only')!r}: {len(got)} of the manifest's {len(want)} entries): not for shipping "
                        f"(build the whole manifest, or pass --allow-partial to check it as a partial build)")
    if part is not None and allow_partial:
        wanted = set(got)
        want = [i for i in want if i in wanted]  # the manifest's order, restricted to what it built
        stray = sorted(wanted - set(want))
        if stray:
            problems.append(f"{len(stray)} entries are not the manifest's (first: {stray[0]})")
    if got != want:
        problems.append(f"its entries are not the manifest's ({len(got)} vs {len(want)}; first difference: "
                        f"{next((g, w) for g, w in zip(got + [None] * len(want), want + [None] * len(got)) if g != w)})")
    if problems:
        raise PackError(f"{root} cannot ship as the build of {manifest_path}:\n" + "\n".join(f"  - {p}" for p in problems[:20]))
    return dict(doc, entries=entries)


# in verify.json and report.json, not in the shipped tree (see the module doc): the runtime reads none of them
_BUILD_RECORDS = ("verify", "resources", "fidelity", "cubin_bytes")


def _derived(meta) -> list:
    from ..policy.families import family_policy

    fields = family_policy(meta["family"]).OPS[meta["op"]].fields
    return sorted(k for k in meta["key"] if k not in fields)


def _manifest_name(path) -> str:
    """The manifest as the repository names it (manifests/default.toml), or its file name: not where the build ran."""
    from .sources import REPO

    p = Path(path).resolve() if str(path) else None
    if p is None:
        return ""
    try:
        return str(p.relative_to(REPO.resolve()))
    except ValueError:
        return p.name


# the fidelity facts the build records keep (fidelity.json): the verdict and what it rests on, without the
# notes (they name cubins other processes made, which vary: docs/fidelity.md)
# (an entry that ships cudnn's cubin adds ``adopted``, the PTX hash and the spec's other cubin of that PTX)
_FIDELITY_KEPT = ("verdict", "route", "options", "upstream_sha256", "adopted", "ptx_sha256", "spec_sha256")


def _fidelity(ident, d: Path, given, sha) -> dict:
    fid = (given or {}).get(ident)
    if fid is not None and fid.get("shipped_sha256") != sha:
        raise PackError(f"{ident}: the fidelity verdict is for cubin {fid.get('shipped_sha256')}, the entry's cubin is {sha}; re-run the check")
    if fid is None and (d / "fidelity.json").is_file():
        fid = json.loads((d / "fidelity.json").read_text())
        if fid.get("shipped_sha256") != sha:
            fid = None  # stale: written for an earlier compile of this entry
    if fid is None:
        return {"verdict": "not checked"}
    if fid.get("verdict") in ("differs", "error", "ptx identical"):
        return {k: fid[k] for k in ("verdict", "note") if k in fid}
    return {k: fid[k] for k in _FIDELITY_KEPT if fid.get(k) not in (None, "")}


def _resources(k) -> dict:
    return {
        "registers": k.registers,
        "shared_bytes": k.shared_bytes,
        "stack_bytes": k.stack_bytes,
        "spill_stores": getattr(k, "spill_stores", None),
        "spill_loads": getattr(k, "spill_loads", None),
        "param_bytes": k.param_bytes,
    }


def _report_rows(entries, seconds=None):
    rows = []
    for e in entries:
        for k, r in e["resources"].items():
            row = {"id": e["id"], "arch": e["arch"], "kernel": k, "cubin_bytes": e["cubin_bytes"], **r,
                   "lifter_checks": e["verify"]["verdict"], "samples": e["verify"]["samples"], "fidelity": e["fidelity"]["verdict"]}
            if seconds is not None:
                row.update(seconds.get(e["id"], {}))  # compile_s, lift_verify_s, fidelity_s (dsa_aot.toolchain.shards.entry_seconds)
            rows.append(row)
    return rows


def _stage_total(seconds, stage) -> float:
    return sum(s.get(stage, 0.0) for s in seconds.values())


def _report_md(entries, tools, dumped=(), seconds=None, notes=None, stages=None):
    timed = seconds is not None
    lines = [
        "# dsa-aot build report",
        "",
        *([f"**NOT FOR SHIPPING**: {len(dumped)} entries were compiled with the DSL's keep/dump files on (--debug-dump).", ""] if dumped else []),
        f"Tools: {', '.join(f'{k}=={v}' for k, v in sorted((tools or {}).items()))}. {len(entries)} entries, "
        f"{len({e['sha256'] for e in entries})} distinct cubins"
        + (f", {_stage_total(seconds, 'compile_s'):.1f} s of cute.compile in this build (the JIT cost users no longer pay)." if timed else "."),
        "",
        *([f"Seconds per stage (wall): {', '.join(f'{k} {v:.1f}' for k, v in stages.items())}; summed over entries (one process each): "
           f"compile {_stage_total(seconds, 'compile_s'):.1f}, lift+verify {_stage_total(seconds, 'lift_verify_s'):.1f}, "
           f"fidelity {_stage_total(seconds, 'fidelity_s'):.1f}.", ""] if timed and stages else []),
        "Fidelity (dsa_aot.toolchain.fidelity: the shipped cubin against the one cudnn's own JIT path builds for the key; 'identical' = "
        "byte-identical; 'adopted': the spec's compile made another cubin of cudnn's PTX (the DSL's PTX compiler makes some kernels' "
        "cubins differently in each process: docs/fidelity.md) and the entry ships cudnn's): "
        + ", ".join(f"{sum(e['fidelity']['verdict'] == v for e in entries)} {v}" for v in sorted({e["fidelity"]["verdict"] for e in entries}))
        + (f" ({n} of them adopted)" if (n := sum(bool(e["fidelity"].get("adopted")) for e in entries)) else "") + ".",
        "",
        f"| entry | kernel |{' compile s | lift+verify s | fidelity s |' if timed else ''} cubin B | regs | smem B | stack B | spills st/ld | "
        "lifter checks | fidelity |",
        f"|---|---|{'---:|---:|---:|' if timed else ''}---:|---:|---:|---:|---:|---|---|",
    ]
    for e in entries:
        for k, r in e["resources"].items():
            s = (seconds or {}).get(e["id"], {})
            t = "".join(f" {s.get(x, 0.0):.2f} |" for x in ("compile_s", "lift_verify_s", "fidelity_s")) if timed else ""
            lines.append(
                f"| {e['id']} | {k[:40]}… |{t} {e['cubin_bytes']} | {r['registers']} | {r['shared_bytes']} | {r['stack_bytes']} | "
                f"{r['spill_stores']}/{r['spill_loads']} | {e['verify']['verdict']} ({e['verify']['samples']} samples) | {e['fidelity']['verdict']} |"
            )
    if notes:
        lines += ["", "## Fidelity notes", ""] + [f"- `{i}`: {n}" for i, n in notes.items() if n]
    return "\n".join(lines) + "\n"


def write_build_report(work_dir, index, seconds: dict, verdicts: dict | None, stages: dict | None = None) -> None:
    """The build's own report, with what the shipped tree leaves out: the seconds of each stage per entry
    (``seconds`` {id: {compile_s, lift_verify_s, fidelity_s}}) and per build (``stages``, wall) and the
    fidelity stage's full notes (``<work>/report.md``, ``<work>/report.json``: what ``build --shard
    --balance`` reads), the lifter checks' record per entry (``<work>/verify.json``) and its fidelity
    verdict with what it rests on (``<work>/fidelity.json``)."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    notes = {i: v.get("note", "") for i, v in (verdicts or {}).items()}
    (work_dir / "report.json").write_text(json.dumps(_report_rows(index["entries"], seconds), indent=1))
    (work_dir / "verify.json").write_text(json.dumps({e["id"]: e["verify"] for e in index["entries"]}, indent=1, sort_keys=True))
    (work_dir / "fidelity.json").write_text(json.dumps({e["id"]: e["fidelity"] for e in index["entries"]}, indent=1, sort_keys=True))
    (work_dir / "report.md").write_text(_report_md(index["entries"], index["tools"], index.get("dumped", ()), seconds, notes, stages))
