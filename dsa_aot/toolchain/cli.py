"""Command line of the toolchain: ``python -m dsa_aot`` (or ``python -m dsa_aot.toolchain``) with
``manifest check FILE``, ``build`` (``--shard i/N``: one part of a sharded build), ``merge DIR...``,
``check-build DIR``, ``unpack DIR OUT``, ``lift-verify DIR``, ``fidelity DIR...``."""

import argparse
import sys

from ..errors import AotError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsa_aot", description="dsa-aot: ahead-of-time CuTe DSL kernels")
    sub = p.add_subparsers(dest="cmd", required=True)
    mc = sub.add_parser("manifest", help="manifest tools")
    mc.add_argument("action", choices=["check"])
    mc.add_argument("path")
    b = sub.add_parser("build", help="compile, lift, verify and pack every entry of a manifest")
    b.add_argument("--manifest", default="manifests/default.toml")
    b.add_argument("--out", default="dsa_aot/_generated", help="where the packed build goes (the wheel ships it as dsa_aot/_generated)")
    b.add_argument("--work", default="_build", help="per-entry artifacts: cubin, host.mlir, launcher.py, meta.json, verify.json")
    b.add_argument("--cache", default=".cache/aot", help="content-addressed compile cache ('' to disable)")
    b.add_argument("-j", "--jobs", type=int, default=None)
    b.add_argument("--samples", type=int, default=50, help="random argument sets per entry for the lifter check (>= 50)")
    b.add_argument("--debug-dump", metavar="DIR", default=None,
                   help="keep the DSL's PTX and cubin files of every compile in DIR (for reading them); the build is marked not for shipping")
    b.add_argument("--no-fidelity", action="store_true", help="skip the check against cudnn's own JIT path (dsa_aot.toolchain.fidelity); the report says 'not checked'")
    b.add_argument("--shard", metavar="I/N", default=None,
                   help="build only shard I of N of the manifest's entries into --out as a partial build; combine the N with 'merge'")
    b.add_argument("--only", metavar="REGEX", default=None,
                   help="build only the manifest's entries whose id matches REGEX (re.search); the index says it is a partial build, which check-build refuses to ship")
    b.add_argument("--balance", metavar="REPORT", default=None,
                   help="split shards by the seconds an earlier build measured: its <work>/report.json, or a shard's seconds.json")
    mg = sub.add_parser("merge", help="combine the partial builds of 'build --shard i/N' into one build (byte-identical to a one-machine build)")
    mg.add_argument("dirs", nargs="+", help="the N partial build directories")
    mg.add_argument("--manifest", default="manifests/default.toml")
    mg.add_argument("--out", default="dsa_aot/_generated")
    mg.add_argument("--work", default="_build", help="where the merged build report goes")
    cb = sub.add_parser("check-build", help="check a finished build (e.g. merged from shards) before it ships: intact, and the manifest's entries")
    cb.add_argument("dir")
    cb.add_argument("--manifest", default="manifests/default.toml")
    cb.add_argument("--allow-partial", action="store_true", help="accept a partial build (build --only): its entries must be some of the manifest's")
    up = sub.add_parser("unpack", help="write a build's cubins and launchers out of their groups as files, for reading (checked as the runtime checks them)")
    up.add_argument("dir")
    up.add_argument("out")
    lv = sub.add_parser("lift-verify", help="re-run lift and verify on one entry directory of a previous build")
    lv.add_argument("entry_dir")
    fc = sub.add_parser("fidelity", help="prove shipped cubins byte-identical to what cudnn's own JIT path builds")
    fc.add_argument("dirs", nargs="+", help="entry directories, or work directories holding entries/")
    fc.add_argument("-j", "--jobs", type=int, default=None)
    fc.add_argument("--no-write", action="store_true", help="change nothing: no <entry>/fidelity.json, and an entry whose cubin cudnn's route makes differently from the same PTX "
                    "is reported 'ptx identical' instead of shipping cudnn's cubin")
    a = p.parse_args(argv)
    try:
        if a.cmd == "manifest":
            from .manifest import load

            m = load(a.path)
            print(f"{a.path}: ok, {len(m.entries)} entries for {len(m.targets)} target(s)")
            for e in m.entries:
                print(f"  {e.id}")
        elif a.cmd == "build":
            from .build import build

            if a.samples < 50:
                p.error("--samples must be at least 50")
            from .shards import parse_shard

            try:
                shard = parse_shard(a.shard) if a.shard else None
            except ValueError as e:
                p.error(str(e))
            if a.balance and not shard:
                p.error("--balance only with --shard")
            if a.only is not None and shard:
                p.error("--only and --shard: a shard is a part of the whole manifest (merge checks it); pick one")
            idx = build(a.manifest, a.out, a.work, a.cache or None, a.jobs, a.samples, fidelity=not a.no_fidelity, debug_dump=a.debug_dump,
                        shard=shard, balance=a.balance, only=a.only)
            print(f"built {len(idx['entries'])} entries into {a.out}" + (f" (shard {a.shard}: merge the shards with python -m dsa_aot merge)" if shard else "")
                  + (f" (partial: --only {a.only!r}, {idx['partial']['entries']} of {idx['partial']['of']} entries; not for shipping)" if a.only is not None else ""))
        elif a.cmd == "merge":
            from .shards import merge

            idx = merge(a.dirs, a.manifest, a.out, a.work)
            print(f"merged {len(a.dirs)} partial builds: {len(idx['entries'])} entries into {a.out}")
        elif a.cmd == "check-build":
            from .pack import check_build

            doc = check_build(a.dir, a.manifest, allow_partial=a.allow_partial)
            print(f"{a.dir}: ok, {len(doc['entries'])} entries of {a.manifest}" + (" (a partial build)" if doc.get("partial") else "")
                  + ", every file as the index names it")
        elif a.cmd == "unpack":
            from .pack import unpack

            n = unpack(a.dir, a.out)
            print(f"{a.dir}: {n} entries unpacked into {a.out} (cubins/<sha256>.cubin, launchers/<entry id>.py)")
        elif a.cmd == "lift-verify":
            from .build import lift_and_verify

            print(lift_and_verify(a.entry_dir))
        elif a.cmd == "fidelity":
            from pathlib import Path

            from . import fidelity

            dirs = []
            for d in map(Path, a.dirs):
                dirs += [d] if (d / "meta.json").is_file() else sorted(e for e in (d / "entries").iterdir() if (e / "meta.json").is_file())
            from .build import check_fidelity

            if a.no_write:
                res = fidelity.check(dirs, jobs=a.jobs, progress=True, adopt=False)
            else:
                res = check_fidelity(dirs, jobs=a.jobs, progress=True)
            for i, r in res.items():
                print(f"{r['verdict']:15} {r['seconds']:6.2f}s  {i}" + (f"  ({r['note']})" if r.get("note") else ""))
            fidelity.require_identical(res)
    except AotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
