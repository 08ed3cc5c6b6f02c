"""Stage 2, compile: every manifest entry through cute.compile on the CPU, for its target arch.

Per entry it writes, under ``<out>/entries/<entry id>/``:
  kernel.cubin   the cubin: the one the host module embeds (what the JIT path loads)
  host.mlir      the lowered host module in MLIR generic form (input of the lift and verify stages)
  meta.json      family, op, key, arch, tool versions, cache key, compile seconds; written last

Compiles run in fork children of one canonical zygote process per arch (CuTe DSL reads CUTE_DSL_ARCH
once per process; the zygote imports the DSL once): production mode, no keep/dump files, and a
process state that does not depend on the build (dsa_aot.toolchain.zygote says why that matters).
A content-addressed cache (key: the entry's key and target, the tool versions, the spec and every aot
module it imports, this stage's sources) makes a rebuild after adding one bucket compile exactly one
new entry, and an edit of a family's policy recompile that family.

Public function: :func:`compile_entries`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..errors import CompileError
from .manifest import Entry
from .sources import REPO, stage_digest
from .specs import SPECS, spec_digest
from . import zygote

__all__ = ["compile_entries", "CompiledEntry", "tool_versions", "cache_key"]

# libs-cu13 carries the ptxas that cudnn's JIT uses on a CUDA 13 machine (the H200 test machine): with the
# cu12 libs the same key gives a different (older-ptxas) cubin, so it is part of the toolchain pin.
_CUTLASS = {"nvidia-cutlass-dsl": "4.8.1", "nvidia-cutlass-dsl-libs-cu13": "4.8.1"}
ARTIFACTS = ("kernel.cubin", "host.mlir", "meta.json")


@dataclass(frozen=True)
class CompiledEntry:
    entry: Entry
    dir: Path
    cached: bool
    seconds: float


def pins() -> dict:
    """{distribution: version} the build compiles with: the DSL, and each registered family's upstream."""
    from ..policy.families import upstreams

    return _CUTLASS | upstreams()


def tool_versions() -> dict:
    """The installed versions of :func:`pins` (they enter every cache key and meta.json); CompileError when one
    is missing or another version (the specs and policies were checked against the pinned kernels)."""
    out = {}
    for d, want in pins().items():
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            raise CompileError(f"{d} is not installed: the build needs it (pip install {d}=={want})") from None
        if out[d] != want:
            raise CompileError(f"{d} {out[d]} is installed; the build is pinned to {want} (pip install {d}=={want})")
    return out


# the stage's own sources: what turns a spec's compile into the artifacts' bytes, with everything they
# import (all of it is in the compile process's heap, which the cubins of some kernels depend on)
STAGE_SOURCES = ("dsa_aot/toolchain/compile.py", "dsa_aot/toolchain/zygote.py", "dsa_aot/toolchain/ir.py", "dsa_aot/toolchain/cubin.py")


def cache_key(entry: Entry, versions: dict, root: Path = REPO) -> str:
    """sha256 over everything that can change the compiled artifacts of ``entry``."""
    return cache_keys([entry], versions, root)[0]


def cache_keys(entries, versions: dict, root: Path = REPO) -> list:
    """:func:`cache_key` of each entry; the source digests are taken once per call, not per entry
    (each walks the import closure: ~85 ms, which made a cached build of the default manifest take
    minutes)."""
    stage = stage_digest(*STAGE_SOURCES, root=root)
    specs = {}
    keys = []
    for entry in entries:
        if entry.family not in specs:
            specs[entry.family] = spec_digest(entry.family, root), zygote.source_names(entry.family)
        parts = {
            "family": entry.family,
            "op": entry.op,
            "key": [[k, v] for k, v in entry.key],
            "arch": entry.target.arch,
            "sm_count": entry.target.sm_count,
            "spec": specs[entry.family][0],
            # the file names the canonical process sees (its directory listings reach the heap: zygote.source_files)
            "sources": specs[entry.family][1],
            "tools": versions,
            "stage": stage,
            # the canonical paths reach the compile process's heap, and with it the cubins of the
            # layout-sensitive kernels: a cache filled under AOT_CANONICAL_DIR must not serve a build at the default
            "canonical": str(zygote.canonical_dir()),
        }
        keys.append(hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest())
    return keys


def compile_entries(entries, out_dir, cache_dir=None, jobs=None, progress=True, debug_dump=None) -> list:
    """Compile ``entries`` into ``out_dir/entries``; return a :class:`CompiledEntry` per entry.

    Each compile runs in a fork child of a canonical zygote process per arch (dsa_aot.toolchain.zygote):
    the cubins depend on the entries and the toolchain, not on this process or the build directory.
    ``debug_dump`` (a directory): keep the DSL's PTX and cubin files there; such artifacts are marked
    ``debug_dump`` in meta.json (pack refuses to ship them) and bypass the cache."""
    out_dir = Path(out_dir)
    cache_dir = Path(cache_dir) if cache_dir and not debug_dump else None
    versions = tool_versions()
    results, todo = [], []
    for e, key in zip(entries, cache_keys(entries, versions)):
        edir = out_dir / "entries" / e.id
        hit = cache_dir / key if cache_dir else None
        if hit is not None and all((hit / a).is_file() for a in ARTIFACTS):
            _copy_artifacts(hit, edir)
            _rename(edir, e)
            results.append(CompiledEntry(e, edir, True, 0.0))
        else:
            todo.append((e, edir, key))
    bar = _Progress(len(entries), len(results), enabled=progress)
    failures = []

    def done(item, art):
        e, edir, key = item
        if "error" in art:  # collect, report all failures at once
            failures.append(f"{e.id}: {art['error']}")
            bar.step(e.id, "FAILED")
            return
        _write_entry(edir, e, art, versions, key, debug_dump)
        if cache_dir:
            _copy_artifacts(edir, cache_dir / key)
        results.append(CompiledEntry(e, edir, False, art["seconds"]))
        bar.step(e.id, f"{art['seconds']:.2f}s")

    def request(item):
        e = item[0]
        return {"family": e.family, "op": e.op, "key": e.key, "arch": e.target.arch, "sm_count": e.target.sm_count}

    zygote.run(todo, request, done, jobs=jobs, debug_dump=debug_dump)
    bar.done()
    if failures:
        raise CompileError(f"{len(failures)} of {len(entries)} entries failed to compile:\n" + "\n".join(f"  - {f}" for f in failures))
    order = {e.id: i for i, e in enumerate(entries)}
    return sorted(results, key=lambda r: order[r.entry.id])


def _write_entry(edir: Path, e: Entry, art: dict, versions: dict, key: str, debug_dump=None) -> None:
    edir.mkdir(parents=True, exist_ok=True)
    (edir / "kernel.cubin").write_bytes(art["cubin"])
    (edir / "host.mlir").write_text(art["host"])
    meta = {
        "id": e.id,
        "family": e.family,
        "op": e.op,
        "key": dict(e.key) | art["extra_key"],
        "arch": e.target.arch,
        "target": {"name": e.target.name, "sm_count": e.target.sm_count},
        "kernel_symbols": art["symbols"],
        "host_function": art["host_function"],
        "compile_seconds": round(art["seconds"], 4),
        "tools": versions,
        "cache_key": key,
    }
    if debug_dump:
        meta["debug_dump"] = str(debug_dump)
    _atomic_write(edir / "meta.json", json.dumps(meta, indent=2, sort_keys=True))  # commit marker: last


def _rename(edir: Path, e: Entry) -> None:
    """A cached compile under this entry's id and target name: the cache keys what the cubin depends on
    (arch, SM count, ...), not what the manifest calls the entry (another target name; an id that names the
    SM count once the arch has two targets)."""
    from .artifacts import read_meta  # here, not at import: a compile process's imports can change two-CTA cubins

    meta = read_meta(edir)
    want = {"id": e.id, "target": {"name": e.target.name, "sm_count": e.target.sm_count}}
    if any(meta.get(k) != v for k, v in want.items()):
        _atomic_write(edir / "meta.json", json.dumps(meta | want, indent=2, sort_keys=True))


def _copy_artifacts(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for a in ARTIFACTS:  # meta.json last, so a half-copied entry never looks complete
        tmp = dst / f".{a}.tmp"
        shutil.copyfile(src / a, tmp)
        os.replace(tmp, dst / a)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- inside a compile process (a fork child of dsa_aot.toolchain.zygote) -------------------------------


def _compile_one(family, op, key, arch, sm_count) -> dict:
    import cutlass.cute as cute

    from .manifest import Target

    if os.environ.get("CUTE_DSL_ARCH") != arch:
        raise CompileError(f"worker arch {os.environ.get('CUTE_DSL_ARCH')} != entry arch {arch}")
    fn_, args, options, extra_key = SPECS[family].build(op, dict(key), Target("", arch, sm_count))
    t0 = time.perf_counter()
    fn = cute.compile(fn_, *args, options=options) if options else cute.compile(fn_, *args)
    seconds = time.perf_counter() - t0
    host = fn.ir_module.operation.get_asm(print_generic_op_form=True)
    # The cubin the JIT loads is the one embedded in the host module's fatbin (global kernels_binary)
    cubin = _embedded_cubin(host)
    return {
        "cubin": bytes(cubin),
        "host": host,
        "symbols": list(fn.kernel_info.keys()),
        "host_function": fn.function_name,
        "seconds": seconds,
        "extra_key": extra_key,
    }


def _embedded_cubin(host: str) -> bytes:
    from . import ir
    from .cubin import extract_cubins_from_fatbin

    g = ir.parse_module(host).globals.get("kernels_binary")
    if g is None:
        raise CompileError("the host module has no kernels_binary global")
    cubins = extract_cubins_from_fatbin(ir.attr_bytes(g.props["value"]))
    if len(cubins) != 1:
        raise CompileError(f"expected one cubin in the host module's fatbin, found {len(cubins)}")
    return cubins[0]


class _Progress:
    def __init__(self, total, done, enabled):
        self.total, self.n, self.enabled, self.t0 = total, done, enabled, time.perf_counter()
        if enabled and done:
            print(f"compile: {done}/{total} entries from cache", file=sys.stderr)

    def step(self, name, note):
        self.n += 1
        if self.enabled:
            w = 30
            fill = w * self.n // max(1, self.total)
            print(f"compile [{'#' * fill}{'.' * (w - fill)}] {self.n}/{self.total} {name} {note}", file=sys.stderr, flush=True)

    def done(self):
        if self.enabled:
            print(f"compile: {self.total} entries in {time.perf_counter() - self.t0:.1f}s", file=sys.stderr)
