"""Stage 1 — manifest: read a TOML manifest, validate it, expand buckets into compile entries.

A manifest names build *targets* (an arch plus the device parameters cudnn would otherwise read from
a GPU at compile time, e.g. the SM count) and *buckets*. A bucket names one op of one kernel family
and gives each key field a value or a list of values; it expands to the cartesian product.
Validation collects every problem before raising (file, entry, allowed values) and never executes
anything from the file: TOML is data, and family names are looked up in the fixed registry (dsa_aot.policy.families).

Public function: :func:`load` -> :class:`Manifest`; ``Manifest.entries`` is the expanded list.
"""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ManifestError
from ..policy.arch import KNOWN as KNOWN_ARCHES

__all__ = ["Target", "Entry", "Manifest", "load", "loads"]


@dataclass(frozen=True)
class Target:
    """A build target: the arch cubins are compiled for and the device facts the kernels bake in."""

    name: str
    arch: str
    sm_count: int
    qualified: bool = False  # the manifest has other targets of this arch: entry ids carry the SM count


@dataclass(frozen=True)
class Entry:
    """One concrete compile: (family, op, key) for one target. ``key`` is a sorted tuple of pairs."""

    family: str
    op: str
    key: tuple
    target: Target

    @property
    def key_dict(self) -> dict:
        return dict(self.key)

    @property
    def id(self) -> str:
        """Readable, unique, filesystem-safe name, e.g. csa_compressor.bwd.coff2.d128.deterministic.ratio4.sm_90a
        (``...sm_100a.sm160`` where the manifest has several targets of the arch)."""
        t = self.target
        return ".".join([self.family, self.op, *(_fmt(k, v) for k, v in self.key), t.arch] + ([f"sm{t.sm_count}"] if t.qualified else []))


def _toml(v) -> str:
    return str(v).lower() if isinstance(v, bool) else repr(v)


def _fmt(k, v) -> str:
    if isinstance(v, bool):
        return k if v else f"no{k}"
    return v if isinstance(v, str) else f"{k}{v}"


@dataclass(frozen=True)
class Manifest:
    path: str
    targets: tuple
    entries: tuple = field(default=())


def load(path) -> Manifest:
    """Read and validate ``path``; raise :class:`ManifestError` listing every problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ManifestError(path, [f"cannot read the file: {e.strerror}"]) from None
    return loads(text, path)


def loads(text: str, path="<string>") -> Manifest:
    problems: list[str] = []
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(path, [f"not valid TOML: {e}"]) from None

    unknown_top = sorted(set(doc) - {"target", "bucket", "format"})
    if unknown_top:
        problems.append(f"unknown top-level key(s) {unknown_top} (expected: format, [[target]], [[bucket]])")
    if doc.get("format", 1) != 1:
        problems.append(f"format = {doc.get('format')!r} (expected 1)")

    targets = _targets(doc.get("target"), problems)
    # imported here, not at the top: a compile process imports this module and must not import the
    # registry (dsa_aot.toolchain.zygote: its state depends on its own family only)
    from ..policy.families import FAMILIES, family_policy

    entries: list[Entry] = []
    seen: dict[tuple, str] = {}
    buckets = doc.get("bucket", [])
    if not isinstance(buckets, list) or not buckets:
        problems.append("no [[bucket]] tables (expected at least one)")
        buckets = []
    for i, b in enumerate(buckets):
        where = f"bucket #{i + 1}"
        if not isinstance(b, dict):
            problems.append(f"{where}: must be a table")
            continue
        family, op = b.get("family"), b.get("op")
        where = f"bucket #{i + 1} ({family}/{op})"
        if family not in FAMILIES:
            problems.append(f"{where}: unknown family {family!r} (allowed: {sorted(FAMILIES)})")
            continue
        ops = family_policy(family).OPS
        if op not in ops:
            problems.append(f"{where}: unknown op {op!r} of family {family} (allowed: {sorted(ops)})")
            continue
        fields = ops[op].fields
        given = {k: v for k, v in b.items() if k not in ("family", "op", "targets")}
        for k in sorted(set(given) - set(fields)):
            problems.append(f"{where}: unknown field {k!r} (fields of {op}: {sorted(fields)})")
        for k in sorted(set(fields) - set(given)):
            problems.append(f"{where}: missing field {k!r} (allowed values: {fields[k].describe()})")
        values: dict[str, list] = {}
        for k, spec in fields.items():
            if k not in given:
                continue
            raw = given[k] if isinstance(given[k], list) else [given[k]]
            if not raw:
                problems.append(f"{where}: field {k!r} is an empty list")
            ok = []
            for v in raw:
                if spec.accepts(v):
                    ok.append(v)
                else:
                    problems.append(f"{where}: {k} = {v!r} is outside the kernel's envelope (allowed: {spec.describe()})")
            values[k] = ok
        tnames = b.get("targets", [t.name for t in targets])
        if not isinstance(tnames, list):
            tnames = [tnames]
        chosen = []
        for tn in tnames:
            match = [t for t in targets if t.name == tn]
            if not match:
                problems.append(f"{where}: unknown target {tn!r} (targets: {[t.name for t in targets]})")
            chosen.extend(match)
        if set(values) != set(fields):
            continue
        names = sorted(values)
        for combo in itertools.product(*(values[n] for n in names)):
            key = tuple(zip(names, combo))
            why = ops[op].invalid(dict(key))
            if why:
                problems.append(f"{where}: {dict(key)} is not a valid combination: {why}")
                continue
            for t in chosen:
                if ops[op].arches is not None and t.arch not in ops[op].arches:
                    problems.append(f"{where}: {family}/{op} exists for {sorted(ops[op].arches)} only, not target {t.name} ({t.arch}); set targets = [...] on the bucket")
                    continue
                e = Entry(family, op, ops[op].normalise(key), t)
                ident = (family, op, e.key, t.name)
                if ident in seen:
                    problems.append(f"{where}: duplicate bucket {dict(key)} for target {t.name} (already in {seen[ident]})")
                    continue
                seen[ident] = where
                entries.append(e)
    # what the run time finds for a target (dsa_aot.runtime.index.Index.find): the entry of that target, or, for an
    # op that does not bake the SM count in, the entry of another target of the same arch
    present = {(e.family, e.op, e.key, w) for e in entries for w in (("target", e.target.name), ("arch", e.target.arch))}
    for e in entries:
        pol = family_policy(e.family)
        for op, k in pol.OPS[e.op].requires(e.key_dict):
            where = ("target", e.target.name) if op in pol.SM_COUNT_OPS else ("arch", e.target.arch)
            if (e.family, op, tuple(sorted(k.items())), where) not in present:
                problems.append(
                    f"{e.id}: needs {e.family}/{op} {k} for target {e.target.name} at run time; add a [[bucket]] with family = {e.family!r}, op = {op!r}"
                    + "".join(f", {kk} = {_toml(vv)}" for kk, vv in k.items())
                )
    if problems:
        raise ManifestError(path, problems)
    return Manifest(str(path), tuple(targets), tuple(entries))


def _targets(raw, problems) -> list[Target]:
    if not isinstance(raw, list) or not raw:
        problems.append("no [[target]] tables (expected at least one, e.g. arch = 'sm_100a', sm_count = 148)")
        return []
    out, names = [], set()
    for i, t in enumerate(raw):
        where = f"target #{i + 1}"
        if not isinstance(t, dict):
            problems.append(f"{where}: must be a table")
            continue
        extra = sorted(set(t) - {"name", "arch", "sm_count"})
        if extra:
            problems.append(f"{where}: unknown field(s) {extra} (fields: name, arch, sm_count)")
        name, arch, sms = t.get("name"), t.get("arch"), t.get("sm_count")
        bad = False
        if not isinstance(name, str) or not name.isidentifier():
            problems.append(f"{where}: name = {name!r} (expected an identifier such as 'b200')")
            bad = True
        elif name in names:
            problems.append(f"{where}: duplicate target name {name!r}")
            bad = True
        if arch not in KNOWN_ARCHES:
            problems.append(f"{where}: unknown arch {arch!r} (allowed: {sorted(KNOWN_ARCHES)})")
            bad = True
        if not isinstance(sms, int) or isinstance(sms, bool) or not 1 <= sms <= 1024:
            problems.append(f"{where}: sm_count = {sms!r} (expected an integer in [1, 1024], e.g. 148 for B200, 132 for H200)")
            bad = True
        if not bad and any(o.arch == arch and o.sm_count == sms for o in out):
            # two targets of one arch differ by what they bake in: the SM count
            other = next(o for o in out if o.arch == arch and o.sm_count == sms)
            problems.append(f"{where}: {arch} with {sms} SMs is target {other.name!r} already (targets of one arch differ in sm_count)")
            bad = True
        if not bad:
            names.add(name)
            out.append(Target(name, arch, sms))
    # several SM counts of one arch: their entries' ids name the SM count, so that both ship
    return [Target(t.name, t.arch, t.sm_count, sum(o.arch == t.arch for o in out) > 1) for t in out]
