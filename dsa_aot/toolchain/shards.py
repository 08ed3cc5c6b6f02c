"""Sharded builds: one manifest built on N machines (or N processes), then merged into one ``_generated``.

``python -m dsa_aot build --shard i/N --out DIR`` compiles, lifts, verifies and fidelity-checks shard i of the
manifest's entries (:func:`select_shard`: the same split on every machine, from the manifest and an
optional earlier build report) and writes a *partial build* to DIR (:func:`write_partial`):

  shard.json              the manifest (name and sha256), i / N, the settings (fidelity, samples), the entry ids
  seconds.json            per entry, the seconds of each stage on this machine (what the next split balances by)
  entries/<id>/           what pack reads: meta.json, kernel.cubin, launcher.py, verify.json, fidelity.json

``python -m dsa_aot merge DIR... --manifest M --out dsa_aot/_generated`` (:func:`merge`) checks that the partial
builds are the N shards of that manifest, built alike, each entry exactly once, and packs them in the
manifest's order: the tree is byte-identical to a one-machine build of the manifest (pack records nothing
about where or when an entry was built).

Public functions: :func:`select_shard`, :func:`write_partial`, :func:`merge`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from .artifacts import read_meta
from ..errors import PackError

__all__ = ["select_shard", "write_partial", "merge", "parse_shard", "seconds_of", "entry_seconds"]

_PARTIAL_FILES = ("meta.json", "kernel.cubin", "launcher.py", "verify.json", "fidelity.json")
_STAGES = ("compile_s", "lift_verify_s", "fidelity_s")


def parse_shard(text: str) -> tuple:
    """``"i/N"`` -> (i, N) with 1 <= i <= N (ValueError otherwise)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise ValueError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. 1/4")
    return i, n


# What a shard pays once per (arch, family) group its entries touch: a compile zygote's boot (about 10 s) and the
# fidelity stage's (about 7 s), measured on a 3-entry build (docs/research/targets.md); and an entry's seconds
# when no earlier report has them (compile + lift+verify + fidelity of a typical entry, same measurements)
GROUP_SECONDS = 17.0
ENTRY_SECONDS = 7.0


def select_shard(entries, index: int, count: int, seconds: dict | None = None) -> list:
    """The entries of shard ``index`` (1-based) of ``count``, in manifest order.

    The entries in (arch, family, id) order, cut into ``count`` consecutive runs so that the costliest run
    costs least: an entry costs its seconds in an earlier build (``seconds`` {id: s}; the median of the known
    ones for an entry it lacks; ENTRY_SECONDS each without it), and a run pays GROUP_SECONDS for each
    (arch, family) group it touches (the zygotes it boots). Consecutive runs keep each group on one shard or
    neighbouring ones, so the N shards boot about as many zygotes as one machine would, where spreading
    entries longest-first put nearly every group on every shard. Every machine that runs this with the same
    manifest and report gets the same split, and the N shards cover each entry once."""
    known = [v for v in (seconds or {}).values() if v > 0]
    default = statistics.median(known) if known else ENTRY_SECONDS
    weight = {e.id: (seconds or {}).get(e.id, default) or default for e in entries}
    order = sorted(entries, key=lambda e: (e.target.arch, e.family, e.id))
    costs = [(weight[e.id], (e.target.arch, e.family)) for e in order]
    # the least capacity whose greedy fill needs at most `count` runs (bisection: the fill is monotone in it)
    lo, hi = 0.0, sum(weight.values()) + GROUP_SECONDS * len(order) + 1.0
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _fill(costs, mid)[-1:] <= [count - 1] else (mid, hi)
    mine = {e.id for e, s in zip(order, _fill(costs, hi)) if s == index - 1}
    return [e for e in entries if e.id in mine]


def _fill(costs, cap) -> list:
    """The run of each (seconds, group) in ``costs`` when each run takes entries while its cost stays within ``cap``."""
    out, run, load, group = [], 0, 0.0, None
    for w, g in costs:  # in group order: a run touches a new group when g changes
        cost = w if g == group else w + GROUP_SECONDS
        if load and load + cost > cap:
            run, load, cost = run + 1, 0.0, w + GROUP_SECONDS
        load += cost
        group = g
        out.append(run)
    return out


def seconds_of(path) -> dict:
    """{entry id: total seconds} from an earlier build's ``report.json`` (a one-machine build's work
    directory) or a partial build's ``seconds.json``."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise PackError(f"{p}: cannot read the build report to balance the shards by ({e}); pass an earlier build's <work>/report.json") from None
    rows = data.items() if isinstance(data, dict) else ((r.get("id"), r) for r in data)
    out = {}
    for ident, r in rows:
        if isinstance(r, dict) and ident:
            out[ident] = sum(float(r.get(k) or 0.0) for k in _STAGES)
    return out


def entry_seconds(dirs, lift_verify: dict, verdicts: dict | None) -> dict:
    """{entry id: {compile_s, lift_verify_s, fidelity_s}} of this build (0 for a stage served by a cache
    or skipped)."""
    out = {}
    for d in map(Path, dirs):
        meta = read_meta(d)
        ident = meta["id"]
        out[ident] = {"compile_s": round(meta.get("compile_seconds", 0.0), 4), "lift_verify_s": round(lift_verify.get(d.name, 0.0), 4),
                      "fidelity_s": round(float(_fidelity_seconds((verdicts or {}).get(ident, {}))), 4)}
    return out


def _fidelity_seconds(verdict: dict) -> float:
    """An entry's cost in the fidelity stage: every look it took (``check_seconds``, from a second look on), else
    the first look's compile (``seconds``)."""
    return verdict.get("check_seconds", verdict.get("seconds", 0.0))


def _manifest_sha(manifest_path) -> str:
    return hashlib.sha256(Path(manifest_path).read_bytes()).hexdigest()


def write_partial(entry_dirs, out_dir, manifest_path, shard, *, fidelity: bool, samples: int, seconds: dict) -> dict:
    """Write the partial build of ``shard`` (i, N) to ``out_dir`` (replaced whole); return its record."""
    from .pack import _manifest_name

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".aot-shard-", dir=out_dir.parent))
    try:
        ids = []
        for d in map(Path, entry_dirs):
            ident = read_meta(d)["id"]
            (tmp / "entries" / ident).mkdir(parents=True)
            for a in _PARTIAL_FILES:
                if (d / a).is_file():
                    shutil.copyfile(d / a, tmp / "entries" / ident / a)
            ids.append(ident)
        rec = {"format": 1, "manifest": _manifest_name(manifest_path), "manifest_sha256": _manifest_sha(manifest_path), "shard": list(shard),
               "fidelity": bool(fidelity), "samples": int(samples), "entries": ids}
        (tmp / "shard.json").write_text(json.dumps(rec, indent=1, sort_keys=True))
        (tmp / "seconds.json").write_text(json.dumps(seconds, indent=1, sort_keys=True))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        return rec
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def merge(partial_dirs, manifest_path, out_dir, work_dir=None) -> dict:
    """Pack the partial builds ``partial_dirs`` of ``manifest_path`` into ``out_dir``; return the index.

    Refused (PackError, before anything is written) unless they are the N distinct shards of this very
    manifest, built with the same settings, holding every manifest entry exactly once. ``work_dir``: where
    the merged build report goes (the seconds each machine measured)."""
    from . import fidelity as fidelity_stage
    from . import manifest, pack

    m = manifest.load(manifest_path)
    sha = _manifest_sha(manifest_path)
    problems, recs, where = [], [], {}
    for p in map(Path, partial_dirs):
        try:
            rec = json.loads((p / "shard.json").read_text())
        except (OSError, ValueError):
            problems.append(f"{p}: not a partial build (no readable shard.json; make one with python -m dsa_aot build --shard i/N --out {p})")
            continue
        recs.append((p, rec))
        if rec.get("manifest_sha256") != sha:
            problems.append(f"{p}: built from another manifest ({rec.get('manifest')!r}, sha256 {str(rec.get('manifest_sha256'))[:12]}...; "
                            f"{manifest_path} is {sha[:12]}...): rebuild the shard from this manifest")
        for ident in rec.get("entries", []):
            where.setdefault(ident, []).append(p)
    if recs:
        shards = sorted(tuple(r.get("shard", ())) for _, r in recs)
        n = shards[0][1] if shards[0] else 0
        want = [(i, n) for i in range(1, n + 1)]
        if shards != want:
            problems.append(f"shards {['%d/%d' % s for s in shards]}: expected each of {['%d/%d' % s for s in want]} once")
        for k in ("fidelity", "samples"):
            seen = sorted({json.dumps(r.get(k)) for _, r in recs})
            if len(seen) > 1:
                problems.append(f"the shards were built with different {k} settings ({', '.join(seen)}): build every shard alike")
    ids = [e.id for e in m.entries]
    missing = [i for i in ids if i not in where]
    extra = sorted(set(where) - set(ids))
    twice = sorted(i for i, ps in where.items() if len(ps) > 1)
    if missing:
        problems.append(f"{len(missing)} manifest entries are in no shard (e.g. {missing[:3]})")
    if extra:
        problems.append(f"{len(extra)} entries are not in the manifest (e.g. {extra[:3]})")
    if twice:
        problems.append(f"{len(twice)} entries are in more than one shard (e.g. {twice[:3]})")
    for ident, ps in where.items():
        for a in _PARTIAL_FILES[:4]:
            if not (ps[0] / "entries" / ident / a).is_file():
                problems.append(f"{ps[0]}: entry {ident} lacks {a}")
    if not recs:
        problems.append("no partial builds given")
    if problems:
        raise PackError(f"cannot merge {len(recs)} partial build(s) of {manifest_path}:\n" + "\n".join(f"  - {p}" for p in problems))
    dirs = [where[i][0] / "entries" / i for i in ids]
    verdicts = fidelity_stage.load_verdicts(dirs) if recs[0][1].get("fidelity") else None
    if verdicts is not None:
        fidelity_stage.require_identical(verdicts)
    index = pack.pack(dirs, out_dir, manifest_path, fidelity=verdicts)
    if work_dir is not None:
        seconds = {}
        for p, _ in recs:
            seconds.update(json.loads((p / "seconds.json").read_text()))
        pack.write_build_report(work_dir, index, seconds, verdicts)
    return index
