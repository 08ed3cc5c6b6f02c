"""Stage 5, pack: gather verified entries into the directory the wheel ships as ``dsa_aot/_generated``.

Layout (everything a person can open):
  index.json              what the runtime reads, per entry: family, op, key, arch, kernel symbols and
                          parameter sizes, cubin and launcher sha256; the fidelity verdict; tool versions
  index.sha256            the sha256 of index.json (the runtime checks it, then every file by its entry)
  cubins/<sha256>.cubin   one file per distinct cubin (buckets with equal schedules share one)
  launchers/<name>.py     the lifted launcher of each entry
  verify.json             per entry, the lifter checks' record (verify stage)
  report.json, report.md  resources and verdicts per kernel

The build records the runtime does not read (verify records, resources) stay out of index.json: every
process that loads an op parses the index (at 2.8 MB with them, 9 ms of json.loads on the build
machine and 25 ms in a fresh process on the H200's host; 1.3 MB without).

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
import os
import shutil
import tempfile
from pathlib import Path

from .artifacts import read_meta
from .cubin import read_cubin
from ..errors import PackError

__all__ = ["pack", "write_build_report", "check_build"]


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
        (tmp / "cubins").mkdir()
        (tmp / "launchers").mkdir()
        entries, tools, dumped = [], None, set()
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
            (tmp / "cubins" / f"{sha}.cubin").write_bytes(cubin)
            lname = meta["id"].replace(".", "__") + ".py"
            launcher = (d / "launcher.py").read_bytes()
            (tmp / "launchers" / lname).write_bytes(launcher)
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
                "cubin": f"cubins/{sha}.cubin",
                "sha256": sha,
                "cubin_bytes": len(cubin),
                "launcher": f"launchers/{lname}",
                "launcher_sha256": hashlib.sha256(launcher).hexdigest(),
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
        index = {"format": 1, "manifest": _manifest_name(manifest_path), "tools": tools or {}, "for_shipping": not dumped, "entries": entries}
        if partial is not None:
            index["partial"] = partial
        shipped = dict(index, entries=[{k: v for k, v in e.items() if k not in _BUILD_RECORDS} for e in entries])
        text = json.dumps(shipped, indent=1, sort_keys=True).encode()
        (tmp / "index.json").write_bytes(text)
        # the index covers every cubin and launcher by sha256; this file covers the index
        (tmp / "index.sha256").write_text(hashlib.sha256(text).hexdigest() + "\n")
        (tmp / "verify.json").write_text(json.dumps({e["id"]: e["verify"] for e in entries}, indent=1, sort_keys=True))
        (tmp / "report.json").write_text(json.dumps(_report_rows(entries), indent=1))
        (tmp / "report.md").write_text(_report_md(entries, tools, dumped))
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
    entries of ``manifest_path`` in its order. A partial build (``build --only``) is refused unless
    ``allow_partial``; then its entries must be some of the manifest's, in its order. Returns the index;
    PackError otherwise."""
    from ..errors import AotError
    from ..policy.artifact import load_index, read_checked
    from . import manifest

    root = Path(build_dir)
    try:
        doc, _ = load_index(root)
    except AotError as e:
        raise PackError(f"{root} cannot ship as the build of {manifest_path}: {e}") from None
    problems = []
    if doc.get("for_shipping") is False:  # also under AOT_ALLOW_DEBUG_BUILD=1, which lets the runtime use it
        problems.append("a debug build (--debug-dump): not for shipping")
    entries = doc["entries"]
    for e in entries:
        for f, sha, what in ((e["cubin"], e["sha256"], "cubin"), (e["launcher"], e["launcher_sha256"], "launcher")):
            try:
                read_checked(root, f, sha, f"{what} of {e['id']}")
            except AotError as err:
                problems.append(str(err))
    want = [e.id for e in manifest.load(manifest_path).entries]
    got = [e["id"] for e in entries]
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
    return doc


_BUILD_RECORDS = ("verify", "resources")  # in verify.json and report.json, not in index.json (see the module doc)


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


# the fidelity facts that belong in the shipped index: the verdict and what it rests on, without the
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
    --balance`` reads)."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    notes = {i: v.get("note", "") for i, v in (verdicts or {}).items()}
    (work_dir / "report.json").write_text(json.dumps(_report_rows(index["entries"], seconds), indent=1))
    (work_dir / "report.md").write_text(_report_md(index["entries"], index["tools"], (), seconds, notes, stages))
