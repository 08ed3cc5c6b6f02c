"""dsa_aot.toolchain.shards: the split every machine computes alike, merge's refusals, and (with the build
toolchain installed) shards 1/2 + 2/2 merged byte-identical to a one-machine build of the same manifest."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from dsa_aot.errors import PackError
from dsa_aot.toolchain import manifest, shards
from build_files import SMALL_MANIFEST as SMALL
from build_files import entries_of, group_file, rewrite_group

from dsa_aot.runtime.index import Index

ROOT = Path(__file__).resolve().parents[3]


def test_the_split_covers_each_entry_once_is_deterministic_and_balances_by_seconds():
    """Each entry in exactly one shard, the same split on every run, no shard costing (seconds plus one zygote
    boot per (arch, family) group it touches) more than the mean by one entry and one boot, and each group on
    one shard or neighbouring ones: N shards boot at most N - 1 zygotes more than one machine."""
    m = manifest.load(ROOT / "manifests" / "default.toml")
    ids = [e.id for e in m.entries]
    groups = {(e.target.arch, e.family) for e in m.entries}

    def cost(p, seconds):
        return sum(seconds.get(e.id, shards.ENTRY_SECONDS) for e in p) + shards.GROUP_SECONDS * len({(e.target.arch, e.family) for e in p})

    for n, seconds in [(n, {}) for n in (1, 2, 3, 4, 8)] + [(4, {i: 1.0 + int(hashlib.sha256(i.encode()).hexdigest(), 16) % 40 for i in ids})]:
        parts = [shards.select_shard(m.entries, i, n, seconds or None) for i in range(1, n + 1)]
        got = [e.id for p in parts for e in p]
        assert sorted(got) == sorted(ids) and len(got) == len(ids), "every entry in exactly one shard"
        assert all([e.id for e in p] == [i for i in ids if i in ps] for p in parts for ps in [{x.id for x in p}]), "manifest order within a shard"
        assert parts == [shards.select_shard(list(m.entries), i, n, seconds or None) for i in range(1, n + 1)], "the same split again"
        costs = [cost(p, seconds) for p in parts]
        assert max(costs) <= sum(costs) / n + max(seconds.values(), default=shards.ENTRY_SECONDS) + shards.GROUP_SECONDS, costs
        assert sum(len({(e.target.arch, e.family) for e in p}) for p in parts) <= len(groups) + n - 1
    # one slow entry: its shard holds fewer entries, the costs still balance
    seconds = {i: 7.0 for i in ids}
    seconds[ids[0]] = 0.2 * 7.0 * len(ids)
    parts = [shards.select_shard(m.entries, i, 2, seconds) for i in (1, 2)]
    costs = [cost(p, seconds) for p in parts]
    assert max(costs) <= sum(costs) / 2 + 7.0 + shards.GROUP_SECONDS and min(len(p) for p in parts) < 0.45 * len(ids), costs
    # an entry the report lacks weighs the median
    del seconds[ids[1]]
    assert sorted(e.id for i in (1, 2) for e in shards.select_shard(m.entries, i, 2, seconds)) == sorted(ids)


def test_seconds_come_from_a_build_report_or_a_shards_seconds(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps([{"id": "a", "kernel": "k1", "compile_s": 2.0, "lift_verify_s": 1.0, "fidelity_s": 3.0},
                                                      {"id": "a", "kernel": "k2", "compile_s": 2.0, "lift_verify_s": 1.0, "fidelity_s": 3.0}]))
    (tmp_path / "seconds.json").write_text(json.dumps({"b": {"compile_s": 1.5, "lift_verify_s": 0.5, "fidelity_s": 0.0}}))
    assert shards.seconds_of(tmp_path / "report.json") == {"a": 6.0}
    assert shards.seconds_of(tmp_path / "seconds.json") == {"b": 2.0}
    with pytest.raises(PackError, match="cannot read the build report"):
        shards.seconds_of(tmp_path / "missing.json")
    for bad in ("0/2", "3/2", "1", "a/b"):
        with pytest.raises(ValueError, match="I/N"):
            shards.parse_shard(bad)
    assert shards.parse_shard("2/4") == (2, 4)


def test_an_entry_weighs_every_fidelity_look_it_took(tmp_path):
    """An entry the second and third looks checked (the two-CTA ones) costs the fidelity stage several compiles:
    its weight is ``check_seconds``, not the first look's ``seconds`` (with those alone the shard that held the
    two-CTA entries still finished last)."""
    dirs = []
    for ident in ("one", "three"):
        d = tmp_path / ident
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({"id": ident, "compile_seconds": 2.0}))
        dirs.append(d)
    verdicts = {"one": {"verdict": "identical", "seconds": 3.0}, "three": {"verdict": "identical", "seconds": 3.0, "check_seconds": 11.5}}
    got = shards.entry_seconds(dirs, {"one": 0.5}, verdicts)
    assert got == {"one": {"compile_s": 2.0, "lift_verify_s": 0.5, "fidelity_s": 3.0}, "three": {"compile_s": 2.0, "lift_verify_s": 0.0, "fidelity_s": 11.5}}




def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A one-machine build of SMALL and its two shards (sharing one compile cache, as machines restoring a CI cache would)."""
    pytest.importorskip("cutlass")  # the build toolchain: installed by ci/setup.sh
    pytest.importorskip("cudnn")
    from dsa_aot.toolchain import build

    root = tmp_path_factory.mktemp("shards")
    (root / "m.toml").write_text(SMALL)
    cache = root / "cache"
    build.build(root / "m.toml", root / "whole", root / "work-whole", cache, jobs=2, progress=False)
    for i in (1, 2):
        build.build(root / "m.toml", root / f"part{i}", root / f"work{i}", cache, jobs=2, progress=False, shard=(i, 2),
                    balance=root / "work-whole" / "report.json")
    return root


def test_two_shards_merged_equal_the_one_machine_build_byte_for_byte(built):
    recs = [json.loads((built / f"part{i}" / "shard.json").read_text()) for i in (1, 2)]
    assert sorted(len(r["entries"]) for r in recs) == [1, 2] and all(r["fidelity"] for r in recs)
    index = shards.merge([built / "part2", built / "part1"], built / "m.toml", built / "merged", built / "work-merged")
    assert len(index["entries"]) == 3
    whole, merged = _tree(built / "whole"), _tree(built / "merged")
    assert whole.keys() == merged.keys() and whole == merged, "merged tree differs from the one-machine build"
    assert all(e["fidelity"]["verdict"] == "identical" for e in index["entries"])  # the build's records (not shipped)
    assert {e["id"] for e in entries_of(built / "merged")} == {e["id"] for e in index["entries"]}
    rows = json.loads((built / "work-merged" / "report.json").read_text())
    assert {r["id"] for r in rows} == {e["id"] for e in index["entries"]} and all("lift_verify_s" in r for r in rows)


def test_merge_refuses_what_is_not_the_n_shards_of_this_manifest(built, tmp_path):
    def refused(dirs, match, m=built / "m.toml"):
        with pytest.raises(PackError, match=match):
            shards.merge(dirs, m, tmp_path / "out")
        assert not (tmp_path / "out").exists(), "nothing written"

    refused([built / "part1"], r"expected each of \['1/2', '2/2'\] once")
    refused([built / "part1", built / "part1"], "more than one shard")
    other = tmp_path / "other.toml"
    other.write_text(SMALL.replace("dim = 576", "dim = 512"))
    refused([built / "part1", built / "part2"], "built from another manifest", other)
    fake = tmp_path / "fake"
    shutil.copytree(built / "part2", fake)
    rec = json.loads((fake / "shard.json").read_text())
    (fake / "shard.json").write_text(json.dumps(rec | {"samples": 77}))
    refused([built / "part1", fake], "different samples settings")
    refused([built / "part1", tmp_path], "not a partial build")
    gone = tmp_path / "gone"
    shutil.copytree(built / "part2", gone)
    victim = next((gone / "entries").iterdir())
    (victim / "launcher.py").unlink()
    refused([built / "part1", gone], "lacks launcher.py")


def test_a_merged_build_is_checked_before_it_ships(built, tmp_path):
    """check-build (what the wheel build runs on AOT_PREBUILT): the merged tree passes; a changed cubin, or
    another manifest's build, a damaged or missing index.sha256, is refused."""
    from dsa_aot.toolchain import pack

    merged = tmp_path / "merged"
    shards.merge([built / "part1", built / "part2"], built / "m.toml", merged)
    assert len(pack.check_build(merged, built / "m.toml")["entries"]) == 3
    other = tmp_path / "other.toml"
    other.write_text(SMALL.replace('split = false', 'split = true'))
    with pytest.raises(PackError, match="not the manifest's"):
        pack.check_build(merged, other)
    e = entries_of(merged)[0]
    rewrite_group(merged, e, "cubin", lambda b: b[:-1] + bytes([b[-1] ^ 1]))  # consistent above the member: its own sha256 catches it
    with pytest.raises(PackError, match=r"member \S+ in group \S+ .* is corrupted"):
        pack.check_build(merged, built / "m.toml")
    group = group_file(merged, e)
    group.write_bytes(group.read_bytes()[:-8])
    with pytest.raises(PackError, match=rf"group {e['cubin']} .* is corrupted"):
        pack.check_build(merged, built / "m.toml")
    # the index itself is checked as the runtime loads it
    (merged / "index.sha256").write_text("0" * 64)
    with pytest.raises(PackError, match="index.json is corrupted"):
        pack.check_build(merged, built / "m.toml")
    (merged / "index.sha256").unlink()
    with pytest.raises(PackError, match="index.sha256 is missing"):
        pack.check_build(merged, built / "m.toml")


def test_only_builds_the_matching_entries_as_a_partial_build_that_does_not_ship(built, tmp_path):
    """build --only REGEX: the matching entries, their files byte for byte the whole build's, an index that
    says it is partial; check-build refuses it unless asked, and a regex matching nothing is refused."""
    from dsa_aot.errors import ManifestError
    from dsa_aot.toolchain import build, pack

    whole = json.loads((built / "whole" / "index.json").read_text())
    whole_entries = entries_of(built / "whole")
    pick = whole_entries[1]["id"]
    idx = build.build(built / "m.toml", tmp_path / "only", tmp_path / "work", built / "cache", jobs=2, progress=False, only=re.escape(pick))
    assert [e["id"] for e in idx["entries"]] == [pick]
    doc = json.loads((tmp_path / "only" / "index.json").read_text())
    assert doc["partial"] == {"only": re.escape(pick), "entries": 1, "of": len(whole_entries)} and "partial" not in whole
    (got,) = entries_of(tmp_path / "only")
    want = next(e for e in whole_entries if e["id"] == pick)
    assert got == want
    for what in ("cubin", "launcher"):
        assert Index(tmp_path / "only").member(got, what) == Index(built / "whole").member(want, what)
    with pytest.raises(PackError, match=r"a partial build \(--only"):
        pack.check_build(tmp_path / "only", built / "m.toml")
    assert [e["id"] for e in pack.check_build(tmp_path / "only", built / "m.toml", allow_partial=True)["entries"]] == [pick]
    for bad, match in (("no-such-entry", "matches none"), ("(", "not a regular expression")):
        with pytest.raises(ManifestError, match=match):
            build.build(built / "m.toml", tmp_path / "none", tmp_path / "work", built / "cache", jobs=2, progress=False, only=bad)
    assert not (tmp_path / "none").exists()
