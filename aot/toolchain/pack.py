"""Stage 5, pack: gather verified entries into the directory the wheel ships as ``aot/_generated``.

Layout (everything a person can open):
  index.json              per entry: family, op, key, arch, kernel symbols, cubin sha256 and size,
                          resource usage, tool versions, compile seconds, verify verdict
  cubins/<sha256>.cubin   one file per distinct cubin (buckets with equal schedules share one)
  launchers/<name>.py     the lifted launcher of each entry
  report.json, report.md  the build report (with each entry's fidelity verdict, aot.toolchain.fidelity)

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

from .cubin import read_cubin
from ..errors import PackError

__all__ = ["pack"]


def pack(entry_dirs, out_dir, manifest_path="", fidelity=None) -> dict:
    """Pack compiled, lifted and verified ``entry_dirs`` into ``out_dir``; return the index dict.

    ``fidelity``: optional ``{entry id: verdict dict}`` from :func:`aot.toolchain.fidelity.check`; entries not in it
    use ``<entry dir>/fidelity.json`` when present, else "not checked". A "differs" or "error" verdict
    refuses the pack.
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
                raise PackError(f"{d.name}: missing {missing}; run the compile, lift and verify stages first (python -m aot build)")
            meta = json.loads((d / "meta.json").read_text())
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
            shutil.copyfile(d / "launcher.py", tmp / "launchers" / lname)
            if tools is None:
                tools = meta["tools"]
            elif tools != meta["tools"]:
                raise PackError(f"{d.name}: built with {meta['tools']}, other entries with {tools}; rebuild all entries with one toolchain")
            fid = _fidelity(meta["id"], d, fidelity, sha)
            if fid["verdict"] in ("differs", "error"):
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
                "resources": {k.name: _resources(k) for k in info.kernels},
                "compile_seconds": meta["compile_seconds"],
                "fidelity": fid,
                "verify": ver,
            })
        ids = [e["id"] for e in entries]
        if len(set(ids)) != len(ids):
            raise PackError(f"duplicate entry ids: {sorted(i for i in set(ids) if ids.count(i) > 1)}")
        # a build whose compiles kept PTX/cubin files (python -m aot build --debug-dump) is for reading, not for shipping
        index = {"format": 1, "manifest": str(manifest_path), "tools": tools or {}, "for_shipping": not dumped, "entries": entries}
        (tmp / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
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


def _derived(meta) -> list:
    from ..policy.families import family_policy

    fields = family_policy(meta["family"]).OPS[meta["op"]].fields
    return sorted(k for k in meta["key"] if k not in fields)


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
    return {k: fid[k] for k in ("verdict", "upstream_sha256", "note", "options") if fid.get(k) not in (None, "")}


def _resources(k) -> dict:
    return {
        "registers": k.registers,
        "shared_bytes": k.shared_bytes,
        "stack_bytes": k.stack_bytes,
        "spill_stores": getattr(k, "spill_stores", None),
        "spill_loads": getattr(k, "spill_loads", None),
        "param_bytes": k.param_bytes,
    }


def _report_rows(entries):
    rows = []
    for e in entries:
        for k, r in e["resources"].items():
            rows.append({"id": e["id"], "arch": e["arch"], "kernel": k, "compile_s": e["compile_seconds"], "cubin_bytes": e["cubin_bytes"], **r,
                         "lifter_checks": e["verify"]["verdict"], "samples": e["verify"]["samples"], "fidelity": e["fidelity"]["verdict"]})
    return rows


def _report_md(entries, tools, dumped=()):
    lines = [
        "# dsa-aot build report",
        "",
        *([f"**NOT FOR SHIPPING**: {len(dumped)} entries were compiled with the DSL's keep/dump files on (--debug-dump).", ""] if dumped else []),
        f"Tools: {', '.join(f'{k}=={v}' for k, v in sorted((tools or {}).items()))}. {len(entries)} entries, "
        f"{len({e['sha256'] for e in entries})} distinct cubins, {sum(e['compile_seconds'] for e in entries):.1f} s of cute.compile (the JIT cost users no longer pay).",
        "",
        "Fidelity (aot.toolchain.fidelity: the shipped cubin against the one cudnn's own JIT path builds for the key; 'identical' = "
        "byte-identical, 'ptx identical' = the same PTX and options as cudnn's path, for kernels whose cubin the DSL's PTX compiler "
        "makes differently in each process (docs/fidelity.md)): "
        + ", ".join(f"{sum(e['fidelity']['verdict'] == v for e in entries)} {v}" for v in sorted({e["fidelity"]["verdict"] for e in entries})) + ".",
        "",
        "| entry | kernel | compile s | cubin B | regs | smem B | stack B | spills st/ld | lifter checks | fidelity |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for e in entries:
        for k, r in e["resources"].items():
            lines.append(
                f"| {e['id']} | {k[:40]}… | {e['compile_seconds']:.2f} | {e['cubin_bytes']} | {r['registers']} | {r['shared_bytes']} | {r['stack_bytes']} | "
                f"{r['spill_stores']}/{r['spill_loads']} | {e['verify']['verdict']} ({e['verify']['samples']} samples) | {e['fidelity']['verdict']} |"
            )
    return "\n".join(lines) + "\n"
