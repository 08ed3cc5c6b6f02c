"""The whole build: manifest -> compile -> lift -> verify -> fidelity -> pack. Each stage is its own module;
this file only sequences them and can re-run lift/verify from saved artifacts.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from . import compile as compile_stage
from . import fidelity as fidelity_stage
from . import lift, manifest, pack, verify
from .errors import AotError, VerifyError

__all__ = ["build", "lift_and_verify"]


def lift_and_verify(entry_dir, samples=50, cache_dir=None) -> dict:
    """Re-runnable from the artifacts of the compile stage: writes launcher.py and verify.json.

    ``cache_dir`` (optional) remembers passing results by the host code, the cubin, the sample count
    and the lifter's and verifier's own sources, so a rebuild after a manifest edit re-checks only
    the new entries."""
    d = Path(entry_dir)
    meta = json.loads((d / "meta.json").read_text())
    host = (d / "host.mlir").read_text()
    cubin = (d / "kernel.cubin").read_bytes()
    hit = None
    if cache_dir:
        h = hashlib.sha256(json.dumps([meta["id"], meta["host_function"], samples, _STAGE_SHA]).encode())
        h.update(host.encode())
        h.update(cubin)
        hit = Path(cache_dir) / "verify" / f"{h.hexdigest()}.json"
        if hit.is_file():
            saved = json.loads(hit.read_text())
            (d / "launcher.py").write_text(saved["launcher"])
            (d / "verify.json").write_text(json.dumps(saved["report"], indent=1, sort_keys=True))
            return saved["report"]
    src = lift.lift(host, meta["host_function"], meta["id"], lift.cubin_param_layout(cubin))
    (d / "launcher.py").write_text(src)
    try:
        rep = verify.verify(host, meta["host_function"], src, cubin, samples=samples)
    except VerifyError as e:
        (d / "verify.json").write_text(json.dumps({"verdict": "failed", "error": str(e)}, indent=1))
        raise VerifyError(f"{meta['id']}: {e}") from None
    (d / "verify.json").write_text(json.dumps(rep, indent=1, sort_keys=True))
    if hit is not None:
        hit.parent.mkdir(parents=True, exist_ok=True)
        hit.write_text(json.dumps({"launcher": src, "report": rep}))
    return rep


# what a lift+verify result depends on besides the entry's own artifacts
_STAGE_SHA = hashlib.sha256(b"".join((Path(__file__).parent / f).read_bytes() for f in ("lift.py", "verify.py", "ir.py", "cubin.py", "runtime/lifted.py"))).hexdigest()


def _lv(args):
    try:
        return args[0], lift_and_verify(*args), None
    except AotError as e:
        return args[0], None, f"{type(e).__name__}: {e}"


def build(manifest_path, out_dir, work_dir="_build", cache_dir=".cache/aot", jobs=None, samples=50, progress=True, fidelity=True) -> dict:
    t0 = time.perf_counter()
    m = manifest.load(manifest_path)
    compiled = compile_stage.compile_entries(m.entries, work_dir, cache_dir=cache_dir, jobs=jobs, progress=progress)
    t1 = time.perf_counter()
    jobs = max(1, jobs or os.cpu_count() or 1)
    failures = []
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        for i, (d, rep, err) in enumerate(pool.map(_lv, [(str(c.dir), samples, cache_dir) for c in compiled]), 1):
            if err:
                failures.append(err)
            if progress:
                print(f"lift+verify {i}/{len(compiled)} {Path(d).name} {'FAILED' if err else 'ok'}", file=sys.stderr, flush=True)
    if failures:
        raise VerifyError(f"{len(failures)} entries failed the lifter checks:\n" + "\n".join(f"  - {f}" for f in failures))
    t2 = time.perf_counter()
    # --- fidelity (aot.fidelity): each cubin == what cudnn's own JIT path builds for its key; fails closed ---
    verdicts = None
    if fidelity:
        dirs = [c.dir for c in compiled]
        verdicts = fidelity_stage.check(dirs, jobs=jobs, cache_dir=cache_dir, progress=progress)
        fidelity_stage.write_verdicts(verdicts, dirs)
        fidelity_stage.require_identical(verdicts)
    t3 = time.perf_counter()
    # ---
    index = pack.pack([c.dir for c in compiled], out_dir, manifest_path, fidelity=verdicts)
    if progress:
        print(f"build: {len(compiled)} entries ({sum(c.cached for c in compiled)} from cache); compile {t1 - t0:.1f}s, "
              f"lift+verify {t2 - t1:.1f}s, fidelity {t3 - t2:.1f}s, pack {time.perf_counter() - t3:.1f}s -> {out_dir}", file=sys.stderr)
    return index
