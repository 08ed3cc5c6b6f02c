"""The whole build: manifest -> policy check -> compile -> lift -> verify -> fidelity -> pack.

Each stage is its own module; this file sequences them and can re-run lift/verify from saved
artifacts. The policy check (each family's ``check_policy`` against cudnn) runs on every build, cache
or not: it is cheap, and the run-time ops depend on it.

Public functions: :func:`build`, :func:`lift_and_verify` (one entry; :func:`lift_and_verify_all`), :func:`check_fidelity`,
:func:`check_policies`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from .artifacts import read_meta
from ..errors import AotError, ManifestError, PolicyError, VerifyError
from . import compile as compile_stage
from . import fidelity as fidelity_stage
from . import lift, manifest, pack, shards, verify
from .sources import REPO, stage_digest
from .specs import SPECS

__all__ = ["build", "select_only", "lift_and_verify", "lift_and_verify_all", "check_fidelity", "check_policies"]


def select_only(entries, pattern: str, path="manifest") -> list:
    """The entries whose id ``pattern`` matches (``re.search``); ManifestError when it is not a regular
    expression or matches none (a typo must not build nothing and look done)."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ManifestError(path, [f"--only {pattern!r}: not a regular expression ({e})"]) from None
    got = [e for e in entries if rx.search(e.id)]
    if not got:
        raise ManifestError(path, [f"--only {pattern!r} matches none of the manifest's {len(entries)} entry ids "
                                   f"(python -m dsa_aot manifest check {path} lists them)"])
    return got


def lift_and_verify(entry_dir, samples=50, cache_dir=None) -> dict:
    """Re-runnable from the artifacts of the compile stage: writes launcher.py and verify.json.

    ``cache_dir`` (optional) remembers passing results by the host code, the cubin, the sample count
    and the lifter's and verifier's own sources, so a rebuild after a manifest edit re-checks only
    the new entries."""
    d = Path(entry_dir)
    meta = read_meta(d)
    host = (d / "host.mlir").read_text()
    cubin = (d / "kernel.cubin").read_bytes()
    literals = literals_of(meta["family"], meta["op"])
    hit = None
    if cache_dir:
        h = hashlib.sha256(json.dumps([meta["id"], meta["host_function"], samples, _STAGE_SHA, literals]).encode())
        h.update(host.encode())
        h.update(cubin)
        hit = Path(cache_dir) / "verify" / f"{h.hexdigest()}.json"
        if hit.is_file():
            saved = json.loads(hit.read_text())
            (d / "launcher.py").write_text(saved["launcher"])
            (d / "verify.json").write_text(json.dumps(saved["report"], indent=1, sort_keys=True))
            return saved["report"]
    src = lift.lift(host, meta["host_function"], meta["id"], lift.cubin_param_layout(cubin), literals=literals)
    (d / "launcher.py").write_text(src)
    try:
        rep = verify.verify(host, meta["host_function"], src, cubin, samples=samples, literals=literals)
    except VerifyError as e:
        (d / "verify.json").write_text(json.dumps({"verdict": "failed", "error": str(e)}, indent=1))
        raise VerifyError(f"{meta['id']}: {e}") from None
    (d / "verify.json").write_text(json.dumps(rep, indent=1, sort_keys=True))
    if hit is not None:
        hit.parent.mkdir(parents=True, exist_ok=True)
        hit.write_text(json.dumps({"launcher": src, "report": rep}))
    return rep


def literals_of(family, op) -> dict:
    """The spec's ``LITERALS[op]``: launcher argument name -> the fp32 value its ``build`` compiles into
    the host code (a per-call value upstream bakes in per compile; the cubin does not depend on it)."""
    return dict(SPECS[family].literals.get(op, {}))


# what a lift+verify result depends on besides the entry's own artifacts: the lifter, the verifier (and
# what they import), and the run-time helpers the launchers call
_STAGE_SHA = stage_digest("dsa_aot/toolchain/lift/__init__.py", "dsa_aot/toolchain/verify.py", "dsa_aot/runtime/lifted.py",
                          *(str(p.relative_to(REPO)) for p in REPO.joinpath("dsa_aot/toolchain/lift").glob("*.py")))


def _lv(args):
    t = time.perf_counter()
    try:
        return args[0], lift_and_verify(*args), None, time.perf_counter() - t
    except AotError as e:
        return args[0], None, f"{type(e).__name__}: {e}", time.perf_counter() - t


def lift_and_verify_all(dirs, samples=50, cache_dir=None, jobs=None, progress=True, lv_seconds=None) -> dict:
    """:func:`lift_and_verify` every entry directory in ``dirs`` (spawned workers); return (or add to
    ``lv_seconds``) {entry dir name: seconds}. Raises VerifyError listing every entry that fails."""
    failures, lv_seconds = [], {} if lv_seconds is None else lv_seconds
    with ProcessPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1), mp_context=get_context("spawn")) as pool:
        for i, (d, rep, err, sec) in enumerate(pool.map(_lv, [(str(d), samples, cache_dir) for d in dirs]), 1):
            lv_seconds[Path(d).name] = lv_seconds.get(Path(d).name, 0.0) + sec
            if err:
                failures.append(err)
            if progress:
                print(f"lift+verify {i}/{len(dirs)} {Path(d).name} {'FAILED' if err else 'ok'} {sec:.1f}s", file=sys.stderr, flush=True)
    if failures:
        raise VerifyError(f"{len(failures)} entries failed the lifter checks:\n" + "\n".join(f"  - {f}" for f in failures))
    return lv_seconds


def check_fidelity(dirs, jobs=None, cache_dir=None, progress=True, samples=50, lv_seconds=None) -> dict:
    """The fidelity stage over lifted and verified entry directories: :func:`dsa_aot.toolchain.fidelity.check`,
    lift+verify again on each entry that now ships cudnn's cubin (``adopted``), the verdicts written next to
    the entries; fails closed (FidelityError) on ``differs`` / ``error``. Returns the verdicts."""
    verdicts = fidelity_stage.check(dirs, jobs=jobs, cache_dir=cache_dir, progress=progress)
    fidelity_stage.write_verdicts(verdicts, dirs)
    fidelity_stage.require_identical(verdicts)
    ids = {read_meta(d)["id"]: d for d in dirs}
    adopted = [ids[i] for i, v in verdicts.items() if v.get("adopted")]
    if adopted:
        lift_and_verify_all(adopted, samples, cache_dir, jobs, progress, lv_seconds)
    return verdicts


def check_policies(m, isolated=True) -> None:
    """Run every family's ``check_policy(targets)`` of manifest ``m`` (in a fresh process unless
    ``isolated`` is false: it imports cudnn); raise PolicyError listing every disagreement."""
    families = sorted({e.family for e in m.entries})
    if not isolated:
        failures = _check_policies(families, list(m.targets), list(sys.path))
    else:
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            failures = pool.submit(_check_policies, families, list(m.targets), list(sys.path)).result()
    if failures:
        raise PolicyError(f"{len(failures)} family policies disagree with cudnn's own functions (fix dsa_aot/policy/<family>.py):\n"
                          + "\n".join(f"  - {f}" for f in failures))


def _check_policies(families, targets, path) -> list:
    sys.path[:] = path
    from .specs import SPECS

    failures = []
    for f in families:
        try:
            SPECS[f].check_policy(targets)
        except Exception as e:  # noqa: BLE001  (collected: every family is checked, then the build stops)
            failures.append(f"{f}: {type(e).__name__}: {e}")
    return failures


def build(manifest_path, out_dir, work_dir="_build", cache_dir=".cache/aot", jobs=None, samples=50, progress=True, fidelity=True,
          debug_dump=None, shard=None, balance=None, only=None) -> dict:
    """Build every entry of the manifest into ``out_dir`` (what the wheel ships as dsa_aot/_generated); return the index.

    ``debug_dump``: keep the DSL's PTX and cubin files in that directory; the build is marked not for
    shipping (index.json ``for_shipping: false``; the runtime refuses it unless AOT_ALLOW_DEBUG_BUILD=1).

    ``shard`` (i, n): build only shard i of n (:func:`select_shard`, balanced by the seconds of the earlier
    build report ``balance``) into ``out_dir`` as a partial build (:func:`dsa_aot.toolchain.shards.write_partial`),
    for :func:`dsa_aot.toolchain.shards.merge`; returns the partial build's record.

    ``only``: a regular expression; build just the manifest's entries whose id it matches (``re.search``),
    for rebuilding a few entries or checks that need a handful of real cubins. The index records it
    (``partial``), and ``check-build`` refuses such a build for shipping unless asked."""
    t0 = time.perf_counter()
    m = manifest.load(manifest_path)
    entries = m.entries if only is None else select_only(m.entries, only, manifest_path)
    check_policies(m)
    if shard is not None:
        entries = shards.select_shard(m.entries, *shard, shards.seconds_of(balance) if balance else None)
    compiled = compile_stage.compile_entries(entries, work_dir, cache_dir=cache_dir, jobs=jobs, progress=progress, debug_dump=debug_dump)
    t1 = time.perf_counter()
    jobs = max(1, jobs or os.cpu_count() or 1)
    dirs = [c.dir for c in compiled]
    lv_seconds = lift_and_verify_all(dirs, samples, cache_dir, jobs, progress)
    t2 = time.perf_counter()
    # --- fidelity (dsa_aot.toolchain.fidelity): each cubin == what cudnn's own JIT path builds for its key; fails closed ---
    verdicts = None
    if fidelity:
        verdicts = check_fidelity(dirs, jobs, cache_dir, progress, samples, lv_seconds)
    t3 = time.perf_counter()
    # ---
    seconds = shards.entry_seconds(dirs, lv_seconds, verdicts)
    if shard is not None:
        rec = shards.write_partial(dirs, out_dir, manifest_path, shard, fidelity=fidelity, samples=samples, seconds=seconds)
        if progress:
            print(f"build shard {shard[0]}/{shard[1]}: {len(compiled)} of {len(m.entries)} entries "
                  f"({sum(c.cached for c in compiled)} from cache); compile {t1 - t0:.1f}s, lift+verify {t2 - t1:.1f}s, fidelity {t3 - t2:.1f}s "
                  f"-> {out_dir} (combine the shards with python -m dsa_aot merge)", file=sys.stderr)
        return rec
    partial = {"only": only, "entries": len(entries), "of": len(m.entries)} if only is not None else None
    index = pack.pack(dirs, out_dir, manifest_path, fidelity=verdicts, partial=partial)
    stages = {"compile": t1 - t0, "lift+verify": t2 - t1, "fidelity": t3 - t2, "pack": time.perf_counter() - t3}
    pack.write_build_report(work_dir, index, seconds, verdicts, stages)
    if progress:
        print(f"build: {len(compiled)} entries ({sum(c.cached for c in compiled)} from cache); "
              + ", ".join(f"{k} {v:.1f}s" for k, v in stages.items()) + f" -> {out_dir}", file=sys.stderr)
    return index
