"""Build stage, fidelity: every shipped cubin against the one cudnn's OWN JIT path builds for its key.

The compile stage builds each entry from the family's spec (``kernels/<family>.py``): it constructs
cudnn's kernel classes (or calls its ``@cute.jit`` launch functions) itself, on fake arguments that
mirror what cudnn's wrappers pass. This stage proves the mirror exact: for each entry it runs cudnn's
real Python path (the spec's ``fidelity`` route: a public wrapper, factory, launch function or
prepared plan) on tensors that present themselves as CUDA tensors, so upstream's argument conversion,
policy, compile options and cache keys all run unmodified, and compares the cubin upstream compiled
with the shipped one. The compiles run as cudnn's JIT runs in production, no keep or dump files and
the DSL's file cache off, in a fork child of the same canonical zygote the compile stage uses
(dsa_aot.toolchain.zygote): for a kernel whose cubin depends on the compiling process the verdict is then
a function of the sources, as the shipped cubin is, and two builds agree on it.

The engine is generic; each spec brings its route, ``fidelity(op, key, target, up) -> (cache, want,
calls)``: drive upstream on ``up`` (an :class:`Upstream`), and return the compile cache upstream filled,
the cache key upstream must have used for the entry, and how often upstream called the compiled
function (1 for a call that launches, 0 for a plan that only compiles). ``FIDELITY_ROUTES`` names each
op's route for the report. What :class:`Upstream` stubs, only for the duration of one check in a process
of its own: the device queries (``torch.cuda.*`` answer for the entry's target: capability from the
arch, SM count from the manifest), ``cute.compile`` (wrapped: what it returns, and what upstream
caches, is a recorder whose call launches nothing), and whatever the route asks for (its compile
caches swapped for recording ones, memsets and fast-launch caches made no-ops).

Verdicts per entry id:
  ``identical``       upstream's cubin is byte-identical to the shipped one; or (``adopted``) the shipped
                      one is upstream's: the bytes differed, and a second look found upstream's PTX for
                      the key byte-identical to the spec's (workers that keep the PTX,
                      dsa_aot.toolchain.workers), the same compile options, the spec's cubin made again by
                      the compile stage byte for byte (that compiler's output for that PTX, not a damaged
                      file), and upstream's and the spec's cubins equal in size, sections and per-kernel
                      resources, differing only in kernel code; and a third look, cudnn's route in
                      another fresh canonical process, made upstream's cubin again. The DSL's in-process
                      PTX compiler makes cubins that depend on the compiling process's heap for some
                      kernels (the two-CTA sparse attention backward ones; docs/fidelity.md has the
                      measurements), and the spec's process and cudnn's route allocate different objects
                      before it runs: the entry then ships cudnn's cubin (kernel.cubin and the host
                      module's fatbin; lift+verify runs again on it) and keeps the spec's as
                      ``fidelity.spec.cubin``.
  ``ptx identical``   only with ``adopt=False`` (``python -m dsa_aot fidelity --no-write``): the second look
                      passed and no third look ran, nothing was changed; pack refuses this verdict.
  ``differs``         anything else (upstream's cubin, and PTX where taken, saved next to the entry).
  ``error``           upstream's path could not be run for the key, or its compile key is not the
                      entry's, or the family has no route for the op.
  ``not applicable``  cudnn's JIT never targets the entry's arch (e.g. sm_100f).

Public functions: :func:`check`, :func:`require_identical` (fail closed on ``differs`` / ``error``),
:func:`write_verdicts` (``<entry>/fidelity.json``, read by :func:`dsa_aot.toolchain.pack.pack`),
:func:`load_verdicts`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ..errors import FidelityError
from ..policy.arch import CAPABILITY
from . import zygote
from .sources import stage_digest

__all__ = ["check", "require_identical", "write_verdicts", "load_verdicts", "Upstream", "FidelityError"]

UPSTREAM_CUBIN = "fidelity.upstream.cubin"
UPSTREAM_PTX, SPEC_PTX = "fidelity.upstream.ptx", "fidelity.spec.ptx"  # kept when a PTX look finds a difference
SPEC_CUBIN = "fidelity.spec.cubin"  # the spec's cubin of an entry that ships cudnn's (see _adopt)
VERDICT_FILE = "fidelity.json"
FAILING = ("differs", "error")
PASSING = ("identical",)  # verdicts remembered by the check's cache
_STAGE = ("dsa_aot/toolchain/fidelity.py", "dsa_aot/toolchain/workers.py")


# --- parent side ---------------------------------------------------------------------------------


def _meta(d) -> dict:
    """An entry's meta.json (:func:`dsa_aot.toolchain.artifacts.read_meta`, imported here: compile processes import
    this module, and what they import before compiling can change the two-CTA cubins, docs/fidelity.md)."""
    from .artifacts import read_meta

    return read_meta(d)


def check(entry_dirs, jobs=None, cache_dir=None, progress=False, adopt=True) -> dict:
    """Check every entry directory (compile-stage output); return ``{entry id: verdict dict}``.

    Each value: ``verdict``, ``shipped_sha256``, ``upstream_sha256``, ``seconds`` (upstream's
    cute.compile of the entry's kernel), ``note``, and for checked entries ``route``, ``options``
    (upstream's compile options) and ``upstream_key`` (upstream's compile-cache key); a PTX look adds
    ``ptx_sha256`` and ``cubins`` (the cubin hashes it saw). ``cache_dir`` (optional) remembers passing
    verdicts by the entry, the shipped cubin, the tool versions, this stage's sources and the family's
    spec (with everything it imports), so a rebuild re-checks only what changed. ``adopt``: an entry whose
    cubin cudnn's route makes differently from the same PTX ships cudnn's (the third look, :func:`_adopt`);
    False (``python -m dsa_aot fidelity --no-write``) changes no cubin and reports it ``ptx identical``, which
    pack refuses.
    """
    from importlib import metadata

    from ..policy.families import family_policy
    from .compile import tool_versions
    from .specs import SPECS, spec_digest
    from .workers import run_per_arch

    versions = tool_versions()
    for dist in ("torch", "apache-tvm-ffi"):  # they carry the tensors into from_dlpack: part of the verdict's inputs
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    stage = stage_digest(*_STAGE)
    spec_sha = {}  # per family, not per entry: each digest walks the spec's import closure
    cache = Path(cache_dir) / "fidelity" if cache_dir else None
    results, todo = {}, []
    for d in map(Path, entry_dirs):
        meta = _meta(d)
        ssha = hashlib.sha256((d / "kernel.cubin").read_bytes()).hexdigest()
        base = {"shipped_sha256": ssha, "upstream_sha256": None, "seconds": 0.0}
        routes = SPECS[meta["family"]].routes
        if meta["arch"] not in CAPABILITY:
            results[meta["id"]] = base | {"verdict": "not applicable", "note": f"cudnn's JIT never targets {meta['arch']} (it compiles for "
                                          f"{', '.join(sorted(CAPABILITY))}, picked from the device's compute capability)"}
            continue
        if meta["op"] not in routes:
            results[meta["id"]] = base | {"verdict": "error", "note": f"kernels/{meta['family']}.py has no fidelity route for op {meta['op']!r} "
                                          f"(add it to FIDELITY_ROUTES and fidelity(); docs/adding-a-family.md)"}
            continue
        # the op's own key fields only: meta["key"] also holds what the spec derived (grid, slots, ...)
        key = {k: meta["key"][k] for k in family_policy(meta["family"]).OPS[meta["op"]].fields}
        if meta["family"] not in spec_sha:
            spec_sha[meta["family"]] = spec_digest(meta["family"])
        ckey = _verdict_key(meta, key, ssha, versions, stage, spec_sha[meta["family"]])
        hit = cache / f"{ckey}.json" if cache else None
        saved = _from_cache(hit, d)
        if saved is not None:
            results[meta["id"]] = saved
            continue
        todo.append((d, meta | {"key": key, "route": routes[meta["op"]]}, ssha, hit))
    n, total = len(results), len(results) + len(todo)
    second = []

    def done(item, fut):
        nonlocal n
        d, m, ssha, hit = item
        res = _verdict(fut, d, m, ssha)
        if res.get("second_look"):
            second.append((item, res))
            return
        _finish(results, item, res)
        n += 1
        if progress:
            print(f"fidelity {n}/{total} {m['id']} {res['verdict']} ({res['seconds']:.2f}s)", file=sys.stderr, flush=True)

    def args(item):
        m = item[1]
        return m["family"], m["op"], m["key"], m["arch"], m["target"]["sm_count"]

    def request(item):
        return dict(zip(("family", "op", "key", "arch", "sm_count"), args(item)), task="fidelity")

    # cudnn's route runs in a fork child of the canonical zygote, like the compile it judges: the
    # verdict of a kernel whose cubin depends on the process is then as reproducible as that cubin
    zygote.run(todo, request, lambda item, art: done(item, _Result(art)), jobs=jobs)
    if second:  # the second look: both PTX texts (workers that keep them), and the shipped cubin made again
        first = {id(item): res for item, res in second}
        looks = {}
        # its verdicts come when all three parts are done (about 100 s an entry on one core): a line per part
        # and entry meanwhile, so that a long second look is not a silent one
        say = _step_printer(progress, len(second))
        say(f"fidelity: second look at {len(second)} entries whose cubin differs from cudnn's route's "
            f"(PTX of both routes, the shipped cubin made again, cudnn's route once more where the PTX agrees)")
        with tempfile.TemporaryDirectory(prefix="aot-fidelity-ptx-") as keep:
            run_per_arch([item for item, _ in second], lambda item: item[1]["arch"], _ptx_one, args,
                         lambda item, fut: (looks.__setitem__(id(item), fut), say("PTX of both routes", item, fut)),
                         jobs=jobs, keep_ptx=keep)
        # the spec's cubin made again: another register assignment of the same PTX, or a damaged file?
        again = _recompile([item for item, _ in second], jobs, lambda item, art: say("spec's cubin again", item, _Result(art)))
        same_ptx = []
        for item, _ in second:
            res = _ptx_verdict(looks[id(item)], item[0], first[id(item)], again[id(item)])
            # what the entry cost this stage, for balancing shards (the first look's ``seconds`` alone
            # missed the looks after it: the shard holding the two-CTA entries still came in last)
            res["check_seconds"] = round(first[id(item)]["seconds"] + _seconds(looks[id(item)]) + again[id(item)].get("seconds", 0.0), 3)
            if res["verdict"] == "ptx identical" and adopt:
                same_ptx.append((item, res))
                continue
            _finish(results, item, res)
            n += 1
            if progress:
                print(f"fidelity {n}/{total} {item[1]['id']} {res['verdict']} (second look)", file=sys.stderr, flush=True)
        # the spec's compile made another cubin of cudnn's PTX: cudnn's route once more, in a fresh canonical
        # process; if it makes its cubin again, that cubin is what cudnn's JIT builds for the key, and ships
        confirm = {}
        say = _step_printer(progress, len(same_ptx))
        zygote.run([item for item, _ in same_ptx], request,
                   lambda item, art: (confirm.__setitem__(id(item), _Result(art)), say("cudnn's route again", item, confirm[id(item)])), jobs=jobs)
        for item, res in same_ptx:
            res = _adopt(confirm[id(item)], item[0], res) | {"check_seconds": round(res["check_seconds"] + _seconds(confirm[id(item)]), 3)}
            _finish(results, item, res)
            n += 1
            if progress:
                how = "cudnn's cubin adopted" if res.get("adopted") else "third look"
                print(f"fidelity {n}/{total} {item[1]['id']} {res['verdict']} ({how})", file=sys.stderr, flush=True)
    order = {}
    for i, d in enumerate(map(Path, entry_dirs)):
        order[_meta(d)["id"]] = i
    return dict(sorted(results.items(), key=lambda kv: order.get(kv[0], 0)))


def _finish(results, item, res):
    d, m, _, hit = item
    results[m["id"]] = res
    if hit is not None and res["verdict"] in PASSING:
        hit.parent.mkdir(parents=True, exist_ok=True)
        if res.get("adopted"):  # the cubin a cache hit ships again (written first: the verdict file marks the pair complete)
            tmp = hit.with_suffix(".cubin.tmp")
            tmp.write_bytes((d / "kernel.cubin").read_bytes())
            os.replace(tmp, hit.with_suffix(".cubin"))
        hit.write_text(json.dumps(res, indent=1, sort_keys=True))


def _verdict_key(meta: dict, key: dict, shipped_sha: str, versions: dict, stage: str, spec_sha: str) -> str:
    """The fidelity cache's key: everything a verdict depends on, the canonical directory cudnn's route
    runs under included (it can change a layout-sensitive kernel's cubin, as in the compile stage's key)."""
    return hashlib.sha256(json.dumps([meta["family"], meta["op"], key, meta["arch"], meta["target"]["sm_count"], shipped_sha, versions, stage,
                                      spec_sha, str(zygote.canonical_dir())], sort_keys=True).encode()).hexdigest()


def _from_cache(hit, d: Path):
    """The verdict :func:`_finish` remembered at ``hit`` for entry ``d``, or None. One that adopted cudnn's cubin
    ships the saved cubin again (None if it is missing or not the cubin the verdict names: check again)."""
    if hit is None or not hit.is_file():
        return None
    saved = json.loads(hit.read_text())
    if saved.get("adopted"):
        f = hit.with_suffix(".cubin")
        cubin = f.read_bytes() if f.is_file() else b""
        if hashlib.sha256(cubin).hexdigest() != saved["shipped_sha256"]:
            return None
        _ship_upstream(d, cubin)
    return saved | {"cached": True}


def _verdict(fut, d: Path, meta: dict, ssha: str) -> dict:
    base = {"shipped_sha256": ssha, "route": meta["route"]}
    try:
        art = fut.result()
    except Exception as exc:  # noqa: BLE001  (collected into the verdict; require_identical fails on it)
        return base | {"verdict": "error", "upstream_sha256": None, "seconds": 0.0, "note": f"{type(exc).__name__}: {exc}"}
    usha = hashlib.sha256(art["cubin"]).hexdigest()
    res = base | {"upstream_sha256": usha, "seconds": round(art["seconds"], 3), "options": art["options"], "upstream_key": art["key"]}
    notes = list(art["notes"])
    if art["key_mismatch"]:
        return res | {"verdict": "error", "note": "; ".join([art["key_mismatch"], *notes])}
    for f in (UPSTREAM_CUBIN, UPSTREAM_PTX, SPEC_PTX):
        (d / f).unlink(missing_ok=True)
    if usha == ssha:
        return res | {"verdict": "identical", "note": "; ".join(notes)}
    (d / UPSTREAM_CUBIN).write_bytes(art["cubin"])
    shipped = (d / "kernel.cubin").read_bytes()
    notes.insert(0, f"{len(shipped)} vs {len(art['cubin'])} bytes, first difference at byte {_first_diff(shipped, art['cubin'])}; upstream's cubin saved as {d / UPSTREAM_CUBIN}")
    return res | {"verdict": "differs", "note": "; ".join(notes), "second_look": True}


class _Result:
    """A zygote's result dict as the future the verdict functions read (``error`` raised)."""

    def __init__(self, art: dict):
        self.art = art

    def result(self):
        if "error" in self.art:
            raise RuntimeError(self.art["error"])
        return self.art


def _seconds(fut) -> float:
    """The seconds a look's result reports (0 for one that failed)."""
    try:
        return float(fut.result().get("seconds", 0.0))
    except Exception:  # noqa: BLE001  (the failure is the verdict's business)
        return 0.0


def _recompile(items, jobs, on_done=None) -> dict:
    """id(item) -> the cubin the compile stage makes of the entry now (its canonical compile process), or the error."""
    out = {}

    def request(item):
        m = item[1]
        return {"family": m["family"], "op": m["op"], "key": tuple(sorted(m["key"].items())), "arch": m["arch"], "sm_count": m["target"]["sm_count"]}

    def done(item, art):
        out[id(item)] = art
        if on_done:
            on_done(item, art)

    zygote.run(items, request, done, jobs=jobs)
    return out


def _step_printer(progress: bool, total: int):
    """say(text) prints a line; say(part, item, fut) the part's line for one entry, counted per part."""
    counts: dict = {}

    def say(text, item=None, fut=None):
        if not progress:
            return
        if item is not None:
            counts[text] = counts.get(text, 0) + 1
            try:
                fut.result()
                failed = ""
            except Exception:  # noqa: BLE001  (the verdict reports it; here only that it failed)
                failed = " failed"
            text = f"fidelity second look {counts[text]}/{total} {item[1]['id']} {text}{failed} ({_seconds(fut):.1f}s)"
        print(text, file=sys.stderr, flush=True)

    return say


def _options(opts, arch) -> list:
    """Compile options as far as they can change a cubin: the TVM-FFI wrapper does not, the arch is the entry's."""
    words = (opts or "").split()
    for flag in ("--gpu-arch",):
        if flag in words:
            i = words.index(flag)
            if words[i + 1] == arch:
                del words[i : i + 2]
    return sorted(w for w in words if w != "--enable-tvm-ffi")


def _ptx_verdict(fut, d: Path, first: dict, again: dict) -> dict:
    """The second look at a differing entry: upstream's PTX and options against the spec's, the shipped
    cubin against a fresh compile of the entry, and every cubin seen against the shipped one."""
    res = {k: v for k, v in first.items() if k != "second_look"}
    try:
        art = fut.result()
    except Exception as exc:  # noqa: BLE001
        return res | {"note": f"{res['note']}; the PTX look failed: {type(exc).__name__}: {exc}"}
    shipped = (d / "kernel.cubin").read_bytes()
    up, spec = art["ptx"], art["spec_ptx"]
    psha = hashlib.sha256(up.encode()).hexdigest()
    seen = {"shipped": res["shipped_sha256"], "upstream": res["upstream_sha256"], "upstream again": hashlib.sha256(art["cubin"]).hexdigest(),
            "spec": hashlib.sha256(art["spec_cubin"]).hexdigest()}
    res |= {"ptx_sha256": psha, "cubins": seen}
    summary = f"cubins seen: {', '.join(f'{k} {v[:12]}' for k, v in seen.items())} ({len(set(seen.values()))} distinct)"
    if up != spec:
        (d / UPSTREAM_PTX).write_text(up)
        (d / SPEC_PTX).write_text(spec)
        line = next((i for i, (x, y) in enumerate(zip(up.splitlines(), spec.splitlines()), 1) if x != y), min(up.count("\n"), spec.count("\n")) + 1)
        return res | {"verdict": "differs", "note": f"PTX differs from the spec's for the key ({len(spec)} vs {len(up)} chars, first difference at "
                                                    f"line {line}); both saved as {d / SPEC_PTX} and {d / UPSTREAM_PTX}; {summary}; {res['note']}"}
    arch = _meta(d)["arch"]
    if _options(art["options"], arch) != _options(art["spec_options"], arch):
        return res | {"verdict": "differs", "note": f"same PTX, but upstream compiles with {art['options']!r} and the spec with "
                                                    f"{art['spec_options']!r}; {summary}; {res['note']}"}
    if "error" in again or again["cubin"] != shipped:
        why = again.get("error") or f"sha256 {hashlib.sha256(again['cubin']).hexdigest()[:12]}"
        return res | {"verdict": "differs", "note": f"same PTX as upstream's, but compiling the entry again does not give the shipped cubin "
                                                    f"({why}): it is not what the compile stage makes of the key; {summary}; {res['note']}"}
    for other, name in ((art["cubin"], "upstream's"), (art["spec_cubin"], "the spec's")):
        same, how = _same_but_code(shipped, other)
        if not same:
            return res | {"verdict": "differs", "note": f"PTX identical (sha256 {psha[:12]}), but the shipped cubin is not the same program as "
                                                        f"{name}: {how}; {summary}; {res['note']}"}
    return res | {"verdict": "ptx identical", "note": f"same PTX in (sha256 {psha[:12]}, {len(up)} chars) and options as cudnn's own path; "
                                                      f"the shipped cubin is what the compile stage makes of it again, and the DSL's PTX "
                                                      f"compiler gives this kernel a cubin that depends on the compiling process "
                                                      f"(docs/fidelity.md); vs upstream's, the shipped cubin {how}; {summary}"}


def _adopt(fut, d: Path, res: dict) -> dict:
    """The third look at a ``ptx identical`` entry: cudnn's route run once more (a fresh fork of the canonical
    zygote). If it makes its first cubin again, ship that cubin: it is what cudnn's JIT builds for the key
    in the canonical process, the spec's is another cubin of the same PTX (the in-process PTX compiler's
    output depends on the process's heap: docs/fidelity.md). Verdict ``identical``, ``adopted``; else ``differs``."""
    base = {k: v for k, v in res.items() if k not in ("verdict", "note")}
    up = (d / UPSTREAM_CUBIN).read_bytes()
    try:
        again = fut.result()["cubin"]
    except Exception as exc:  # noqa: BLE001
        return base | {"verdict": "differs", "note": f"{res['note']}; cudnn's route failed on the run that would confirm its cubin: "
                                                     f"{type(exc).__name__}: {exc}"}
    usha, asha = hashlib.sha256(up).hexdigest(), hashlib.sha256(again).hexdigest()
    if up != again:
        return base | {"verdict": "differs", "note": f"{res['note']}; cudnn's route made two cubins in two canonical processes ({usha[:12]}, "
                                                     f"{asha[:12]}): there is no one cubin its JIT builds here to ship"}
    spec_sha = res["shipped_sha256"]
    _ship_upstream(d, up)
    return base | {"verdict": "identical", "adopted": True, "shipped_sha256": usha, "spec_sha256": spec_sha,
                   "cubins": res.get("cubins", {}) | {"upstream confirmed": asha},
                   "note": f"cudnn's own route made cubin {usha[:12]} in two canonical processes; the spec's compile made {spec_sha[:12]} of "
                           f"the same PTX and options (kept as {d / SPEC_CUBIN}); the build ships cudnn's. Second look: {res['note']}"}


def _ship_upstream(d: Path, cubin: bytes) -> None:
    """Make upstream's ``cubin`` the entry's: kernel.cubin, and the host module's embedded fatbin (what the
    lifter checks hold the launcher to). The entry's launcher and lifter checks are stale after this:
    verify.json goes, so nothing packs the entry before lift+verify runs again (dsa_aot.toolchain.build)."""
    spec = (d / "kernel.cubin").read_bytes()
    host = _splice_cubin((d / "host.mlir").read_text(), spec, cubin)
    (d / SPEC_CUBIN).write_bytes(spec)
    (d / "verify.json").unlink(missing_ok=True)
    for name, data in (("host.mlir", host.encode()), ("kernel.cubin", cubin)):
        tmp = d / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, d / name)
    (d / UPSTREAM_CUBIN).unlink(missing_ok=True)


def _splice_cubin(host: str, old: bytes, new: bytes) -> str:
    """``host`` with cubin ``old`` in its ``kernels_binary`` fatbin replaced by ``new`` (same size, as the
    second look requires: the fatbin's headers stay valid). Refuses what it cannot do exactly."""
    from . import ir

    g = ir.parse_module(host).globals.get("kernels_binary")
    raw = g.props["value"].strip() if g is not None else ""
    fatbin = ir.attr_bytes(raw) if raw.startswith('"') else b""
    if len(old) != len(new) or fatbin.count(old) != 1 or _mlir_string(fatbin) != raw or host.count(raw) != 1:
        raise FidelityError("cannot put cudnn's cubin into the entry's host module: it must replace the one embedded cubin of the same size "
                            "in a kernels_binary string this module can re-encode exactly")
    return host.replace(raw, _mlir_string(fatbin.replace(old, new)))


def _mlir_string(data: bytes) -> str:
    """Bytes as MLIR prints a string attribute (llvm::printEscapedString): ``\\`` doubled, printable ASCII but
    ``"`` as is, the rest as ``\\XX``."""
    return '"' + "".join("\\\\" if b == 0x5C else chr(b) if 0x20 <= b < 0x7F and b != 0x22 else f"\\{b:02X}" for b in data) + '"'


def _same_but_code(a: bytes, b: bytes):
    """(True, what) when cubins a and b differ at most in kernel code bytes: same size, section table and per-kernel resources."""
    from .cubin import _parse_elf, read_cubin

    if a == b:
        return True, "is byte-identical"
    if len(a) != len(b):
        return False, f"{len(a)} vs {len(b)} bytes"
    sa, sb = _parse_elf(a)[2], _parse_elf(b)[2]
    if [(x.name, x.type, x.offset, x.size) for x in sa] != [(x.name, x.type, x.offset, x.size) for x in sb]:
        return False, "the section tables differ"
    res = ("name", "registers", "shared_bytes", "stack_bytes", "local_bytes", "spill_stores", "spill_loads", "num_barriers")
    ka, kb = ([tuple(getattr(k, f) for f in res) for k in read_cubin(c).kernels] for c in (a, b))
    if ka != kb:
        return False, "the kernels' resources differ"
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    where = {next((s.name for s in sa if s.type != 8 and s.offset <= i < s.offset + s.size), "(outside any section)") for i in diff}  # 8: SHT_NOBITS
    if not all(w.startswith((".text.", ".nv.capmerc.text.")) for w in where):
        return False, f"{len(diff)} bytes differ, in {sorted(where)}"
    kernels = sorted({w.split(".text.", 1)[1].split("_cudnn", 1)[0] + "_..." for w in where})
    return True, f"has the same size, sections and per-kernel resources; {len(diff)} bytes differ, all in the code of {', '.join(kernels)}"


def _first_diff(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def require_identical(results: dict) -> None:
    """Fail closed: raise :class:`FidelityError` listing every entry whose verdict is differs or error."""
    bad = [(i, r) for i, r in results.items() if r["verdict"] in FAILING]
    if bad:
        raise FidelityError(
            f"{len(bad)} entries are not what cudnn's own JIT path builds (the spec's mirror of cudnn's argument conversion or "
            f"policy is wrong for them, or the route is; see kernels/ and dsa_aot/toolchain/fidelity.py):\n"
            + "\n".join(f"  - {i}: {r['verdict']}: {r['note']}" for i, r in bad)
        )


def write_verdicts(results: dict, entry_dirs) -> None:
    """Write each entry's verdict to ``<entry dir>/fidelity.json`` (what :func:`dsa_aot.toolchain.pack.pack` reads)."""
    for d in map(Path, entry_dirs):
        ident = _meta(d)["id"]
        if ident in results:
            tmp = d / f".{VERDICT_FILE}.tmp"
            tmp.write_text(json.dumps(results[ident], indent=1, sort_keys=True))
            os.replace(tmp, d / VERDICT_FILE)


def load_verdicts(entry_dirs) -> dict:
    """The verdicts written by :func:`write_verdicts`, by entry id (entries without one are left out)."""
    out = {}
    for d in map(Path, entry_dirs):
        f = d / VERDICT_FILE
        if f.is_file():
            out[_meta(d)["id"]] = json.loads(f.read_text())
    return out


# --- worker side ---------------------------------------------------------------------------------


def _check_one(family: str, op: str, key: dict, arch: str, sm_count: int) -> dict:
    """Run cudnn's own path for (op, key) on ``arch``; return the cubin it compiled for the entry's kernel."""
    rec, art = _run_route(family, op, key, arch, sm_count)
    art["cubin"] = _cubin_of(rec.fn)
    return art


def _ptx_one(family: str, op: str, key: dict, arch: str, sm_count: int) -> dict:
    """Upstream's route again and the spec's compile of the key, in a worker that keeps the PTX: both PTX texts and cubins."""
    import cutlass.cute as cute

    from .manifest import Target
    from .specs import SPECS

    t = time.perf_counter()
    rec, art = _run_route(family, op, key, arch, sm_count)
    if art["key_mismatch"]:
        raise RuntimeError(art["key_mismatch"])
    fn_, args, options, _ = SPECS[family].build(op, dict(key), Target("", arch, sm_count))
    spec = cute.compile(fn_, *args, options=options) if options else cute.compile(fn_, *args)
    return {"cubin": _cubin_of(rec.fn), "ptx": _ptx_of(rec.fn, "upstream's"), "options": rec.options, "spec_cubin": _cubin_of(spec),
            "spec_ptx": _ptx_of(spec, "the spec's"), "spec_options": options, "seconds": time.perf_counter() - t}


def _run_route(family, op, key, arch, sm_count):
    from .manifest import Target
    from .specs import SPECS

    if os.environ.get("CUTE_DSL_ARCH") != arch:
        raise RuntimeError(f"worker arch {os.environ.get('CUTE_DSL_ARCH')} != entry arch {arch}")
    notes = []
    with Upstream(arch, sm_count) as up:
        cache, want, calls = SPECS[family].fidelity(op, dict(key), Target("", arch, sm_count), up)
        compiled = list(cache)
        key_mismatch = None if compiled == [want] else f"upstream compiled {compiled} for this shape, expected the key {want}"
        rec = cache[compiled[0]] if compiled else None
        if rec is None:
            raise RuntimeError(f"upstream compiled nothing into its cache for {op} {key}")
        if not isinstance(rec, _Compiled) or rec.fn is None:
            raise RuntimeError("upstream's cache holds an object the check did not compile")
        if rec.calls != calls:
            notes.append(f"upstream called the compiled kernel {rec.calls} times (expected {calls})")
    return rec, {"options": rec.options, "key": repr(want if key_mismatch is None else compiled), "key_mismatch": key_mismatch,
                 "seconds": rec.seconds, "notes": notes}


def _ptx_of(fn, whose: str) -> str:
    """The PTX the DSL kept for a compiled function (fn.__ptx__: the text, read back from the dump dir)."""
    ptx = fn.__ptx__
    if not isinstance(ptx, str) or ".version" not in ptx or ".target" not in ptx:
        shown = ptx if not isinstance(ptx, str) else ptx[:120]
        raise RuntimeError(f"{whose} compile kept no PTX (fn.__ptx__ = {shown!r}; the worker sets CUTE_DSL_KEEP=ptx and an existing dump dir)")
    return ptx


def _cubin_of(fn) -> bytes:
    from .compile import _embedded_cubin

    return bytes(_embedded_cubin(fn.ir_module.operation.get_asm(print_generic_op_form=True)))


class _Compiled:
    """What upstream's compile caches hold during a check: the real compiled function, and a call that launches nothing."""

    def __init__(self, fn, options, kernel):
        self.fn, self.options, self.kernel, self.calls, self.seconds = fn, options, kernel, 0, 0.0

    def __call__(self, *args, **kwargs):
        self.calls += 1


class _Recording(dict):
    """An upstream compile cache during a check: records what upstream compiles for keys ``keep``
    accepts; every other key answers "cached" with a stub (nothing compiles, the call launches nothing)."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep

    def __contains__(self, key):
        return not self.keep(key) or dict.__contains__(self, key)

    def __getitem__(self, key):
        return dict.__getitem__(self, key) if self.keep(key) else _Compiled(None, None, "not under check")

    def get(self, key, default=None):
        return dict.get(self, key, default) if self.keep(key) else _Compiled(None, None, "not under check")

    def __setitem__(self, key, value):
        if self.keep(key):
            dict.__setitem__(self, key, value)


class _NoDevice:
    """``torch.cuda.device(...)``: a context that switches nothing (there is no device)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Upstream:
    """What a spec's fidelity route runs cudnn's own path with, for one check (a context manager).

    On entry it answers the device queries for the target and wraps ``cute.compile``; everything is
    restored on exit. For the route:

      arch, sm_count, capability   the target
      stream                       a ``CUstream(0)`` (never used: nothing launches)
      tensor(dtype, *shape)        a CPU tensor that presents as a CUDA tensor on cuda:0 (torch and
                                   DLPack): ``from_dlpack`` gives a gmem pointer, as on a GPU; never touched
      meta(dtype, *shape)          the same over a meta tensor, for plan-time code that reads metadata only
      cache(obj, name, keep=None)  replace upstream's compile cache ``obj.name`` by a recording one
                                   (keys ``keep`` rejects answer "cached"); returns it
      plan_compilers((obj, name), ...)  replace ``lru_cache``-d plan compilers by recorders that call
                                   the undecorated function; returns their one cache (key: (name, args))
      no_op(obj, name)             a callable that does nothing (memsets, ...)
      patch(obj, name, value)      anything else
      clear_lru(*functions)        clear these ``functools.lru_cache`` now and on exit
      on_host(*names)              torch's factories ``names`` (empty, full, zeros, arange, empty_like) give
                                   CUDA-presenting CPU tensors, as upstream's allocations on the device
      cudnn_route(*modules)        what every cudnn route needs: its device-query caches cleared (they answer
                                   for the target) and the ``_torch_stream_context`` of each of ``modules``
                                   a no-op (nothing runs on a stream)
    """

    def __init__(self, arch: str, sm_count: int):
        self.arch, self.sm_count, self.capability = arch, sm_count, CAPABILITY[arch]
        self._saved, self._lru = [], []

    def __enter__(self):
        import types

        import cuda.bindings.driver as cuda_driver
        import cutlass.cute as cute
        import torch

        self.stream = cuda_driver.CUstream(0)
        props = types.SimpleNamespace(multi_processor_count=self.sm_count, major=self.capability[0], minor=self.capability[1],
                                      name=f"fidelity-check {self.arch}")
        real_compile = cute.compile

        def compile_(fn, *args, **kwargs):
            t0 = time.perf_counter()
            out = real_compile(fn, *args, **kwargs)
            rec = _Compiled(out, kwargs.get("options"), type(fn).__name__)
            rec.seconds = time.perf_counter() - t0
            return rec

        for obj, name, value in (
            (cute, "compile", compile_),
            (torch.cuda, "is_available", lambda: True),
            (torch.cuda, "device_count", lambda: 1),
            (torch.cuda, "current_device", lambda: 0),
            (torch.cuda, "get_device_capability", lambda device=None: self.capability),
            (torch.cuda, "get_device_properties", lambda device=None: props),
            (torch.cuda, "is_current_stream_capturing", lambda: False),
            (torch.cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext()),
            (torch.cuda, "device", _NoDevice),
        ):
            self.patch(obj, name, value)
        return self

    def __exit__(self, *exc):
        for obj, name, value in reversed(self._saved):
            setattr(obj, name, value)
        for f in self._lru:
            f.cache_clear()
        return False

    def patch(self, obj, name, value):
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)
        return value

    def no_op(self, obj, name):
        return self.patch(obj, name, lambda *a, **k: None)

    def cache(self, obj, name, keep=None):
        return self.patch(obj, name, _Recording(keep or (lambda key: True)))

    def plan_compilers(self, *targets):
        cache = _Recording(lambda key: True)

        def recorder(fn):
            def compile_plan(*args, **kwargs):
                out = fn.__wrapped__(*args, **kwargs)
                cache[(fn.__name__, args + tuple(sorted(kwargs.items())))] = out
                return out

            return compile_plan

        for obj, name in targets:
            self.patch(obj, name, recorder(getattr(obj, name)))
        return cache

    def clear_lru(self, *functions):
        for f in functions:
            f.cache_clear()
            self._lru.append(f)

    def on_host(self, *names):
        import torch

        like, real_empty = _cuda_like(), torch.empty
        for name in names:
            if name == "empty_like":
                fn = lambda t, dtype=None, **k: like(real_empty(*t.shape, dtype=dtype or t.dtype))  # noqa: E731
            else:
                fn = (lambda real: lambda *a, dtype=None, device=None, **k: like(real(*a, dtype=dtype)))(getattr(torch, name))
            self.patch(torch, name, fn)

    def cudnn_route(self, *modules):
        from cudnn.deepseek_sparse_attention.utils import compiler, runtime

        self.clear_lru(compiler.gpu_arch_flag, runtime._device_capability)
        for mod in modules:  # each must have one (AttributeError otherwise: upstream changed, re-read its route)
            self.patch(mod, "_torch_stream_context", lambda *a, **k: contextlib.nullcontext())

    def tensor(self, dtype, *shape):
        import torch

        return _cuda_like()(torch.empty(*shape, dtype=dtype))

    def meta(self, dtype, *shape):
        import torch

        return _cuda_like()(torch.empty(*shape, dtype=dtype, device="meta"))


_CUDA_LIKE = None


def _cuda_like():
    """A torch.Tensor subclass over CPU storage that looks like a tensor on cuda:0 to torch users and DLPack."""
    global _CUDA_LIKE
    if _CUDA_LIKE is not None:
        return _CUDA_LIKE
    import ctypes

    import torch

    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
    get_ptr.restype, get_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    # offset of DLTensor.device: DLManagedTensor starts with its DLTensor; DLManagedTensorVersioned has
    # {DLPackVersion (8), manager_ctx (8), deleter (8), flags (8)} first. DLTensor = {data*, DLDevice, ...}.
    device_offset = {b"dltensor": 8, b"dltensor_versioned": 32 + 8}
    kDLCPU, kDLCUDA = 1, 2

    class CudaLike(torch.Tensor):
        @staticmethod
        def __new__(cls, t):
            return torch.Tensor._make_subclass(cls, t)

        @property
        def is_cuda(self):
            return True

        @property
        def device(self):
            return torch.device("cuda", 0)

        @property
        def __dlpack_c_exchange_api__(self):  # tvm_ffi would take torch's C path and see the CPU device
            raise AttributeError("CudaLike exports through __dlpack__ only")

        def __dlpack_device__(self):
            return (kDLCUDA, 0)

        def __dlpack__(self, *args, **kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                plain = torch.Tensor.as_subclass(self, torch.Tensor)
            cap = torch.Tensor.__dlpack__(plain, **({"max_version": kwargs["max_version"]} if kwargs.get("max_version") else {}))
            name = get_name(cap)
            if name not in device_offset:
                raise BufferError(f"unexpected DLPack capsule {name!r}")
            dev = (ctypes.c_int32 * 2).from_address(get_ptr(cap, name) + device_offset[name])
            if dev[0] != kDLCPU:
                raise BufferError(f"expected a CPU DLTensor under the fake CUDA tensor, device type {dev[0]}")
            dev[0], dev[1] = kDLCUDA, 0
            return cap

    _CUDA_LIKE = CudaLike
    return CudaLike
